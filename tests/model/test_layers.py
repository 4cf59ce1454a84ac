"""model/layers.py: each norm placement around a sublayer is its formula, and so are a parallel
layer's branch and an ungated feed-forward network (model/feed_forward.py); a stack of
layers scanned (its params stacked over layers) or unrolled (params and a cache buffer of
each layer's own) computes the same, and the layouts convert both ways."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_tokens, run_cached, run_full, source_for, start_cache

from kvjax import model as M
from kvjax.model.feed_forward import FeedForward
from kvjax.model.layers import Residual


@pytest.mark.parametrize("norm", ["post", "pre", "output"])
def test_each_norm_placement_is_its_formula(norm):
    config = M.preset("tiny", norm=norm, norm_type="rmsnorm", layer_norm_eps=1e-5)
    x = np.random.default_rng(0).normal(size=(2, 3, 32)).astype(np.float32)
    w = np.linspace(0.5, 1.5, 32).astype(np.float32)

    def sublayer(h):
        return 2.0 * jnp.tanh(h), None

    out, _ = Residual(config).apply({"params": {"norm": {"scale": w}}}, x, sublayer)

    def rms_norm(v):
        return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + 1e-5) * w

    def f(v):
        return 2.0 * np.tanh(v)

    want = {"post": rms_norm(x + f(x)), "pre": x + f(rms_norm(x)),
            "output": x + rms_norm(f(x))}[norm]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


UNGATED = {"relu": lambda h: np.maximum(h, 0), "relu2": lambda h: np.maximum(h, 0) ** 2,
           "silu": lambda h: h / (1 + np.exp(-h)),
           "gelu_exact": lambda h: 0.5 * h * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))}


@pytest.mark.parametrize("activation", list(UNGATED))
def test_an_ungated_feed_forward_is_its_formula(activation):
    config = M.preset("tiny", activation=activation)
    x = np.random.default_rng(1).normal(size=(1, 4, 32)).astype(np.float32)
    ffn = FeedForward(config)
    params = ffn.init(jax.random.key(1), x)["params"]
    assert "wi_gate" not in params
    wi, wo = (np.asarray(params[n]["kernel"], np.float64) for n in ("wi", "wo"))
    np.testing.assert_allclose(ffn.apply({"params": params}, x),
                               UNGATED[activation](x @ wi) @ wo, rtol=1e-5, atol=1e-6)


def test_xielu_is_its_formula_with_each_layers_own_coefficients():
    """xIELU (Apertus): a_p h² + h/2 above 0, a_n (e^min(h, -1e-6) - 1 - h) + h/2 below,
    a_p = softplus(alpha_p) and a_n = 1/2 + softplus(alpha_n), the alphas the layer's own
    params (here moved from the values a model starts with, 0.8 and 0.8)."""
    config = M.preset("tiny", activation="xielu")
    x = np.random.default_rng(2).normal(size=(1, 4, 32)).astype(np.float32)
    ffn = FeedForward(config)
    params = ffn.init(jax.random.key(1), x)["params"]
    np.testing.assert_allclose(np.log1p(np.exp([params["xielu_alpha_p"]])), 0.8, rtol=1e-6)
    params = {**params, "xielu_alpha_p": jnp.float32(0.3), "xielu_alpha_n": jnp.float32(-0.7)}
    wi, wo = (np.asarray(params[n]["kernel"], np.float64) for n in ("wi", "wo"))
    h = x @ wi
    a_p, a_n = np.log1p(np.exp(0.3)), 0.5 + np.log1p(np.exp(-0.7))
    units = np.where(h > 0, a_p * h * h, (np.expm1(np.minimum(h, -1e-6)) - h) * a_n) + 0.5 * h
    np.testing.assert_allclose(ffn.apply({"params": params}, x), units @ wo, rtol=1e-5,
                               atol=1e-6)


def test_a_parallel_branch_is_its_sublayer_alone_through_its_own_norm_or_none():
    config = M.preset("tiny", norm="pre", norm_type="rmsnorm", layer_norm_eps=1e-5)
    x = np.random.default_rng(1).normal(size=(2, 3, 32)).astype(np.float32)
    w = np.linspace(0.5, 1.5, 32).astype(np.float32)

    def sublayer(h):
        return 2.0 * jnp.tanh(h), None

    normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5) * w
    own, _ = Residual(config, add_input=False).apply({"params": {"norm": {"scale": w}}}, x,
                                                     sublayer)
    np.testing.assert_allclose(own, 2.0 * np.tanh(normed), rtol=1e-5, atol=1e-6)
    shared, _ = Residual(config, add_input=False, normalize=False).apply({"params": {}}, normed,
                                                                         sublayer)
    np.testing.assert_allclose(shared, 2.0 * np.tanh(normed), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shared_norm", [False, True], ids=["two norms", "one norm"])
def test_parallel_layers_decode_and_scan_as_they_run_whole(shared_norm):
    config = M.preset("tiny", norm="pre", positional_encoding="rope", num_kv_heads=2,
                      parallel_residual=True, shared_norm=shared_norm, scan_layers=True)
    params = M.init_params(config, jax.random.key(2))
    assert ("ffn_block" in params["layers"]) != shared_norm  # the FFN's own norm, or none
    check_unrolled_and_cached_equal_whole(config, params)


def check_unrolled_and_cached_equal_whole(config, params):
    """A decoder-only model of scanned layers, over a batch of 2 x 12 tokens: unrolled, and
    a prefill of 5 then one step a token, it computes what one scanned pass computes."""
    from test_transformer import prefill_then_steps

    tokens = random_tokens(4, (2, 12), config.vocab_size)
    full = run_full(config, params, tokens)
    unrolled, per_layer = M.with_layer_layout(config, params, scan_layers=False)
    np.testing.assert_allclose(run_full(unrolled, per_layer, tokens), full, atol=1e-5, rtol=0)
    cached, _ = prefill_then_steps(config, params, tokens, 5, 16, None, None)
    np.testing.assert_allclose(cached, full, atol=1e-5, rtol=0)


def test_scanned_layers_stack_their_params_over_layers():
    config = M.preset("tiny", num_decoder_layers=5, scan_layers=True)
    shapes = jax.eval_shape(lambda: M.init_params(config, jax.random.key(0)))
    kernel = shapes["layers"]["self_attention"]["qkv"]["kernel"]
    assert kernel.shape == (5, config.d_model, config.num_heads + 2 * config.kv_heads,
                            config.head_dim)


def test_unrolled_layers_compute_what_scanned_layers_compute():
    scanned = M.preset("tiny", num_decoder_layers=3, num_encoder_layers=2, scan_layers=True)
    unrolled = scanned.replace(scan_layers=False)
    params = M.init_params(scanned, jax.random.key(0))
    per_layer = M.unstack_layer_params(scanned, params)
    expected = jax.eval_shape(lambda: M.init_params(unrolled, jax.random.key(0)))
    assert jax.tree.structure(per_layer) == jax.tree.structure(expected)
    tokens = random_tokens(1, (2, 9), scanned.vocab_size)
    source, source_lengths = source_for(scanned, 2)
    np.testing.assert_allclose(
        run_full(unrolled, per_layer, tokens, source=source, source_lengths=source_lengths),
        run_full(scanned, params, tokens, source=source, source_lengths=source_lengths),
        atol=1e-5, rtol=0)


def test_stacking_unrolled_params_inverts_unstacking():
    scanned = M.preset("tiny", num_decoder_layers=3, num_encoder_layers=2, scan_layers=True)
    params = M.init_params(scanned, jax.random.key(0))
    unrolled, per_layer = M.with_layer_layout(scanned, params, scan_layers=False)
    assert unrolled == scanned.replace(scan_layers=False)
    expected = M.unstack_layer_params(scanned, params)
    assert jax.tree.structure(per_layer) == jax.tree.structure(expected)
    back_config, back = M.with_layer_layout(unrolled, per_layer, scan_layers=True)
    assert back_config == scanned
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)
    assert M.with_layer_layout(scanned, params, scan_layers=True) == (scanned, params)


@pytest.mark.parametrize("variant", ["decoder_only", "encoder_decoder"])
def test_unrolled_cache_holds_what_the_scanned_cache_holds(variant):
    scanned = M.preset("tiny", num_encoder_layers=2 if variant == "encoder_decoder" else 0,
                       num_kv_heads=2, scan_layers=True)
    params = M.init_params(scanned, jax.random.key(0))
    unrolled = scanned.replace(scan_layers=False)
    tokens = random_tokens(2, (2, 7), scanned.vocab_size)
    source, source_lengths = source_for(scanned, 2)
    lengths = jnp.array([7, 4], jnp.int32)
    caches, logits = {}, {}
    for config, p in ((scanned, params), (unrolled, M.unstack_layer_params(scanned, params))):
        cache = start_cache(config, p, 2, 12, source, source_lengths)
        _, cache = run_cached(config, p, tokens, cache, lengths)
        step = run_cached(config, p, tokens[:, :1], cache)
        logits[config.scan_layers], caches[config.scan_layers] = step
    np.testing.assert_allclose(logits[False], logits[True], atol=1e-5)
    for layer in range(scanned.num_decoder_layers):
        for name in ("k", "v") + (("cross_k", "cross_v") if variant == "encoder_decoder" else ()):
            np.testing.assert_allclose(getattr(caches[False], name)[layer][0],
                                       getattr(caches[True], name)[0][layer], atol=1e-5)
    np.testing.assert_array_equal(caches[False].lengths, caches[True].lengths)
