"""serve/chunk.py: the decode chunk's admission: the oldest staged sample takes a free slot,
with its whole prompt's cache, however the sample ids wrap."""

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import model as M
from kvjax.serve import chunk, slots


def staged_state(config, ids, lengths, rng):
    """Three free slots; staged rows holding `ids` (waiting) with random cache values."""
    state = slots.empty_state(config, 3, len(ids), config.max_len)
    cache = state.staged.cache

    def noise(stack):
        return jnp.asarray(rng.normal(size=stack.shape), stack.dtype)

    cache = cache.replace(k=tuple(map(noise, cache.k)), v=tuple(map(noise, cache.v)),
                          lengths=jnp.asarray(lengths, jnp.int32))
    staged = state.staged.replace(cache=cache, owner=jnp.asarray(ids, jnp.int32),
                                  running=jnp.ones(len(ids), bool),
                                  last_tokens=jnp.arange(len(ids), dtype=jnp.int32) + 10)
    return state.replace(staged=staged)


def test_the_oldest_staged_sample_goes_first_across_the_ids_wrap(monkeypatch):
    config = M.preset("tiny")
    monkeypatch.setattr(chunk, "COPY_BLOCK", 24)  # 50 positions: blocks at 0, 24 and 40
    top = slots.ID_SPACE - 1
    ids, lengths = [1, top, 0, 2], [7, 50, 3, 12]  # in order of age: top, 0, 1, 2
    state = staged_state(config, ids, lengths, np.random.default_rng(0))
    state = state.replace(last_admitted=jnp.asarray(top - 1, jnp.int32))
    admit = jax.jit(chunk.admit)
    order = []
    for slot in range(3):
        state = admit(state)
        assert int(state.last_admitted) == int(state.slots.owner[slot])
        order.append(int(state.slots.owner[slot]))
        row = ids.index(order[-1])
        length = lengths[row]
        assert int(state.slots.cache.lengths[slot]) == length
        assert int(state.slots.last_tokens[slot]) == 10 + row
        assert bool(state.slots.running[slot]) and not bool(state.staged.running[row])
        for taken, source in zip(state.slots.cache.k + state.slots.cache.v,
                                 state.staged.cache.k + state.staged.cache.v, strict=True):
            np.testing.assert_array_equal(taken[:, slot, :, :length],
                                          source[:, row, :, :length])
    assert order == [top, 0, 1]
    assert np.asarray(state.staged.running).tolist() == [False, False, False, True]
