"""KVCache's row operations against NumPy: what each row holds after the operation."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import model as M


def test_take_prefixes_holds_each_rows_first_slots_in_fewer_slots():
    config = M.preset("tiny", num_kv_heads=2, cache_dtype="int8")
    cache = M.init_cache(config, batch_size=3, capacity=16)

    def numbered(stack):
        return jnp.arange(stack.size).reshape(stack.shape).astype(stack.dtype)

    cache = cache.replace(k=tuple(map(numbered, cache.k)), v=tuple(map(numbered, cache.v)),
                          k_scale=tuple(map(numbered, cache.k_scale)))
    taken = cache.take_prefixes(jnp.array([2, 0]), jnp.array([5, 9]), capacity=12)
    assert taken.capacity == 12 and taken.batch_size == 2
    np.testing.assert_array_equal(taken.lengths, [5, 9])
    np.testing.assert_array_equal(taken.overflow, [False, False])
    for got, held in zip(taken.k + taken.v + taken.k_scale, cache.k + cache.v + cache.k_scale,
                         strict=True):
        np.testing.assert_array_equal(got, np.asarray(held)[:, [2, 0], :, :12])
    with pytest.raises(ValueError, match=r"capacity=17 must be in \[1, 16\]"):
        cache.take_prefixes(jnp.array([0]), jnp.array([1]), capacity=17)
