"""The options Gemma 2 and 3 need: (1 + w) RMSNorm, sandwich norms, GeGLU, an attention scale
of its own, soft caps, global layers among sliding-window ones and a RoPE base for the local
layers. Each equals a NumPy evaluation of its formula, and a model with all of them decodes
with its cache exactly what one full forward computes, its layers unrolled or scanned."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_cached, run_full, start_cache
from test_attention import numpy_attention

from kvjax import model as M
from kvjax.model import attention
from kvjax.model.feed_forward import FeedForward
from kvjax.model.norms import RMSNorm

GEMMA = dict(positional_encoding="rope", norm="pre", norm_type="rmsnorm", num_kv_heads=2,
             num_decoder_layers=3, activation="geglu", ffn_bias=False, norm_unit_offset=True,
             sandwich_norms=True, attention_scale=0.2, attention_softcap=2.0,
             logits_softcap=3.0, sliding_window=3, full_attention_layers=(1,),
             local_rope_base=100.0, rope_base=5000.0, rope_scaling="linear",
             rope_scaling_factor=2.0)


def gemma_like(**changes):
    return M.preset("tiny", **{**GEMMA, **changes})


def test_options_round_trip_through_json_and_default_to_absent():
    config = gemma_like()
    written = json.loads(config.to_json())
    assert written["full_attention_layers"] == [1]
    assert M.TransformerConfig.from_json(config.to_json()) == config
    assert not {"full_attention_layers", "local_rope_base", "norm_unit_offset",
                "sandwich_norms", "attention_scale", "attention_softcap",
                "logits_softcap"} & set(M.preset("tiny").to_dict())
    assert [config.is_local_layer(i) for i in range(3)] == [True, False, True]


@pytest.mark.parametrize("options, message", [
    (dict(sliding_window=None, local_rope_base=None), "full_attention_layers=[1] needs a "
                                                      "sliding_window"),
    (dict(full_attention_layers=(3,)), "must be distinct layer numbers in [0, 3), in order"),
    (dict(full_attention_layers=(1, 1)), "must be distinct layer numbers"),
    (dict(full_attention_layers=[True]), "must be a list of ints"),
    (dict(norm_type="layernorm"), "norm_unit_offset needs norm_type='rmsnorm'"),
    (dict(norm_params=False), "norm_unit_offset needs norm_params: it offsets a learned scale"),
    (dict(norm_params=0), "norm_params=0 must be True or False"),
    (dict(norm="post"), "sandwich_norms needs norm='pre'"),
    (dict(attention_softcap=0.0), "attention_softcap=0.0 must be > 0 and finite"),
    (dict(logits_softcap="30"), "logits_softcap='30' must be a real number or None"),
    (dict(positional_encoding="learned", rope_scaling="none"),
     "local_rope_base=100.0 needs rope and a sliding_window"),
])
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError) as error:
        gemma_like(**options)
    assert message in str(error.value)


def test_unit_offset_rms_norm_is_the_formula():
    config = gemma_like(layer_norm_eps=1e-5)
    x = np.random.default_rng(0).normal(size=(2, 3, 32)).astype(np.float32)
    norm = RMSNorm(config)
    params = norm.init(jax.random.key(0), x)
    np.testing.assert_array_equal(params["params"]["scale"], 0.0)  # (1 + 0): the identity
    w = np.linspace(-0.5, 0.5, 32).astype(np.float32)
    out = norm.apply({"params": {"scale": w}}, x)
    want = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5) * (1 + w)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_geglu_is_the_formula():
    config = gemma_like()
    x = np.random.default_rng(1).normal(size=(1, 4, 32)).astype(np.float32)
    ffn = FeedForward(config)
    params = ffn.init(jax.random.key(1), x)["params"]
    wi, gate, wo = (np.asarray(params[n]["kernel"], np.float64) for n in ("wi", "wi_gate", "wo"))
    h = x @ wi
    tanh_gelu = 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
    np.testing.assert_allclose(ffn.apply({"params": params}, x),
                               (tanh_gelu * (x @ gate)) @ wo, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("read", ["fresh", "blocks", "whole", "one_read"])
def test_scale_and_soft_cap_are_the_formula_however_attention_reads(read):
    rng = np.random.default_rng(2)
    q = 3 * rng.normal(size=(2, 2, 4, 8)).astype(np.float32)  # logits large enough to cap
    k, v = (rng.normal(size=(2, 9, 2, 8)).astype(np.float32) for _ in range(2))
    mask = np.arange(9)[None, None] <= np.array([[[3], [4]], [[7], [8]]])
    if read == "fresh":
        out = attention.attend(q, k, v, jnp.asarray(mask), 0.3, 1.5)
    else:
        stacks = [jnp.asarray(x).transpose(0, 2, 1, 3)[None] for x in (k, v)]
        share = {"blocks": float("inf"), "whole": 0.0, "one_read": 0.0}[read]
        out, _ = attention.attend_blocks(q, *stacks, 0, jnp.asarray(mask), 4, whole_share=share,
                                         one_read_bytes=1 << 40 if read == "one_read" else 0,
                                         scale=0.3, softcap=1.5)
    want = numpy_attention(q, k, v, mask, 0.3, 1.5)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    uncapped = numpy_attention(q, k, v, mask, 0.3)
    assert not np.allclose(want, uncapped, atol=1e-3)  # the cap changed something


def test_soft_capped_logits_stay_inside_the_cap():
    config = gemma_like()
    params = M.init_params(config, jax.random.key(3))
    params = jax.tree.map(lambda a: 5 * a, params)
    tokens = jax.random.randint(jax.random.key(4), (1, 6), 3, config.vocab_size)
    logits = np.asarray(run_full(config, params, tokens))
    # tanh of a large logit rounds to exactly 1 in float32 (a GPU's tanh sooner than a CPU's).
    assert np.abs(logits).max() <= 3.0
    assert np.abs(logits).max() > 2.5


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
def test_every_option_decodes_with_the_cache_what_a_full_forward_computes(scan_layers):
    config = gemma_like(scan_layers=scan_layers)
    params = M.init_params(gemma_like(), jax.random.key(5))
    if scan_layers:
        params = M.stack_layer_params(gemma_like(), params)
    tokens = jax.random.randint(jax.random.key(6), (2, 10), 3, config.vocab_size)
    full = np.asarray(run_full(config, params, tokens))
    cache = start_cache(config, params, 2, 16)
    logits, cache = run_cached(config, params, tokens[:, :4], cache)
    np.testing.assert_allclose(logits, full[:, :4], rtol=1e-5, atol=1e-5)
    for t in range(4, 10):
        logits, cache = run_cached(config, params, tokens[:, t:t + 1], cache)
        np.testing.assert_allclose(logits[:, 0], full[:, t], rtol=1e-5, atol=1e-5)


def test_the_global_layer_sees_past_the_window_and_the_local_ones_turn_by_their_own_base():
    config = gemma_like()
    params = M.init_params(config, jax.random.key(7))
    tokens = jax.random.randint(jax.random.key(8), (1, 12), 3, config.vocab_size)
    full = np.asarray(run_full(config, params, tokens))
    changed = np.asarray(run_full(config, params, tokens.at[0, 0].set(1)))
    # All layers local (window 3, 3 layers): position 11 reaches back to 5 only.
    assert not np.allclose(changed[0, 11], full[0, 11])
    local = config.replace(full_attention_layers=())
    np.testing.assert_array_equal(run_full(local, params, tokens.at[0, 0].set(1))[0, 11],
                                  run_full(local, params, tokens)[0, 11])
    same_base = config.replace(local_rope_base=None)
    assert not np.allclose(run_full(same_base, params, tokens), full)


def test_an_int8_cache_caps_what_it_dequantises():
    """Read by blocks from an int8 cache, the capped logits are the float model's up to the
    rounding of K and V (without the cap they would be far off), and one call over the whole
    sequence equals a shorter one followed by decode steps."""
    config = gemma_like(cache_dtype="int8")
    params = M.init_params(config, jax.random.key(9))
    tokens = jax.random.randint(jax.random.key(10), (2, 9), 3, config.vocab_size)
    whole, _ = run_cached(config, params, tokens, start_cache(config, params, 2, 16))
    full = np.asarray(run_full(gemma_like(), params, tokens))
    assert np.abs(whole - full).max() < 0.05
    uncapped = config.replace(attention_softcap=None)
    wrong, _ = run_cached(uncapped, params, tokens, start_cache(uncapped, params, 2, 16))
    assert np.abs(wrong - full).max() > 0.1
    logits, cache = run_cached(config, params, tokens[:, :3], start_cache(config, params, 2, 16))
    for t in range(3, 9):
        logits, cache = run_cached(config, params, tokens[:, t:t + 1], cache)
        np.testing.assert_allclose(logits[:, 0], whole[:, t], rtol=1e-5, atol=1e-5)


def test_capped_attention_has_finite_gradients_with_fully_masked_rows():
    q = jnp.ones((1, 2, 1, 4))
    kv = jnp.ones((1, 3, 1, 4))
    mask = jnp.array([[[True, False, False], [False, False, False]]])
    grads = jax.jit(jax.grad(lambda q: attention.attend(q, kv, kv, mask, 0.3, 2.0).sum()))(q)
    assert jnp.isfinite(grads).all()
