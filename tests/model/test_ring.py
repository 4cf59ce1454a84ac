"""Windowed layers' rings (`model/ring.py`): the logits of a cache of every position, the
slots each ring holds against a NumPy account of its writes, the calls a ring refuses (the
bytes rings hold: test_cache_size.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import model as M
from kvjax.model.paged import copy_row_into_pages
from kvjax.model.ring import ring_inputs

WINDOW = 5
PROMPT_LENGTHS = np.array([12, 3, 7], np.int32)  # longer than a ring, shorter than a window


def _config(**changes) -> M.TransformerConfig:
    """Gemma 2 and 3's kind of model: windowed layers beside a global one (layer 1)."""
    return M.TransformerConfig(**{
        "vocab_size": 64, "d_model": 32, "num_heads": 4, "num_kv_heads": 2, "d_ff": 64,
        "num_encoder_layers": 0, "num_decoder_layers": 3, "max_len": 64,
        "sliding_window": WINDOW, "full_attention_layers": (1,), "scan_layers": False,
        **changes})


def _feed(config, params, tokens_BX, step_tokens, calls, rings: bool):
    """Logits [B, X', V] of the prompts (`PROMPT_LENGTHS` of `tokens`) and then `calls`
    calls of `step_tokens` more of each row's tokens through a cache made for such calls
    (with `rings`; else every layer holding every position), and the cache."""
    batch = tokens_BX.shape[0]
    prompt_BP = np.where(np.arange(12) < PROMPT_LENGTHS[:, None], tokens_BX[:, :12], 0)
    logits_BV, cache = M.prefill(config, params, jnp.asarray(prompt_BP),
                                 jnp.asarray(PROMPT_LENGTHS), 48,
                                 step_tokens=step_tokens if rings else None)
    step = M.step_fn(config, params)
    out, width = [logits_BV[:, None]], step_tokens
    for call in range(calls):
        starts = PROMPT_LENGTHS + call * width
        new_BT = np.stack([tokens_BX[b, s:s + width] for b, s in enumerate(starts)])
        logits_BTV, cache = step(jnp.asarray(new_BT), cache)
        out.append(logits_BTV)
    return np.concatenate([np.asarray(x) for x in out], axis=1).reshape(batch, -1), cache


@pytest.mark.parametrize("changes, step_tokens", [
    ({}, 1),  # plain decoding
    ({}, 3),  # a speculative step verifying two drafted tokens
    ({"full_attention_layers": (), "scan_layers": True, "cache_dtype": "int8"}, 2),  # Mistral
], ids=["hybrid", "hybrid-3-a-call", "every-layer-scanned-int8"])
def test_rings_give_the_logits_of_a_cache_of_every_position(changes, step_tokens):
    config = _config(**changes)
    params = M.init_params(config, jax.random.key(0))
    tokens_BX = np.random.default_rng(0).integers(1, 64, (3, 40)).astype(np.int32)
    calls = 12 // step_tokens
    every_position, full = _feed(config, params, tokens_BX, step_tokens, calls, rings=False)
    in_rings, ring = _feed(config, params, tokens_BX, step_tokens, calls, rings=True)
    slots = WINDOW + step_tokens - 1
    assert ring.ring_slots == slots and ring.capacity == full.capacity == 48
    windowed = [config.attention_reach is not None or i != 1 for i in range(len(ring.k))]
    assert [k.shape[-2] for k in ring.k] == [slots if w else 48 for w in windowed]
    assert ring.nbytes < full.nbytes
    np.testing.assert_array_equal(ring.lengths, full.lengths)
    np.testing.assert_allclose(in_rings, every_position, atol=2e-5, rtol=1e-5)
    if config.cache_dtype is None:  # the same as no cache at all, row by row
        for b, length in enumerate(PROMPT_LENGTHS):
            uncached = M.teacher_forced_logits(
                config, params, {"inputs": jnp.asarray(tokens_BX[b:b + 1, :length + 12])})
            seen = np.asarray(uncached)[0, length - 1:length + 12]
            np.testing.assert_allclose(in_rings[b].reshape(-1, 64)[:13], seen, atol=2e-5,
                                       rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [None, "int8"], ids=["float", "int8"])
def test_a_paged_cache_keeps_windowed_layers_in_rings_beside_the_global_layers_pool(cache_dtype):
    """The windowed layers 0 and 2 keep a ring per row, the global layer 1 a pool of pages
    in a scrambled order: rows copied in from a contiguous prefill (`copy_row_into_pages`)
    and a prefill straight into the pages decode as a contiguous cache of every position
    (an int8 cache's scales held, copied and read with their values)."""
    config = _config(cache_dtype=cache_dtype)
    params = M.init_params(config, jax.random.key(0))
    tokens_BX = np.random.default_rng(2).integers(1, 64, (3, 40)).astype(np.int32)
    prompt_BP = jnp.asarray(np.where(np.arange(12) < PROMPT_LENGTHS[:, None],
                                     tokens_BX[:, :12], 0))
    lengths_B = jnp.asarray(PROMPT_LENGTHS)
    _, full = M.prefill(config, params, prompt_BP, lengths_B, 48)
    tables = np.random.default_rng(3).permutation(40)[:36].reshape(3, 12).astype(np.int32)
    paged = M.init_paged_cache(config, 3, 40, 4, 12, step_tokens=1).replace(
        pages=jnp.asarray(tables))
    assert paged.rings == (True, False, True) and paged.capacity == 48
    assert [k.shape[1:4] for k in paged.k] == [(3, 2, WINDOW), (40, 2, 4), (3, 2, WINDOW)]
    copied = paged
    for row in range(3):
        copied = copy_row_into_pages(copied, full, row, row)
    _, prefilled = M.prefill(config, params, prompt_BP, lengths_B, cache=paged)
    step = M.step_fn(config, params)
    caches, logits = [full, copied, prefilled], [[], [], []]
    for t in range(10):
        new_B1 = jnp.asarray(tokens_BX[np.arange(3), PROMPT_LENGTHS + t][:, None])
        for i, cache in enumerate(caches):
            out, caches[i] = step(new_B1, cache)
            logits[i].append(np.asarray(out))
    for cache in caches[1:]:
        np.testing.assert_array_equal(cache.lengths, caches[0].lengths)
        assert not cache.overflow.any()
    np.testing.assert_allclose(logits[1], logits[0], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(logits[2], logits[0], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("changes", [
    {}, {"full_attention_layers": (), "scan_layers": True, "cache_dtype": "int8"}],
    ids=["hybrid", "every-layer-scanned-int8"])
def test_rows_taken_into_rings_hold_what_copying_each_row_in_holds(changes):
    """`rows_in_rings` (a kept prompt continued) gathers rows, repeats among them, of a cache
    of every position into rings: what `copy_row` puts into an empty cache of rings."""
    config = _config(**changes)
    params = M.init_params(config, jax.random.key(0))
    prompt_BP = jnp.asarray(np.random.default_rng(4).integers(1, 64, (3, 12)), jnp.int32)
    _, full = M.prefill(config, params, prompt_BP, jnp.asarray(PROMPT_LENGTHS), 48)
    rows = jnp.asarray([2, 0, 0, 1])
    taken = M.rows_in_rings(config, full, rows, 2)
    copied = M.init_cache(config, 4, 48, step_tokens=2)
    for into, row in enumerate(rows.tolist()):
        copied = copied.copy_row(full, row, into, 16)
    assert taken.rings == copied.rings and taken.ring_slots == WINDOW + 1
    for name in ("k", "v", "k_scale", "v_scale"):
        for got, want in zip(getattr(taken, name) or (), getattr(copied, name) or (),
                             strict=True):
            assert got.shape == want.shape
            if got.shape[-2] == 48:  # every position: the rows' filled slots
                for into, row in enumerate(rows.tolist()):
                    length = PROMPT_LENGTHS[row]
                    np.testing.assert_array_equal(got[:, into, :, :length],
                                                  want[:, into, :, :length])
            else:  # a ring: the slots that hold a position
                for into, row in enumerate(rows.tolist()):
                    held = min(PROMPT_LENGTHS[row], WINDOW + 1)
                    slots = [p % (WINDOW + 1) for p in range(PROMPT_LENGTHS[row] - held,
                                                             PROMPT_LENGTHS[row])]
                    np.testing.assert_array_equal(got[:, into, :, slots],
                                                  want[:, into, :, slots])
    np.testing.assert_array_equal(taken.lengths, PROMPT_LENGTHS[rows])


def test_a_ring_masks_and_writes_what_a_numpy_account_of_its_slots_says():
    rng = np.random.default_rng(1)
    slots, window, batch = 7, 4, 5
    held = np.full((batch, slots), -1)  # the position each slot holds; -1: none yet
    lengths = np.zeros(batch, np.int64)
    for call in range(12):
        num_tokens = 9 if call == 0 else int(rng.integers(1, slots - window + 2))
        valid = rng.integers(0, num_tokens + 1, batch) if call else np.full(batch, 9)
        fits = rng.random(batch) < 0.9
        new_lengths = np.where(fits, lengths + valid, lengths)
        positions = lengths[:, None] + np.arange(num_tokens)
        mask, writes = ring_inputs(window, slots, jnp.asarray(positions, jnp.int32),
                                   jnp.asarray(lengths, jnp.int32),
                                   jnp.asarray(new_lengths, jnp.int32))
        for b in range(batch):  # a row keeps the last `slots` of its written positions
            for p in range(max(lengths[b], new_lengths[b] - slots), new_lengths[b]):
                held[b, p % slots] = p
        expected_writes = np.where(
            (np.arange(num_tokens) < new_lengths[:, None] - lengths[:, None])
            & (positions >= new_lengths[:, None] - slots), positions % slots, slots)
        np.testing.assert_array_equal(writes, expected_writes)
        seen = ((held[:, None, :] >= 0) & (held[:, None, :] <= positions[:, :, None])
                & (held[:, None, :] > positions[:, :, None] - window))
        np.testing.assert_array_equal(mask, seen)
        lengths = new_lengths


def test_a_ring_refuses_a_longer_call_and_moving_rows_by_slots():
    config = _config()
    params = M.init_params(config, jax.random.key(0))
    prompt_BP = jnp.ones((3, 12), jnp.int32)
    _, cache = M.prefill(config, params, prompt_BP, jnp.asarray(PROMPT_LENGTHS), 48,
                         step_tokens=2)
    step = M.step_fn(config, params)
    step(jnp.ones((3, 2), jnp.int32), cache)  # what it was made for
    with pytest.raises(ValueError, match="a call of 3 tokens per row after the prefill needs "
                       "rings of at least 7 slots; this cache's windowed layers keep 6"):
        step(jnp.ones((3, 3), jnp.int32), cache)
    np.testing.assert_array_equal(cache.take_rows(jnp.asarray([2, 0])).lengths, [7, 12])
    with pytest.raises(ValueError, match="KVCache.take_prefixes moves rows by their slots"):
        cache.take_prefixes(jnp.asarray([0]), jnp.asarray([4]), 16)
    with pytest.raises(ValueError, match="KVCache.put_rows moves rows by their slots"):
        M.init_cache(config, 3, 48).put_rows(cache, jnp.asarray([0]), jnp.asarray([1]))
    with pytest.raises(ValueError, match="step_tokens=0 must be >= 1"):
        M.init_cache(config, 3, 48, step_tokens=0)
    # No ring where it would not be smaller, nor where a position bias reads slots.
    assert M.init_cache(config, 3, WINDOW, step_tokens=1).ring_slots is None
    alibi = _config(positional_encoding="alibi")
    assert M.init_cache(alibi, 3, 48, step_tokens=1).ring_slots is None
