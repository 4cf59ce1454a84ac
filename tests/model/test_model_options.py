"""The options imported architectures need: each equals a NumPy evaluation of its formula,
and none changes a config written before it existed."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import model as M
from kvjax.model.norms import RMSNorm
from kvjax.model.positional import apply_rope, rope_frequencies, sinusoidal

OPTION_FIELDS = ("head_dim", "qkv_bias", "out_bias", "ffn_bias", "norm_type",
                 "scale_embeddings", "logits_bias", "sinusoid_layout", "rope_scaling",
                 "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                 "rope_original_max_len", "qk_norm", "sliding_window")


def test_a_config_without_options_writes_what_it_wrote_before_them():
    written = M.preset("gpt-mini").to_dict()
    assert not set(OPTION_FIELDS) & set(written)
    assert M.TransformerConfig.from_dict(written) == M.preset("gpt-mini")


def test_options_round_trip_through_json():
    config = M.preset("tiny", head_dim=16, qkv_bias=True, norm_type="rmsnorm",
                      positional_encoding="rope", rope_scaling="llama3",
                      rope_scaling_factor=8.0, rope_original_max_len=32)
    written = json.loads(config.to_json())
    assert written["head_dim"] == 16 and written["rope_scaling"] == "llama3"
    assert M.TransformerConfig.from_json(config.to_json()) == config


def test_head_dim_follows_the_width_unless_given():
    config = M.preset("tiny")  # d_model 32, 4 heads
    assert config.head_dim == 8
    assert config.replace(d_model=64).head_dim == 16
    wide = config.replace(head_dim=24)
    assert wide.replace(d_model=64).head_dim == 24
    assert M.cache_size_bytes(wide, 1, 10).self_attention == 2 * 10 * 2 * 4 * 24 * 4
    params = jax.eval_shape(lambda: M.init_params(wide, jax.random.key(0)))
    assert params["layers"]["0"]["self_attention"]["qkv"]["kernel"].shape == (32, 12, 24)
    assert params["layers"]["0"]["self_attention"]["out"]["kernel"].shape == (4, 24, 32)


@pytest.mark.parametrize("options, message", [
    (dict(norm_type="batchnorm"), "norm_type='batchnorm' is not one of"),
    (dict(head_dim=0), "head_dim=0 must be >= 1"),
    (dict(num_heads=3), "num_heads=3 does not divide d_model=32 (or give head_dim)"),
    (dict(rope_scaling="llama3"), "needs positional_encoding='rope'"),
    (dict(positional_encoding="rope", rope_scaling="llama3", rope_low_freq_factor=4.0,
          rope_high_freq_factor=4.0), "rope_low_freq_factor (4.0) < rope_high_freq_factor"),
    (dict(sinusoid_layout="split"), "sinusoid_layout='split' is not one of"),
    (dict(qkv_bias=1), "qkv_bias=1 must be True or False"),
])
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError) as error:
        M.preset("tiny", **options)
    assert message in str(error.value)


def test_a_head_dim_of_its_own_needs_no_divisible_width():
    assert M.preset("tiny", num_heads=3, head_dim=8).head_dim == 8


def test_rms_norm_is_the_formula():
    config = M.preset("tiny", norm_type="rmsnorm", layer_norm_eps=1e-5)
    x = np.random.default_rng(0).normal(size=(2, 3, 32)).astype(np.float32)
    scale = np.random.default_rng(1).normal(size=32).astype(np.float32)
    out = RMSNorm(config).apply({"params": {"scale": scale}}, x)
    want = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, -1, keepdims=True) + 1e-5) * scale
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("width", [8, 9])
def test_sinusoid_halves_hold_every_sine_then_every_cosine(width):
    positions = np.arange(6)
    got = np.asarray(sinusoidal(jnp.asarray(positions)[None], width, "halves"))[0]
    sines = [[math.sin(p / 10000 ** (2 * i / width)) for i in range((width + 1) // 2)]
             for p in positions]
    cosines = [[math.cos(p / 10000 ** (2 * i / width)) for i in range(width // 2)]
               for p in positions]
    np.testing.assert_allclose(got, np.concatenate([sines, cosines], axis=1), atol=1e-6)
    interleaved = np.asarray(sinusoidal(jnp.asarray(positions)[None], width))[0]
    np.testing.assert_allclose(interleaved[:, 0:width - 1:2], got[:, :width // 2], atol=1e-6)


def _llama3_frequencies(base, head_dim, factor, low, high, original):
    """Llama 3.1's published rule, one frequency at a time."""
    result = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / base ** (i / head_dim)
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            result.append(freq)
        elif wavelength > original / low:
            result.append(freq / factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            result.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(result)


def test_llama3_scaling_is_the_published_rule():
    config = M.preset("tiny", positional_encoding="rope", head_dim=16, rope_base=500000.0,
                      rope_scaling="llama3", rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
                      rope_high_freq_factor=4.0, rope_original_max_len=64)
    want = _llama3_frequencies(500000.0, 16, 8.0, 1.0, 4.0, 64)
    np.testing.assert_allclose(rope_frequencies(config), want, rtol=1e-12)
    plain = rope_frequencies(config.replace(rope_scaling="none"))
    assert (want == plain).any() and (want == plain / 8).any()  # each branch taken
    assert ((want != plain) & (want != plain / 8)).any()
    linear = rope_frequencies(config.replace(rope_scaling="linear"))
    np.testing.assert_allclose(linear, plain / 8, rtol=1e-12)


def test_rope_rotates_halves_by_position_times_frequency():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, 3, 2, 8)).astype(np.float32)
    inv_freq = np.array([1.0, 0.5, 0.25, 0.125])
    positions = np.array([[0, 3, 7]])
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions), inv_freq))
    angle = positions[0][:, None, None] * inv_freq  # [T, 1, H/2]
    x1, x2 = x[0, ..., :4], x[0, ..., 4:]
    want = np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle),
                           x2 * np.cos(angle) + x1 * np.sin(angle)], axis=-1)
    np.testing.assert_allclose(got[0], want, atol=1e-6)


def test_embedding_scale_and_logits_bias():
    from conftest import run_full

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


def test_a_sliding_window_hides_what_lies_behind_it_cached_or_not():
    """With a window of 3 over 2 layers, position t reads positions down to t - 4 (each layer
    reaches 2 back): a token further back changes none of its logits, one within reach
    does; step-by-step decoding with the cache gives the logits of one full forward."""
    from conftest import run_cached, run_full, start_cache

    config = M.preset("tiny", positional_encoding="rope", num_kv_heads=2, sliding_window=3)
    params = M.init_params(config, jax.random.key(3))
    tokens = jax.random.randint(jax.random.key(4), (1, 12), 3, config.vocab_size)
    full = np.asarray(run_full(config, params, tokens))
    changed = np.asarray(run_full(config, params, tokens.at[0, 2].set(1)))
    np.testing.assert_array_equal(changed[0, 7:], full[0, 7:])
    assert not np.allclose(changed[0, 6], full[0, 6])
    cache = start_cache(config, params, 1, 16)
    for t in range(12):
        logits, cache = run_cached(config, params, tokens[:, t:t + 1], cache)
        np.testing.assert_allclose(logits[0, 0], full[0, t], rtol=1e-5, atol=1e-5)
    unwindowed = np.asarray(run_full(config.replace(sliding_window=None), params, tokens))
    np.testing.assert_allclose(unwindowed[0, :3], full[0, :3], rtol=1e-5, atol=1e-6)
    assert not np.allclose(unwindowed[0, 5:], full[0, 5:])


def test_qk_norm_normalises_each_heads_query_and_key():
    """Qwen3's per-head RMSNorm: a query scaled up changes nothing after it (the norm takes
    the scale out), which without the norm changes the attention."""
    config = M.preset("tiny", positional_encoding="rope", num_kv_heads=2, qk_norm=True)
    params = M.init_params(config, jax.random.key(5))
    layer = params["layers"]["0"]["self_attention"]
    assert layer["q_norm"]["scale"].shape == layer["k_norm"]["scale"].shape == (8,)
    from conftest import run_full

    tokens = jax.random.randint(jax.random.key(6), (1, 6), 3, config.vocab_size)
    kernel = layer["qkv"]["kernel"]  # [D, N + 2K, H]: the query heads first
    doubled = jax.tree_util.tree_map(lambda x: x, params)
    doubled["layers"]["0"]["self_attention"]["qkv"]["kernel"] = kernel.at[:, :4].multiply(5.0)
    np.testing.assert_allclose(run_full(config, doubled, tokens),
                               run_full(config, params, tokens), rtol=1e-4, atol=1e-5)
    plain = config.replace(qk_norm=False)
    plain_params = jax.tree_util.tree_map(lambda x: x, params)
    for layer_params in plain_params["layers"].values():
        del layer_params["self_attention"]["q_norm"], layer_params["self_attention"]["k_norm"]
    scaled = jax.tree_util.tree_map(lambda x: x, plain_params)
    scaled["layers"]["0"]["self_attention"]["qkv"]["kernel"] = kernel.at[:, :4].multiply(5.0)
    assert not np.allclose(run_full(plain, scaled, tokens), run_full(plain, plain_params, tokens),
                           rtol=1e-3)
