"""Writing new K/V into a cache's stacks: each row at its own slots, against NumPy; a write
that does not fit is dropped, never clamped onto the last slots."""

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.model.cache_writes import write_rows, write_slots


def test_rows_write_at_their_own_starts_and_a_row_that_does_not_fit_writes_nothing():
    rng = np.random.default_rng(0)
    stack = rng.normal(size=(2, 3, 2, 8, 4)).astype(np.float32)  # [L, B, K, S, H]
    new = rng.normal(size=(3, 3, 2, 4)).astype(np.float32)  # [B, T, K, H]
    starts, fits = np.array([0, 5, 6]), np.array([True, True, False])  # row 2: 6 + 3 > 8
    out = np.asarray(jax.jit(write_rows)(jnp.asarray(stack), 1, jnp.asarray(new),
                                         jnp.asarray(starts), jnp.asarray(fits)))
    expected = stack.copy()
    for b in range(2):
        expected[1, b, :, starts[b]:starts[b] + 3] = new[b].transpose(1, 0, 2)
    np.testing.assert_array_equal(out, expected)


def test_given_slots_write_where_they_say_and_slots_past_the_end_are_dropped():
    rng = np.random.default_rng(1)
    scales = rng.normal(size=(1, 2, 2, 5)).astype(np.float32)  # an int8 cache's [L, B, K, S]
    new = rng.normal(size=(2, 3, 2)).astype(np.float32)  # [B, T, K]
    slots = np.array([[4, 0, 1], [5, 2, 5]])  # a ring wrapping round; 5: dropped
    out = np.asarray(jax.jit(write_slots)(jnp.asarray(scales), 0, jnp.asarray(new),
                                          jnp.asarray(slots)))
    expected = scales.copy()
    for b, t in np.ndindex(2, 3):
        if slots[b, t] < 5:
            expected[0, b, :, slots[b, t]] = new[b, t]
    np.testing.assert_array_equal(out, expected)
