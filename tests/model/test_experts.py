"""A mixture of experts (`model/experts.py`): the router's choice and the experts' weighted
sum equal a NumPy reference of the formula along both ways of running the experts (gathered
for few tokens, grouped for many); a model of such layers decodes with a cache and runs
scanned as it runs whole and unrolled; configs it cannot run are refused by name; the
load-balancing loss equals its formula and transformers'."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from kvjax import model as M
from kvjax import parallel
from kvjax.model import experts, lora
from kvjax.model.experts import MixtureOfExperts


def _moe_config(**changes):
    options = dict(num_experts=8, experts_per_token=2, ffn_bias=False, norm="pre",
                   norm_type="rmsnorm", positional_encoding="rope", activation="swiglu")
    return M.preset("tiny", **{**options, **changes})


def _silu(x):
    return x / (1 + np.exp(-x))


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _reference(params, x, config):
    """The formula, token by token, in float64."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    tokens = np.asarray(x, np.float64).reshape(-1, config.d_model)
    logits = tokens @ p["router"]["kernel"] + p["router"].get("bias", 0.0)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(tokens)
    act = {"swiglu": _silu, "gelu": _gelu_tanh, "clamped_swiglu": None}[config.activation]
    experts = p["experts"]
    zeros = {"bi": 0.0, "bi_gate": 0.0, "bo": 0.0}
    for t, token in enumerate(tokens):
        chosen = np.argsort(-probs[t])[:config.experts_per_token]
        weights = probs[t, chosen]
        if config.normalize_expert_weights:
            weights = weights / weights.sum()
        for e, w in zip(chosen, weights, strict=True):
            b = {name: experts[name][e] if name in experts else 0.0 for name in zeros}
            gate = token @ experts["wi"][:, e] + b["bi"]
            if config.activation == "clamped_swiglu":  # gpt-oss
                gate = np.minimum(gate, config.swiglu_limit)
                linear = np.clip(token @ experts["wi_gate"][:, e] + b["bi_gate"],
                                 -config.swiglu_limit, config.swiglu_limit)
                h = gate / (1 + np.exp(-config.swiglu_alpha * gate)) * (linear + 1)
            else:
                h = act(gate)
                if "wi_gate" in experts:
                    h = h * (token @ experts["wi_gate"][:, e])
            out[t] += w * (h @ experts["wo"][e] + b["bo"])
    if config.shared_expert_d_ff:
        shared = p["shared_expert"]
        h = act(tokens @ shared["wi"]["kernel"])
        if "wi_gate" in shared:
            h = h * (tokens @ shared["wi_gate"]["kernel"])
        gate = 1.0
        if config.shared_expert_gate:
            gate = 1 / (1 + np.exp(-(tokens @ p["shared_expert_gate"]["kernel"])))
        out += gate * (h @ shared["wo"]["kernel"])
    return out.reshape(np.shape(x))


@pytest.mark.parametrize("tokens", [(1, 1), (1, 2), (2, 7)], ids=["one", "two", "many"])
@pytest.mark.parametrize("activation,normalize,shared", [
    ("swiglu", True, {}), ("gelu", False, {}),
    ("swiglu", False, dict(shared_expert_d_ff=24, shared_expert_gate=True)),
    ("gelu", True, dict(shared_expert_d_ff=24)),
    ("clamped_swiglu", True, dict(ffn_bias=True, router_bias=True, swiglu_limit=0.4,
                                  swiglu_alpha=1.5))],
    ids=["gated-normalized", "plain-as-given", "shared-gated", "shared", "biases-clamped"])
def test_each_token_is_the_weighted_sum_of_its_chosen_experts(tokens, activation, normalize,
                                                               shared):
    """Plus the shared expert's output where there is one (Qwen2-MoE's behind a gate); with
    biases on the router and the experts and gpt-oss's clamped SwiGLU, its limit low enough
    that the clips bind."""
    options = dict(shared)
    biases = options.get("ffn_bias", False)
    config = _moe_config(activation=activation, normalize_expert_weights=normalize, **options)
    layer = MixtureOfExperts(config)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(*tokens, config.d_model)),
                    jnp.float32)
    params = layer.init(jax.random.key(1), x)["params"]
    if biases:  # initialised at zero: drawn here, so that they count
        params = jax.tree_util.tree_map_with_path(
            lambda path, leaf: jax.random.normal(jax.random.key(len(path)), leaf.shape)
            if path[-1].key in ("bi", "bi_gate", "bo", "bias") else leaf, params)
        assert params["experts"]["bi"].shape == params["experts"]["bi_gate"].shape == (8, 64)
        assert params["experts"]["bo"].shape == (8, config.d_model)
        assert params["router"]["bias"].shape == (8,)
    assert ("wi_gate" in params["experts"]) == activation.endswith("swiglu")
    assert ("shared_expert" in params) == ("shared_expert_d_ff" in shared)
    assert ("shared_expert_gate" in params) == ("shared_expert_gate" in shared)
    if "shared_expert_d_ff" in shared:
        assert params["shared_expert"]["wi"]["kernel"].shape == (config.d_model, 24)
    want = _reference(params, x, config)
    got = jax.jit(lambda p, v: layer.apply({"params": p}, v))(params, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Both ways, whichever the shape picks: 2 pairs of 8 experts gather, 4 and 28 do not.
    pairs = tokens[0] * tokens[1] * config.experts_per_token
    assert experts.gathers(pairs, config.num_experts) == (pairs < 3)
    logits = x.reshape(-1, config.d_model) @ params["router"]["kernel"] + params[
        "router"].get("bias", 0.0)
    weights, chosen = experts.route(logits, config.experts_per_token, normalize)
    kernels = experts.ExpertWeights(**params["experts"], **dict.fromkeys(
        ("wi_gate",) if "wi_gate" not in params["experts"] else ()))
    if "shared_expert_d_ff" in shared:  # the ways compute the routed experts alone
        return
    for way in (experts.gathered, experts.every_expert):
        out = way(x.reshape(-1, config.d_model), weights, chosen, kernels,
                  experts.hidden_units(config))
        np.testing.assert_allclose(out.reshape(x.shape), want, rtol=1e-5, atol=1e-5)


def _sparsemixer_reference(scores, eps):
    """Phi-3.5-MoE's routing at inference, token by token in float64, as its paper and
    transformers' `sparsemixer` state it."""
    weights, chosen = np.zeros((len(scores), 2)), np.zeros((len(scores), 2), int)
    for t, s in enumerate(np.asarray(scores, np.float64)):
        left = s.copy()
        for k in range(2):
            best = int(np.argmax(left))
            top = left[best]
            kept = (top - s) / np.maximum(np.abs(s), top) <= 2 * eps
            gates = np.where(kept & np.isfinite(left), np.exp(left - top), 0.0)
            weights[t, k], chosen[t, k] = gates[best] / gates.sum(), best
            left[best] = -np.inf
    return weights, chosen


@pytest.mark.parametrize("eps", [0.0, 0.05, 10.0])  # alone, some experts beside, every one
def test_sparsemixer_weighs_each_of_two_experts_by_a_softmax_over_its_near_rivals(eps):
    scores = np.random.default_rng(0).normal(size=(64, 6)).astype(np.float32)
    scores[:8] = np.abs(scores[:8])  # tokens whose every score is positive
    scores[8:16] = -np.abs(scores[8:16])  # and negative
    weights, chosen = experts.route(jnp.asarray(scores), 2, False, sparsemixer_eps=eps)
    want_weights, want_chosen = _sparsemixer_reference(scores, eps)
    np.testing.assert_array_equal(chosen, want_chosen)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-6)
    if eps == 0.0:  # each expert's softmax holds it alone
        np.testing.assert_allclose(weights, 1.0)
    assert chosen.dtype == jnp.int32


def test_a_selection_bias_chooses_the_experts_and_the_softmax_weighs_them():
    """ERNIE 4.5's router: the k largest of softmax + bias are chosen, each weighed by its
    softmax probability alone (renormalised where asked)."""
    logits = np.random.default_rng(1).normal(size=(32, 6)).astype(np.float32)
    bias = np.array([0.5, -0.5, 0.0, 0.3, -0.2, 0.1], np.float32)
    probabilities = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    want_chosen = np.argsort(-(probabilities + bias), axis=-1, kind="stable")[:, :2]
    want = np.take_along_axis(probabilities, want_chosen, -1)
    for normalize in (False, True):
        weights, chosen = experts.route(jnp.asarray(logits), 2, normalize,
                                        selection_bias=jnp.asarray(bias))
        np.testing.assert_array_equal(chosen, want_chosen)
        np.testing.assert_allclose(weights, want / want.sum(-1, keepdims=True) if normalize
                                   else want, rtol=1e-6)
    # The bias changes the choice of some tokens (else this test could not fail).
    assert (want_chosen != np.argsort(-probabilities, axis=-1)[:, :2]).any()


def _deepseek_reference(logits, bias, k, groups, kept, normalize, scaling):
    """DeepSeek-V3's routing token by token in float64, as its report states it: sigmoid
    scores, groups ranked by their two best biased scores, the k best biased scores within
    the kept groups, weighed by the unbiased scores."""
    weights, chosen = [], []
    for row in np.asarray(logits, np.float64):
        scores = 1 / (1 + np.exp(-row))
        biased = (scores + bias).reshape(groups, -1)
        ranked = np.argsort(-np.sort(biased, axis=-1)[:, -2:].sum(-1), kind="stable")[:kept]
        allowed = np.full_like(biased, -np.inf)
        allowed[ranked] = biased[ranked]
        best = np.argsort(-allowed.reshape(-1), kind="stable")[:k]
        w = scores[best] / (scores[best].sum() if normalize else 1.0)
        weights.append(w * scaling)
        chosen.append(best)
    return np.array(weights), np.array(chosen)


@pytest.mark.parametrize("groups,kept,normalize", [(1, 1, True), (4, 2, True), (4, 1, False)])
def test_sigmoid_routing_chooses_within_the_best_groups(groups, kept, normalize):
    """GLM-4.5's and dots.llm1's router (DeepSeek-V3's): sigmoid scores, a selection bias,
    group-limited choice, routed scaling."""
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(48, 8)).astype(np.float32)
    bias = rng.normal(scale=0.3, size=8).astype(np.float32)
    weights, chosen = experts.route(jnp.asarray(logits), 2, normalize,
                                    selection_bias=jnp.asarray(bias), scoring="sigmoid",
                                    groups=groups, groups_kept=kept, scaling=2.5)
    want_weights, want_chosen = _deepseek_reference(logits, bias, 2, groups, kept, normalize,
                                                    2.5)
    np.testing.assert_array_equal(np.sort(chosen, -1), np.sort(want_chosen, -1))
    order = np.argsort(chosen, -1)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, -1),
                               np.take_along_axis(want_weights, np.argsort(want_chosen, -1),
                                                  -1), rtol=1e-6)
    if groups > 1:  # the groups change the choice of some tokens (else this could not fail)
        _, free = _deepseek_reference(logits, bias, 2, 1, 1, normalize, 2.5)
        assert (np.sort(free, -1) != np.sort(want_chosen, -1)).any()


def test_softmax_routing_ranks_groups_by_their_best_expert():
    """DeepSeek-V2's group-limited greedy router, token by token in float64 as its code
    states it: a softmax over the experts, each group ranked by its best probability, the k
    best probabilities of the kept groups, weighed as they are, times the scaling."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(48, 8)).astype(np.float32)
    weights, chosen = experts.route(jnp.asarray(logits), 3, False, groups=4, groups_kept=2,
                                    scaling=1.5, group_score="best")
    want_weights, want_chosen, free = [], [], []
    for row in logits.astype(np.float64):
        probabilities = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
        grouped = probabilities.reshape(4, 2)
        kept = np.argsort(-grouped.max(-1), kind="stable")[:2]
        allowed = np.zeros_like(grouped)
        allowed[kept] = grouped[kept]
        best = np.argsort(-allowed.reshape(-1), kind="stable")[:3]
        want_chosen.append(np.sort(best))
        want_weights.append(np.sort(probabilities[best] * 1.5))
        free.append(np.sort(np.argsort(-probabilities, kind="stable")[:3]))
    np.testing.assert_array_equal(np.sort(chosen, -1), want_chosen)
    np.testing.assert_allclose(np.sort(weights, -1), want_weights, rtol=1e-6)
    assert (np.array(free) != np.array(want_chosen)).any()  # the groups change some choices
    _, two_best = experts.route(jnp.asarray(logits), 3, False, groups=4, groups_kept=2)
    assert (np.sort(two_best, -1) != np.array(want_chosen)).any()  # ranked otherwise


@pytest.mark.parametrize("fields,message", [
    ({"router_groups": 3}, "equal groups of at least two"),
    ({"router_groups": 3, "router_group_score": "best"}, "into equal groups"),
    ({"router_group_score": "best"}, "needs router_groups > 1"),
    ({"router_groups": 4, "router_group_score": "top3"}, "router_group_score"),
    ({"router_groups": 4, "router_groups_kept": 5}, "router_groups_kept <= router_groups"),
    ({"router_groups": 4, "router_groups_kept": 1, "experts_per_token": 3}, "more than the 2"),
    ({"routed_scaling": 0.0}, "routed_scaling=0.0"),
    ({"router_scoring": "relu"}, "router_scoring"),
    ({"num_experts": 0, "router_scoring": "sigmoid"}, "need a mixture of experts"),
])
def test_deepseek_router_options_are_checked(fields, message):
    with pytest.raises(ValueError, match=message):
        M.preset("tiny", **{"num_experts": 8, **fields})


def test_a_sigmoid_router_takes_no_load_balancing_loss():
    """Switch Transformer's loss weighs a softmax router's probabilities; DeepSeek-V3's
    sigmoid router balances by its selection bias, so the loss is refused, not computed
    from probabilities the router never used."""
    config = M.preset("tiny", num_experts=8, router_scoring="sigmoid", router_selection_bias=True)
    with pytest.raises(ValueError, match="router_scoring='sigmoid'"):
        M.teacher_forced_logits(config, None, {"inputs": jnp.zeros((1, 4), jnp.int32)},
                                router_loss=True)


def test_a_model_of_experts_decodes_and_scans_as_it_runs_whole():
    """With gpt-oss's options too: attention sinks, biases on the router and the experts,
    the clamped SwiGLU, a sliding window beside a full layer."""
    from test_layers import check_unrolled_and_cached_equal_whole

    config = _moe_config(num_kv_heads=2, scan_layers=True, num_experts=16,
                         shared_expert_d_ff=24, shared_expert_gate=True, attention_sinks=True,
                         ffn_bias=True, router_bias=True, activation="clamped_swiglu",
                         swiglu_limit=1.0, sliding_window=3, full_attention_layers=(1,))
    params = M.init_params(config, jax.random.key(2))
    assert params["layers"]["ffn"]["experts"]["wi"].shape == (2, 32, 16, 64)
    assert params["layers"]["self_attention"]["sinks"].shape == (2, 4)
    params = jax.tree_util.tree_map_with_path(  # the sinks and biases start at zero
        lambda path, leaf: 2 * jax.random.normal(jax.random.key(len(path)), leaf.shape)
        if path[-1].key in ("sinks", "bi", "bi_gate", "bo") else leaf, params)
    # The prefill's 2 x 5 tokens go through every expert, a step's 2 rows gather theirs.
    check_unrolled_and_cached_equal_whole(config, params)


@pytest.mark.parametrize("changes,message", [
    (dict(experts_per_token=9), "experts_per_token=9 must be from 1 to num_experts=8"),
    (dict(experts_per_token=0), "experts_per_token=0 must be from 1"),
    (dict(num_experts=-1), "num_experts=-1 must be >= 0"),
    (dict(num_experts=0, router_bias=True), "router_bias needs a mixture of experts"),
    (dict(swiglu_limit=0.0), "swiglu_limit=0.0 must be > 0"),
    (dict(num_encoder_layers=2), "num_experts needs a decoder-only model"),
    (dict(shared_expert_d_ff=-4), "shared_expert_d_ff=-4 must be >= 0"),
    (dict(shared_expert_gate=True), "shared_expert_gate needs a shared expert"),
    (dict(num_experts=0, shared_expert_d_ff=16), "shared_expert_d_ff needs a mixture of experts"),
    (dict(num_experts=0, router_selection_bias=True),
     "router_selection_bias needs a mixture of experts"),
    (dict(dense_ffn_layers=(0,)), r"dense_ffn_layers=\[0\] needs their dense_d_ff > 0"),
    (dict(dense_ffn_layers=(0,), dense_d_ff=16, scan_layers=True),
     "dense_ffn_layers needs unrolled layers"),
    (dict(dense_ffn_layers=(5,), dense_d_ff=16), r"dense_ffn_layers=\[5\] must be distinct"),
])
def test_configs_experts_cannot_run_are_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        _moe_config(**changes)


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
def test_lora_gives_each_expert_its_own_pair_over_its_own_slice(scan_layers):
    """Fresh adapters leave the experts bit for bit; trained ones add scale · A_e B_e to
    expert e's kernels alone, the shared expert left as it is; the merged model is the
    mixture of the merged experts (`_reference`)."""
    config = _moe_config(scan_layers=scan_layers, shared_expert_d_ff=24)
    params = M.init_params(config, jax.random.key(0))
    settings = M.LoRA(rank=2, alpha=6.0, targets=("q", "wi", "wi_gate", "wo"))
    adapters = lora.init_adapters(config, params, settings, jax.random.key(1))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(lora.merge(
            config, params, adapters, settings)), strict=True):
        assert np.array_equal(a, b)
    adapters = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.random.normal(jax.random.key(len(path)), x.shape)
        if path[-1].key == "lora_b" else x, adapters)
    merged = lora.merge(config, params, adapters, settings)

    def layer(tree, i=1):
        return jax.tree.map(lambda x: np.asarray(x, np.float64)[i], tree["layers"]) \
            if scan_layers else jax.tree.map(np.asarray, tree["layers"][str(i)])

    base, new, pairs = layer(params), layer(merged), layer(adapters)
    assert pairs["wi"]["lora_a"].shape == (8, config.d_model, 2)  # [experts, I, r]
    assert pairs["wo"]["lora_b"].shape == (8, 2, config.d_model)
    for name, spec in (("wi", "EIR,ERO->IEO"), ("wi_gate", "EIR,ERO->IEO"),
                       ("wo", "EIR,ERO->EIO")):
        update = 3.0 * np.einsum(spec, pairs[name]["lora_a"], pairs[name]["lora_b"])
        np.testing.assert_allclose(new["ffn"]["experts"][name],
                                   base["ffn"]["experts"][name] + update, atol=1e-5)
    for a, b in zip(jax.tree.leaves(base["ffn"]["shared_expert"]),
                    jax.tree.leaves(new["ffn"]["shared_expert"]), strict=True):
        assert np.array_equal(a, b)
    layer_config = config.replace(scan_layers=False)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 3, config.d_model)), jnp.float32)
    got = MixtureOfExperts(layer_config).apply({"params": layer(merged)["ffn"]}, x)
    np.testing.assert_allclose(got, _reference(layer(merged)["ffn"], x, layer_config),
                               rtol=1e-5, atol=1e-5)


def test_lora_on_the_experts_of_an_int8_base_is_refused_by_name():
    config = _moe_config()
    params = M.init_params(config, jax.random.key(0))
    with pytest.raises(ValueError, match=r"LoRA on a mixture's experts \('wi'\) needs a float "
                                         r"base, not an int8 one"):
        lora.init_adapters(config, params, M.LoRA(2, targets=("q", "wi"), base_dtype="int8"),
                           jax.random.key(1))


def test_on_a_mesh_each_expert_splits_its_hidden_units_as_a_dense_ffn_does():
    """Their biases too (gpt-oss): the hidden units' split as their kernels, the outputs'
    whole, as the router's and the attention sinks."""
    config = _moe_config(scan_layers=True, shared_expert_d_ff=24, shared_expert_gate=True,
                         ffn_bias=True, router_bias=True, attention_sinks=True)
    shapes = jax.eval_shape(lambda: M.init_params(config, jax.random.key(0)))
    all_specs = jax.tree_util.tree_map_with_path(
        lambda path, leaf: parallel.param_spec(path, leaf.shape), shapes)["layers"]
    specs = all_specs["ffn"]
    model = parallel.MODEL
    assert specs["experts"]["wi"] == specs["experts"]["wi_gate"] == P(None, None, None, model)
    assert specs["experts"]["wo"] == P(None, None, model, None)  # [L, experts, F, D]
    assert specs["experts"]["bi"] == specs["experts"]["bi_gate"] == P(None, None, model)
    assert specs["experts"]["bo"] == specs["router"]["bias"] == P()
    assert all_specs["self_attention"]["sinks"] == P()
    assert specs["router"]["kernel"] == P()
    shared = specs["shared_expert"]  # [L, D, F] and [L, F, D], as a dense FFN's
    assert shared["wi"]["kernel"] == shared["wi_gate"]["kernel"] == P(None, None, model)
    assert shared["wo"]["kernel"] == P(None, model, None)
    assert specs["shared_expert_gate"]["kernel"] == P()


def test_the_load_balancing_loss_equals_the_formula_over_every_layer_together():
    """E · Σ_e f_e · P_e over two layers' tokens together (f: the share of tokens choosing e,
    P: the mean router probability), whether the layers sowed apart or stacked (scanned)."""
    rng = np.random.default_rng(0)
    num, k = 6, 2
    logits = [rng.normal(size=(10, num)).astype(np.float32) for _ in range(2)]
    probabilities = np.concatenate([np.exp(x) / np.exp(x).sum(-1, keepdims=True)
                                    for x in logits])
    chosen = np.zeros(num)
    for row in probabilities:
        chosen[np.argsort(row)[-k:]] += 1
    want = num * np.sum(chosen / len(probabilities) * probabilities.mean(0))
    loads = [experts.router_load(jnp.asarray(x), k) for x in logits]
    apart = {"layers_0": {experts.ROUTER_LOAD: (loads[0],)},
             "layers_1": {experts.ROUTER_LOAD: (loads[1],)}}
    stacked = {"layers": {experts.ROUTER_LOAD: (jax.tree.map(lambda *a: jnp.stack(a),
                                                             *loads),)}}
    for sown in (apart, stacked):
        np.testing.assert_allclose(experts.load_balancing_loss(sown, num), want, rtol=1e-6)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "gpt_oss"])
def test_the_load_balancing_loss_equals_transformers(name):
    """A Hugging Face mixture's auxiliary loss as transformers computes it
    (`output_router_logits`, recorded in the fixture by tests/fixtures/make_hf_models.py);
    Qwen2-MoE's beside a shared expert, gpt-oss's from a router with a bias."""
    import json
    from pathlib import Path

    from kvjax import hf

    directory = Path(__file__).parents[1] / "fixtures" / "hf_models" / name
    record = json.loads((directory / "expected.json").read_text())
    config, params = hf.load_model(directory)
    logits, loss = M.teacher_forced_logits(
        config, params, {"inputs": jnp.asarray([record["prompts"][1]])}, router_loss=True)
    assert logits.shape[1] == len(record["prompts"][1])
    np.testing.assert_allclose(float(loss), record["router_aux_loss"], rtol=1e-5)
    with pytest.raises(ValueError, match="needs a mixture of experts"):
        M.teacher_forced_logits(M.preset("tiny"), None, {}, router_loss=True)
