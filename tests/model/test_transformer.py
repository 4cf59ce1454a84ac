"""Model behaviour: cached decoding equals a full forward, causality, padding, overflow."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_tokens, run_cached, run_full, source_for, start_cache

from kvjax import model as M

# Every positional encoding, norm placement and type, activation, MHA/GQA/MQA and the options
# imported models need appears at least once in the LM. The encoder-decoder, whose layers are
# the LM's with cross-attention added, runs the sets that give its cross-attention cache each
# positional encoding, norm placement, MHA/GQA/MQA, a head size of its own and both layouts.
OPTIONS = [
    dict(),
    dict(positional_encoding="alibi", norm="pre", activation="gelu", num_heads=6, head_dim=8),
    dict(positional_encoding="rope", num_kv_heads=2, activation="swiglu", unrotated_layers=(0,)),
    dict(positional_encoding="rope", norm="pre", num_kv_heads=1, tie_embeddings=False,
         rope_scaling="llama3", rope_scaling_factor=4.0, rope_original_max_len=8, qkv_clip=0.5),
    dict(positional_encoding="sinusoidal", norm="pre", activation="swiglu", num_kv_heads=2,
         norm_type="rmsnorm", head_dim=12, qkv_bias=True, ffn_bias=False,
         scale_embeddings=False, sinusoid_layout="halves"),
    dict(positional_encoding="learned", activation="gelu_exact", num_kv_heads=1,
         out_bias=True, logits_bias=True, embedding_multiplier=2.0, residual_multiplier=0.5,
         logits_scaling=2.0, norm="output", qk_norm=True, qk_norm_across_heads=True,
         embedding_dim=24),
    dict(positional_encoding="rope", num_kv_heads=2, scan_layers=True, activation="silu",
         unrotated_layers=(1,), norm_params=False, embedding_norm=True),
    # Each layer's own table (UMT5), stacked over scanned layers; the stack's one table (T5)
    # is held to transformers' by tests/hf's T5 models.
    dict(positional_encoding="relative", relative_buckets=8, relative_max_distance=16,
         relative_bias_per_layer=True, scan_layers=True,
         norm="pre", norm_type="rmsnorm", activation="geglu", attention_scale=1.0),
]
VARIANTS = {"decoder_only": 0, "encoder_decoder": 2}
ENCODER_DECODER_OPTIONS = (0, 2, 4, 5, 6, 7)  # of OPTIONS
CACHED_EQUALS_FULL = [
    pytest.param(options, variant,
                 id="-".join([*map(str, options.values()), variant]) if options else
                 f"paper-{variant}")
    for i, options in enumerate(OPTIONS) for variant in VARIANTS
    if variant == "decoder_only" or i in ENCODER_DECODER_OPTIONS]


def make(options, encoder_layers, **extra):
    config = M.preset("tiny", num_encoder_layers=encoder_layers, **options, **extra)
    return config, M.init_params(config, jax.random.key(0))


def prefill_then_steps(config, params, tokens, prompt_len, capacity, source, source_lengths):
    cache = start_cache(config, params, tokens.shape[0], capacity, source, source_lengths)
    logits, cache = run_cached(config, params, tokens[:, :prompt_len], cache)
    pieces = [logits]
    for t in range(prompt_len, tokens.shape[1]):
        logits, cache = run_cached(config, params, tokens[:, t:t + 1], cache)
        pieces.append(logits)
    return jnp.concatenate(pieces, axis=1), cache


@pytest.mark.parametrize("options, variant", CACHED_EQUALS_FULL)
def test_cached_decoding_equals_full_forward(options, variant):
    config, params = make(options, VARIANTS[variant])
    tokens = random_tokens(1, (2, 12), config.vocab_size)
    source, source_lengths = source_for(config, 2)
    full = run_full(config, params, tokens, source=source, source_lengths=source_lengths)
    cached, cache = prefill_then_steps(config, params, tokens, 5, 16, source, source_lengths)
    np.testing.assert_allclose(cached, full, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(cache.lengths, [12, 12])
    assert not cache.overflow.any()


@pytest.mark.parametrize("variant", VARIANTS)
def test_bfloat16_cached_decoding_close_to_full_forward(variant):
    # bfloat16 keeps 8 mantissa bits (relative error ~4e-3 per rounding); the cached and the
    # full path round in different places, so logits of unit scale agree to a few 1e-2.
    config, params = make({}, VARIANTS[variant], dtype="bfloat16")
    tokens = random_tokens(1, (2, 10), config.vocab_size)
    source, source_lengths = source_for(config, 2)
    full = run_full(config, params, tokens, source=source, source_lengths=source_lengths)
    cached, _ = prefill_then_steps(config, params, tokens, 4, 16, source, source_lengths)
    assert cached.dtype == jnp.float32
    np.testing.assert_allclose(cached, full, atol=0.1, rtol=0)
    assert float(jnp.abs(cached - full).mean()) < 0.02


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_prefill_fills_the_same_cache(variant):
    config, params = make(OPTIONS[2], VARIANTS[variant])
    tokens = random_tokens(2, (2, 11), config.vocab_size)
    source, source_lengths = source_for(config, 2)
    reference = start_cache(config, params, 2, 16, source, source_lengths)
    _, reference = run_cached(config, params, tokens, reference)
    for chunks in ([3, 8], [1, 5, 5], [6, 1, 4]):
        cache = start_cache(config, params, 2, 16, source, source_lengths)
        start = 0
        for size in chunks:
            _, cache = run_cached(config, params, tokens[:, start:start + size], cache)
            start += size
        np.testing.assert_array_equal(cache.lengths, reference.lengths)
        for name in ("k", "v"):
            for stack, expected in zip(getattr(cache, name), getattr(reference, name),
                                       strict=True):
                np.testing.assert_allclose(stack[..., :11, :], expected[..., :11, :], atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_changing_a_token_changes_no_earlier_logit(variant):
    # ALiBi's in the LM; learned positions in the encoder-decoder (ALiBi is a decoder's).
    config, params = make(OPTIONS[1 if variant == "decoder_only" else 5], VARIANTS[variant])
    tokens = random_tokens(3, (1, 10), config.vocab_size)
    source, source_lengths = source_for(config, 1)
    before = run_full(config, params, tokens, source=source, source_lengths=source_lengths)
    for t in (0, 4, 9):
        changed = tokens.at[0, t].set((tokens[0, t] + 1) % config.vocab_size)
        after = run_full(config, params, changed, source=source, source_lengths=source_lengths)
        np.testing.assert_array_equal(after[:, :t], before[:, :t])
        assert float(jnp.abs(after[:, t:] - before[:, t:]).max()) > 1e-4


@pytest.mark.parametrize("options, variant", [
    pytest.param(OPTIONS[0], "decoder_only", id="paper-decoder_only"),
    pytest.param(OPTIONS[0], "encoder_decoder", id="paper-encoder_decoder"),
    pytest.param(OPTIONS[3], "decoder_only", id="rope-mqa-decoder_only")])
def test_each_padded_row_equals_that_row_alone(options, variant):
    config, params = make(options, VARIANTS[variant])
    lengths = jnp.array([9, 4, 6], jnp.int32)
    tokens = random_tokens(4, (3, 9), config.vocab_size)
    tokens = jnp.where(jnp.arange(9) < lengths[:, None], tokens, 0)  # padding is id 0
    source, source_lengths = source_for(config, 3)
    full = run_full(config, params, tokens, lengths, source, source_lengths)
    cache = start_cache(config, params, 3, 16, source, source_lengths)
    prefill, cache = run_cached(config, params, tokens, cache, lengths)
    np.testing.assert_array_equal(cache.lengths, lengths)
    next_tokens = random_tokens(6, (3, 1), config.vocab_size)
    step_logits, _ = run_cached(config, params, next_tokens, cache)
    for row, n in enumerate(lengths.tolist()):
        row_source = None if source is None else source[row:row + 1, :source_lengths[row]]
        alone = run_full(config, params,
                         jnp.concatenate([tokens[row:row + 1, :n], next_tokens[row:row + 1]], 1),
                         source=row_source)
        np.testing.assert_allclose(full[row, :n], alone[0, :n], atol=1e-5)
        np.testing.assert_allclose(prefill[row, :n], alone[0, :n], atol=1e-5)
        np.testing.assert_allclose(step_logits[row, 0], alone[0, n], atol=1e-5)


def test_full_cache_is_flagged_and_never_overwritten():
    config, params = make({}, 0)
    tokens = random_tokens(7, (2, 6), config.vocab_size)
    cache = M.init_cache(config, 2, 6)
    _, cache = run_cached(config, params, tokens[:, :5], cache, jnp.array([5, 4], jnp.int32))
    _, cache = run_cached(config, params, tokens[:, 5:6], cache)  # fills row 0, row 1 at 5/6
    assert not cache.overflow.any()
    snapshot = (np.asarray(cache.k[0]), np.asarray(cache.v[0]))
    _, after = run_cached(config, params, tokens[:, :1], cache)  # row 0 is full
    np.testing.assert_array_equal(after.overflow, [True, False])
    np.testing.assert_array_equal(after.lengths, [6, 6])
    np.testing.assert_array_equal(after.k[0][:, 0], snapshot[0][:, 0])  # no clamped write
    np.testing.assert_array_equal(after.v[0][:, 0], snapshot[1][:, 0])
    assert not np.array_equal(after.k[0][:, 1, :, 5], snapshot[0][:, 1, :, 5])  # row 1 written


def test_chunk_longer_than_capacity_raises_before_tracing():
    config, params = make({}, 0)
    with pytest.raises(ValueError, match="12 tokens per row cannot fit a cache of capacity 8"):
        run_cached(config, params, jnp.zeros((1, 12), jnp.int32), M.init_cache(config, 1, 8))


@pytest.mark.parametrize("variant", VARIANTS)
def test_cache_of_another_layout_or_batch_raises_naming_it(variant):
    scanned, params = make({"scan_layers": True}, VARIANTS[variant])
    unrolled = scanned.replace(scan_layers=False)
    per_layer = M.unstack_layer_params(scanned, params)
    source, source_lengths = source_for(scanned, 2)
    tokens = jnp.zeros((2, 1), jnp.int32)
    layers = scanned.num_decoder_layers
    stacked_cache = start_cache(scanned, params, 2, 8, source, source_lengths)
    per_layer_cache = start_cache(unrolled, per_layer, 2, 8, source, source_lengths)
    one_layer = r"\(1, 2, 4, 8, 8\)"
    with pytest.raises(ValueError, match=rf"cache.k has shapes \[{one_layer}(, {one_layer}){{"
                       rf"{layers - 1}}}\], but .*scan_layers=True.* a tuple of 1 "
                       rf"\[L_i, B, K, S, H\] stacks: \[\({layers}, 2, 4, 8, 8\)\]"):
        run_cached(scanned, params, tokens, per_layer_cache)
    with pytest.raises(ValueError, match=rf"cache.k has shapes \[\({layers}, 2, 4, 8, 8\)\], "
                       rf"but .*scan_layers=False.* a tuple of {layers} \[L_i, B, K, S, H\]"):
        run_cached(unrolled, per_layer, tokens, stacked_cache)
    with pytest.raises(ValueError, match=r"with a batch of 3 needs"):
        run_cached(scanned, params, jnp.zeros((3, 1), jnp.int32), stacked_cache)


def test_wrong_variant_for_config_raises():
    config, _ = make({}, 0)
    with pytest.raises(ValueError, match="num_encoder_layers > 0"):
        M.EncoderDecoder(config).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32),
                                      jnp.zeros((1, 1), jnp.int32))


def test_embedding_scale_and_logits_bias():
    config = M.preset("tiny", positional_encoding="rope", scale_embeddings=False,
                      logits_bias=True, num_decoder_layers=1)
    params = M.init_params(config, jax.random.key(0))
    bias = jnp.arange(config.vocab_size, dtype=jnp.float32)
    tokens = jnp.array([[3, 4, 5]])
    base = run_full(config, params, tokens)
    params["embedder"]["logits_bias"] = bias
    np.testing.assert_allclose(run_full(config, params, tokens), base + bias, rtol=1e-6,
                               atol=1e-5)
    scaled = config.replace(scale_embeddings=True, logits_bias=False)
    del params["embedder"]["logits_bias"]
    assert not np.allclose(run_full(scaled, params, tokens), base)
