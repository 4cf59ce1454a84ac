"""model/attention_layers.py: a sliding window hides what lies behind it, cached or not;
Qwen3's per-head norm of queries and keys takes each head's scale out, OLMo's norm across
heads the scale of all of them together; Ministral 3's queries scaled by their position."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_cached, run_full, start_cache

from kvjax import model as M


def test_a_sliding_window_hides_what_lies_behind_it_cached_or_not():
    """With a window of 3 over 2 layers, position t reads positions down to t - 4 (each layer
    reaches 2 back): a token further back changes none of its logits, one within reach
    does; step-by-step decoding with the cache gives the logits of one full forward."""
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


def test_qk_norm_across_heads_takes_out_the_scale_of_all_heads_together():
    """OLMo's RMSNorm over all query heads side by side (and all key heads): every query
    scaled alike changes nothing, one head scaled alone changes the attention, which the
    per-head norm would not."""
    config = M.preset("tiny", positional_encoding="rope", num_kv_heads=2, qk_norm=True,
                      qk_norm_across_heads=True)
    params = M.init_params(config, jax.random.key(5))
    layer = params["layers"]["0"]["self_attention"]
    assert layer["q_norm"]["scale"].shape == (32,) and layer["k_norm"]["scale"].shape == (16,)
    tokens = jax.random.randint(jax.random.key(6), (1, 6), 3, config.vocab_size)
    kernel = layer["qkv"]["kernel"]  # [D, N + 2K, H]: the query heads first
    want = run_full(config, params, tokens)

    def with_kernel(new_kernel):
        changed = jax.tree_util.tree_map(lambda x: x, params)
        changed["layers"]["0"]["self_attention"]["qkv"]["kernel"] = new_kernel
        return run_full(config, changed, tokens)

    np.testing.assert_allclose(with_kernel(kernel.at[:, :4].multiply(5.0)), want, rtol=1e-4,
                               atol=1e-5)
    assert not np.allclose(with_kernel(kernel.at[:, :1].multiply(5.0)), want, rtol=1e-3)


def test_queries_scaled_by_position_are_the_formula_cached_or_not():
    """1 + beta · ln(1 + floor(p / length)): exactly 1 before `length`, so the first logits
    are the unscaled model's; after it they are not, and step-by-step decoding with the cache
    gives the logits of one full forward (a cached query's scale follows its position)."""
    from kvjax.model.attention_layers import _query_scales

    config = M.preset("tiny", positional_encoding="rope", num_kv_heads=2,
                      query_scale_beta=0.5, query_scale_length=3)
    positions = jnp.arange(10)[None]
    np.testing.assert_allclose(_query_scales(config, positions)[0],
                               1 + 0.5 * np.log1p(np.arange(10) // 3), rtol=1e-6)
    params = M.init_params(config, jax.random.key(5))
    tokens = jax.random.randint(jax.random.key(6), (1, 10), 3, config.vocab_size)
    full = np.asarray(run_full(config, params, tokens))
    unscaled = np.asarray(run_full(config.replace(query_scale_beta=0.0), params, tokens))
    np.testing.assert_array_equal(full[0, :3], unscaled[0, :3])
    assert not np.allclose(full[0, 3:], unscaled[0, 3:])
    cache = start_cache(config, params, 1, 16)
    logits, cache = run_cached(config, params, tokens[:, :4], cache)
    np.testing.assert_allclose(logits[0], full[0, :4], rtol=1e-5, atol=1e-5)
    for t in range(4, 10):
        logits, cache = run_cached(config, params, tokens[:, t:t + 1], cache)
        np.testing.assert_allclose(logits[0, 0], full[0, t], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options, message", [
    (dict(query_scale_beta=-0.1), "query_scale_beta=-0.1 must be >= 0 and finite"),
    (dict(query_scale_beta=0.1, query_scale_length=0), "query_scale_length=0 must be >= 1"),
    (dict(query_scale_length=2.5), "query_scale_length=2.5 must be an int"),
    (dict(qk_norm_after_rope=True), "qk_norm_after_rope needs qk_norm")])
def test_bad_query_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        M.preset("tiny", **options)
