"""Decode attention in blocks of cache slots (`attend_blocks`): equal to full attention and to
the NumPy formula, blind to what unused slots hold, and running fewer blocks for short rows."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_tokens, run_cached, run_full, start_cache, steps_traced_anew
from test_attention import numpy_attention

from kvjax import decode
from kvjax import model as M
from kvjax.model import attention, attention_layers

# With no layer read in one pass (a CPU's default) on every backend, so that `whole_share`
# chooses; `one_read_bytes=ONE_READ` reads any layer in one pass (an accelerator's default).
blocked = jax.jit(functools.partial(attention.attend_blocks, one_read_bytes=0),
                  static_argnums=5, static_argnames=("whole_share", "one_read_bytes"))
ONE_READ = 1 << 40
# `whole_share` settings that force each of the two ways to read the cache: the loop over the
# filled blocks, or one product over every slot.
WAYS = pytest.mark.parametrize("share", [float("inf"), 0.0], ids=["blocks", "whole"])
DEFAULT_ONE_READ_MAX_BYTES = attention.one_read_max_bytes


# The whole models here read their caches by blocks on every backend.
pytestmark = pytest.mark.usefixtures("layers_read_by_blocks")


def relative_error(out, reference):
    return float(np.max(np.abs(np.asarray(out, np.float64) - reference)) /
                 np.max(np.abs(reference)))


def cache_inputs(seed, batch, queries, heads, kv_heads, capacity, lengths, dim=8):
    """Queries [B, T, N, H], a cache stack [1, B, K, S, H] of K and V, and the decode mask
    [B, T, S] of rows filled to `lengths` whose T queries are the last T filled slots."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, queries, heads, dim)).astype(np.float32)
    k, v = (rng.normal(size=(1, batch, kv_heads, capacity, dim)).astype(np.float32)
            for _ in range(2))
    positions = np.asarray(lengths)[:, None] - queries + np.arange(queries)
    mask = np.arange(capacity)[None, None] <= positions[:, :, None]
    return q, k, v, mask


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("block", [1, 4, 5, 64])
@WAYS
def test_blocks_equal_full_attention_and_the_formula(heads, kv_heads, block, share):
    # Rows of different lengths, 2 queries each (a chunk after the prefill), a capacity that
    # 4 and 5 do not divide evenly past the longest row (17 slots), and a block larger than
    # the capacity.
    lengths = [17, 3, 9]
    q, k, v, mask = cache_inputs(0, 3, 2, heads, kv_heads, 24, lengths)
    out, blocks = blocked(q, k, v, 0, mask, block, whole_share=share)
    fresh_k, fresh_v = (x[0].transpose(0, 2, 1, 3) for x in (k, v))  # [B, S, K, H]
    full = np.asarray(M.attend(q, fresh_k, fresh_v, jnp.asarray(mask)))
    assert relative_error(out, full) <= 1e-5
    assert relative_error(out, numpy_attention(q, fresh_k, fresh_v, mask)) <= 1e-5
    filled = 17 if share == float("inf") else 24  # the whole way reads every block
    assert int(blocks) == -(-filled // min(block, 24))


@WAYS
def test_rows_without_keys_give_zeros_and_no_nan(share):
    q, k, v, mask = cache_inputs(1, 3, 1, 4, 2, 16, [5, 1, 12])
    mask[1] = False  # row 1 may see nothing
    out, _ = blocked(q, k, v, 0, mask, 4, whole_share=share)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[1], 0.0)
    out, none_run = blocked(q, k, v, 0, np.zeros_like(mask), 4, whole_share=share)
    np.testing.assert_array_equal(out, 0.0)
    assert int(none_run) == 0  # nothing to see: nothing read, whatever the share


@WAYS
def test_nan_in_unused_slots_changes_nothing(share):
    lengths = np.array([6, 2, 11])
    q, k, v, mask = cache_inputs(2, 3, 1, 4, 1, 16, lengths)
    unused = np.arange(16)[None, None, None, :, None] >= lengths[None, :, None, None, None]
    poisoned = [np.where(unused, np.nan, x) for x in (k, v)]
    out = blocked(q, *poisoned, 0, mask, 4, whole_share=share)[0]
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out, blocked(q, k, v, 0, mask, 4, whole_share=share)[0])


def test_reads_a_stack_of_small_layers_whole_at_a_traced_layer():
    lengths = [7, 4]
    q, k, v, mask = cache_inputs(3, 2, 1, 4, 2, 12, lengths)
    # The layer read, poisoned past each row's length, between a NaN layer and another one.
    unused_1B1S1 = np.arange(12)[:, None] >= np.reshape(lengths, (1, -1, 1, 1, 1))
    stack_k, stack_v = (np.concatenate([np.full_like(x, np.nan), np.where(unused_1B1S1, np.nan, x),
                                        -x]) for x in (k, v))
    expected, _ = blocked(q, k, v, 0, mask, 4, whole_share=0.0)  # the one layer, read whole
    out, blocks = blocked(q, stack_k, stack_v, jnp.int32(1), mask, 4, whole_share=float("inf"))
    # Two programs: equal to rounding (bit for bit on a CPU, not on a GPU), and no NaN.
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    assert int(blocks) == 3  # all of them, whatever `whole_share` says


def test_reads_a_stack_of_large_layers_by_blocks_at_a_traced_layer():
    # Layers of 2 x 4 x 1024 x 64 float32 (2 MiB): copying one out of the stack for the
    # whole-layer product would cost more than the blocks it saves.
    q, k, v, mask = cache_inputs(6, 2, 1, 4, 4, 1024, [70, 5], dim=64)
    assert k[0].nbytes > attention.STACKED_WHOLE_MAX_BYTES
    stack_k, stack_v = (np.concatenate([np.full_like(x, np.nan), x]) for x in (k, v))
    expected, _ = blocked(q, k, v, 0, mask, 64, whole_share=float("inf"))  # by blocks
    out, blocks = blocked(q, stack_k, stack_v, jnp.int32(1), mask, 64, whole_share=0.0)
    np.testing.assert_array_equal(out, expected)
    assert int(blocks) == 2


def test_one_read_equals_the_formula_and_ignores_unused_slots():
    # What an accelerator runs: every slot in one pass, NaN in the unused ones changing
    # nothing, a row that sees nothing giving zeros.
    lengths = np.array([17, 3, 9])
    q, k, v, mask = cache_inputs(7, 3, 2, 4, 2, 24, lengths)
    mask[1] = False
    out, blocks = blocked(q, k, v, 0, mask, 4, one_read_bytes=ONE_READ)
    fresh_k, fresh_v = (x[0].transpose(0, 2, 1, 3) for x in (k, v))
    assert relative_error(out, numpy_attention(q, fresh_k, fresh_v, mask)) <= 1e-5
    np.testing.assert_array_equal(out[1], 0.0)
    assert int(blocks) == 6  # all of them
    unused = np.arange(24)[None, None, None, :, None] >= lengths[None, :, None, None, None]
    poisoned = [np.where(unused, np.nan, x) for x in (k, v)]
    np.testing.assert_array_equal(blocked(q, *poisoned, 0, mask, 4, one_read_bytes=ONE_READ)[0],
                                  out)
    assert DEFAULT_ONE_READ_MAX_BYTES() == (
        attention.CPU_ONE_READ_MAX_BYTES if jax.default_backend() == "cpu"
        else attention.ACCELERATOR_ONE_READ_MAX_BYTES)


def test_the_two_ways_agree():
    q, k, v, mask = cache_inputs(4, 3, 2, 4, 2, 24, [17, 3, 9])
    by_blocks, _ = blocked(q, k, v, 0, mask, 4, whole_share=float("inf"))
    whole, _ = blocked(q, k, v, 0, mask, 4, whole_share=0.0)
    assert relative_error(by_blocks, np.asarray(whole, np.float64)) <= 1e-6


# Whole models: decode steps, the encoder-decoder's cross-attention and beam search. -----

VARIANTS = {"decoder_only": 0, "encoder_decoder": 2}
LAYOUTS = {"scanned": True, "unrolled": False}


def small_blocks(variant, layout, block=3, **extra):
    config = M.preset("tiny", num_encoder_layers=VARIANTS[variant], scan_layers=LAYOUTS[layout],
                      positional_encoding="rope", num_kv_heads=2, attention_block=block, **extra)
    return config, M.init_params(config, jax.random.key(0))


def padded_source(config, batch):
    if not config.is_encoder_decoder:
        return None, None
    # 8 source slots, rows of 8 and 3 valid tokens: cross-attention runs blocks of 3 over
    # padding (slots 3..7 of row 1) and over slots a row has but the other does not.
    return random_tokens(5, (batch, 8), config.vocab_size), jnp.array([8, 3], jnp.int32)


# Both layouts of the LM, and the encoder-decoder's cross-attention by blocks scanned here
# and unrolled in the beam search below.
@pytest.mark.parametrize("variant, layout", [("decoder_only", "scanned"),
                                             ("decoder_only", "unrolled"),
                                             ("encoder_decoder", "scanned")])
def test_blocked_decode_steps_equal_the_full_forward(variant, layout):
    config, params = small_blocks(variant, layout)
    tokens = random_tokens(1, (2, 11), config.vocab_size)
    lengths = jnp.array([4, 2], jnp.int32)  # rows of different lengths after the prefill
    source, source_lengths = padded_source(config, 2)
    full = run_full(config, params, tokens, source=source, source_lengths=source_lengths)
    cache = start_cache(config, params, 2, 16, source, source_lengths)
    _, cache = run_cached(config, params, tokens[:, :4], cache, lengths)
    for t in range(7):  # row 0 feeds tokens 4.., row 1 tokens 2..
        step = jnp.stack([tokens[0, 4 + t], tokens[1, 2 + t]])[:, None]
        logits, cache = run_cached(config, params, step, cache)
        for row, position in enumerate((4 + t, 2 + t)):
            assert relative_error(logits[row, 0], np.asarray(full[row, position])) <= 1e-5


# The encoder-decoder's int8 cache holds its self- and cross-attention K/V in int8 with
# their scales: both reads of both kinds of cache, each way.
@pytest.mark.parametrize("variant, cache_dtype", [("decoder_only", None),
                                                  ("encoder_decoder", "int8")])
def test_decode_steps_reading_in_one_pass_equal_reading_by_blocks(variant, cache_dtype,
                                                                  monkeypatch):
    # What an accelerator runs, on this backend: every layer's cache read in one pass.
    config, params = small_blocks(variant, "unrolled", cache_dtype=cache_dtype)
    tokens = random_tokens(3, (2, 9), config.vocab_size)
    source, source_lengths = padded_source(config, 2)
    outputs = []
    for one_read in (0, ONE_READ):
        monkeypatch.setattr(attention, "one_read_max_bytes", lambda one_read=one_read: one_read)
        outputs.append(steps_traced_anew(config, params, tokens, 16, source, source_lengths))
    assert np.isfinite(outputs[1]).all()
    assert relative_error(outputs[1], outputs[0].astype(np.float64)) <= 1e-5


@pytest.mark.parametrize("layout", LAYOUTS)
def test_model_step_ignores_nan_in_unused_cache_slots(layout):
    config, params = small_blocks("decoder_only", layout)
    tokens = random_tokens(2, (2, 6), config.vocab_size)
    cache = start_cache(config, params, 2, 16)
    _, cache = run_cached(config, params, tokens, cache, jnp.array([6, 2], jnp.int32))
    unused = jnp.arange(16)[None, :, None] >= cache.lengths[:, None, None]  # [B, S, 1]

    def poison(stack):  # [L, B, K, S, H]
        return jnp.where(unused[None, :, None], jnp.nan, stack)

    poisoned = cache.replace(k=tuple(map(poison, cache.k)), v=tuple(map(poison, cache.v)))
    step = tokens[:, :1]
    np.testing.assert_array_equal(run_cached(config, params, step, poisoned)[0],
                                  run_cached(config, params, step, cache)[0])


def test_a_step_runs_fewer_blocks_when_rows_are_short(monkeypatch):
    """Counts the blocks each layer's loop runs with a debug callback in a small model. The
    reading policy checked is a CPU's for a layer too large to read in one pass."""
    counts = []

    def counting(*args, **kwargs):
        out, blocks = attend_blocks(*args, **kwargs)
        jax.debug.callback(lambda n: counts.append(int(n)), blocks)
        return out, blocks

    attend_blocks = attention.attend_blocks
    monkeypatch.setattr(attention_layers, "attend_blocks", counting)
    config, params = small_blocks("decoder_only", "unrolled", block=4, max_len=48)
    step = jax.jit(lambda tokens, cache: M.step_fn(config, params)(tokens, cache))
    blocks = []
    for filled in ([2, 3], [2, 8], [2, 30]):
        cache = M.init_cache(config, 2, 40).replace(lengths=jnp.array(filled, jnp.int32))
        jax.block_until_ready(step(jnp.ones((2, 1), jnp.int32), cache))
        jax.effects_barrier()
        blocks.append(set(counts))
        counts.clear()
    # After the step the rows hold 3 and 4 slots (one block of 4), then 3 and 9 (3 blocks):
    # every layer reads that many of the 10 blocks of the capacity. At 3 and 31 (8 blocks,
    # more than `WHOLE_CACHE_SHARE` of the capacity) it reads all 10 in one product.
    assert attention.WHOLE_CACHE_SHARE * 40 < 8 * 4
    assert blocks == [{1}, {3}, {10}]


@pytest.mark.parametrize("variant", VARIANTS)
def test_block_size_changes_no_beam_token_or_score(variant):
    # The default (unrolled) layout chooses per step: blocks of 2 are read one by one while
    # they cover at most a third of the cache (the first 6 steps of the LM's 40-slot cache,
    # 10 of the encoder-decoder's 33), a block of 64 (larger than the cache) always as one.
    # Beam search steps the model as `generate` does and also reorders the cache's rows.
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15]]
    beams = []
    for block in (2, 64):
        config, params = small_blocks(variant, "unrolled", block=block)
        beams.append(decode.beam_search(M.build_model(config), params, prompts,
                                        max_new_tokens=20, num_beams=3))
    np.testing.assert_array_equal(beams[0].tokens, beams[1].tokens)
    np.testing.assert_allclose(beams[0].scores, beams[1].scores, rtol=1e-5)


def test_attention_block_must_be_positive():
    with pytest.raises(ValueError, match="attention_block=0 must be >= 1"):
        M.preset("tiny", attention_block=0)
