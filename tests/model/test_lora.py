"""model.lora: adapters merge into exactly the kernels and heads they name, by the formula."""

import jax
import numpy as np
import pytest

from kvjax import model as M
from kvjax.model import lora as L
from kvjax.model import lora_rows

LAYOUTS = {"unrolled": False, "scanned": True}


def lm(scan_layers=False, **overrides):
    settings = dict(activation="swiglu", num_kv_heads=2, positional_encoding="rope")
    config = M.preset("tiny", scan_layers=scan_layers, **{**settings, **overrides})
    return config, M.init_params(config, jax.random.key(0))


def with_random_b(adapters, seed=5):
    leaves, tree = jax.tree.flatten_with_path(adapters)
    rng = np.random.default_rng(seed)
    return jax.tree.unflatten(tree, [
        rng.normal(size=x.shape).astype(np.float32) if path[-1].key == "lora_b" else x
        for path, x in leaves])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("encoder_layers", [0, 1])
def test_fresh_adapters_merge_to_the_base_bit_for_bit(layout, encoder_layers):
    config, params = lm(LAYOUTS[layout], num_encoder_layers=encoder_layers)
    lora = M.LoRA(4, 16.0, lora_rows.servable_targets(config, params))  # every kernel's
    merged = L.merge(config, params, L.init_adapters(config, params, lora, jax.random.key(1)),
                     lora)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(merged), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_target_adds_scale_times_a_b_to_its_own_heads_only(layout):
    config, params = lm(LAYOUTS[layout])
    lora = M.LoRA(3, 6.0, ("q", "v", "o", "wi_gate"))
    adapters = with_random_b(L.init_adapters(config, params, lora, jax.random.key(1)))
    merged = L.merge(config, params, adapters, lora)
    n, k, h = config.num_heads, config.kv_heads, config.head_dim
    layers = range(config.num_decoder_layers)

    def layer(tree, i):  # layer i of either layout, as NumPy
        if config.scan_layers:
            return jax.tree.map(lambda x: np.asarray(x)[i], tree["layers"])
        return jax.tree.map(np.asarray, tree["layers"][str(i)])

    for i in layers:
        base, new, pair = layer(params, i), layer(merged, i), layer(adapters, i)

        def delta(target, pair=pair):
            return 2.0 * pair[target]["lora_a"].astype(np.float64) @ pair[target]["lora_b"]

        qkv = base["self_attention"]["qkv"]["kernel"].astype(np.float64)  # [D, N + 2K, H]
        want = qkv.copy()
        want[:, :n] += delta("q").reshape(-1, n, h)
        want[:, n + k:] += delta("v").reshape(-1, k, h)
        np.testing.assert_allclose(new["self_attention"]["qkv"]["kernel"], want, atol=1e-6)
        # the key heads are not a target: they are the base's, bit for bit
        assert np.array_equal(new["self_attention"]["qkv"]["kernel"][:, n:n + k],
                              base["self_attention"]["qkv"]["kernel"][:, n:n + k])
        out = base["self_attention"]["out"]["kernel"].astype(np.float64)  # [N, H, D]
        np.testing.assert_allclose(new["self_attention"]["out"]["kernel"],
                                   out + delta("o").reshape(out.shape), atol=1e-6)
        gate = base["ffn"]["wi_gate"]["kernel"].astype(np.float64)
        np.testing.assert_allclose(new["ffn"]["wi_gate"]["kernel"], gate + delta("wi_gate"),
                                   atol=1e-6)
        for name in ("wi", "wo"):
            assert np.array_equal(new["ffn"][name]["kernel"], base["ffn"][name]["kernel"])
    # Merged and unmerged compute the same projection: x W' = x W + scale (x A) B.
    x = np.random.default_rng(2).normal(size=(5, config.d_model))
    pair = layer(adapters, 0)["q"]
    w = layer(params, 0)["self_attention"]["qkv"]["kernel"][:, :n].reshape(config.d_model, -1)
    unmerged = x @ w + 2.0 * (x @ pair["lora_a"]) @ pair["lora_b"]
    merged_q = layer(merged, 0)["self_attention"]["qkv"]["kernel"][:, :n]
    np.testing.assert_allclose(x @ merged_q.reshape(config.d_model, -1), unmerged, atol=1e-5)


def test_a_mixtures_router_and_shared_expert_take_targets_beside_experts_only():
    """router adapts a mixture's router [D, experts]; shared_wi, shared_wi_gate, shared_wo and
    shared_expert_gate its shared expert's kernels and its gate's, [D, 24], [24, D] and [D, 1]:
    scale · A B added to each, the experts' kernels left as they are; layer 0, a dense FFN,
    has neither."""
    config, params = lm(num_experts=4, experts_per_token=2, dense_ffn_layers=(0,),
                        dense_d_ff=40, shared_expert_d_ff=24, shared_expert_gate=True)
    targets = ("router", "shared_wi", "shared_wi_gate", "shared_wo", "shared_expert_gate")
    lora = M.LoRA(3, 6.0, targets)
    adapters = with_random_b(L.init_adapters(config, params, lora, jax.random.key(1)))
    assert "0" not in adapters["layers"]
    merged = L.merge(config, params, adapters, lora)
    assert jax.tree.map(np.shape, adapters["layers"]["1"]) == {
        "router": {"lora_a": (32, 3), "lora_b": (3, 4)},
        "shared_wi": {"lora_a": (32, 3), "lora_b": (3, 24)},
        "shared_wi_gate": {"lora_a": (32, 3), "lora_b": (3, 24)},
        "shared_wo": {"lora_a": (24, 3), "lora_b": (3, 32)},
        "shared_expert_gate": {"lora_a": (32, 3), "lora_b": (3, 1)}}
    base, new = params["layers"]["1"]["ffn"], merged["layers"]["1"]["ffn"]
    for target in targets:
        pair = adapters["layers"]["1"][target]
        held = L.MIXTURE_TARGETS[target][1:]  # within the layer's ffn
        want = np.asarray(L.get(base, held)["kernel"], np.float64) + 2.0 * (
            np.asarray(pair["lora_a"], np.float64) @ np.asarray(pair["lora_b"]))
        np.testing.assert_allclose(L.get(new, held)["kernel"], want, atol=1e-6)
    for name in ("wi", "wi_gate", "wo"):
        assert np.array_equal(new["experts"][name], base["experts"][name])
    assert all(np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(params["layers"]["0"]), jax.tree.leaves(merged["layers"]["0"]),
        strict=True))
    with pytest.raises(ValueError, match="LoRA target 'shared_wi' is not in this model "
                                         "\\(its layers have no ffn/shared_expert/wi kernel\\)"):
        L.init_adapters(*lm(), M.LoRA(2, targets=("shared_wi",)), jax.random.key(0))


def test_adapters_have_the_rank_and_widths_of_their_kernels():
    config, params = lm()
    adapters = L.init_adapters(config, params, M.LoRA(2, targets=("k", "o")),
                               jax.random.key(0))
    shapes = jax.tree.map(np.shape, adapters["layers"]["1"])
    head_width = config.head_dim
    assert shapes == {"k": {"lora_a": (32, 2), "lora_b": (2, config.kv_heads * head_width)},
                      "o": {"lora_a": (config.num_heads * head_width, 2), "lora_b": (2, 32)}}
    assert L.count(adapters) == 2 * (32 * 2 + 2 * 16 + 32 * 2 + 2 * 32)
    assert M.LoRA(8).scale == 1.0 and M.LoRA(8, 32).scale == 4.0
    assert M.LoRA(4, targets=("v", "q")).targets == ("q", "v")  # one order, one program


@pytest.mark.parametrize("make, message", [
    (lambda: M.LoRA(0), r"LoRA rank=0 must be an int >= 1"),
    (lambda: M.LoRA(4, alpha=-1.0), r"LoRA alpha=-1.0 must be a number > 0"),
    (lambda: M.LoRA(4, targets=("q", "up_proj")), r"'up_proj' is not"),
    (lambda: M.LoRA(4, targets=()), r"must be distinct names"),
    (lambda: L.init_adapters(*lm(activation="relu"), M.LoRA(2, targets=("wi_gate",)),
                             jax.random.key(0)), r"LoRA target 'wi_gate' is not in this model"),
])
def test_bad_settings_are_refused_naming_them(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_training_merges_over_a_low_precision_base_in_float32():
    config, params = lm()
    base = jax.tree.map(lambda x: x.astype(np.dtype("bfloat16")), params)
    lora = M.LoRA(2, targets=("o",), base_dtype="bfloat16")
    adapters = jax.tree.map(lambda x: x * 1e-2, with_random_b(
        L.init_adapters(config, base, lora, jax.random.key(1))))
    kept = L.merge(config, base, adapters, lora)
    widened = L.merge(config, base, adapters, lora, keep_dtype=False)
    out = ("layers", "0", "self_attention", "out", "kernel")

    def at(tree):
        for key in out:
            tree = tree[key]
        return tree

    pair = adapters["layers"]["0"]["o"]
    update = np.asarray(pair["lora_a"]) @ np.asarray(pair["lora_b"])
    assert at(kept).dtype == np.dtype("bfloat16") and at(widened).dtype == np.float32
    # an update below bfloat16's resolution of the kernel survives only in float32
    gained = np.asarray(at(widened), np.float64) - np.asarray(at(base), np.float64)
    np.testing.assert_allclose(gained, update.reshape(gained.shape), rtol=1e-3, atol=3e-8)
    lost = np.asarray(at(kept), np.float64) - np.asarray(at(base), np.float64)
    assert np.mean(lost == 0) > 0.5
    assert M.LoRA.from_dict(lora.to_dict()) == lora
