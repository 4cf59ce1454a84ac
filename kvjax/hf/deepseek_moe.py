"""The `config.json` readers of DeepSeek's mixtures of experts and the families built like them:
with standard attention GLM-4.5 (`glm4_moe`: GLM-4.5, GLM-4.5-Air, GLM-4.6) and dots.llm1
(`dots1`); with DeepSeek's multi-head latent attention DeepSeek-V3 (`deepseek_v3`: DeepSeek-V3
and R1, Moonlight, Kimi K2 as transformers reads them), GLM-4.7-Flash (`glm4_moe_lite`) and
DeepSeek-V2 (`deepseek_v2`: V2, V2.5, V2-Lite). DeepSeek-V3's router, theirs but V2's, scores
each expert by a sigmoid, chooses a token's experts by the scores plus a learned bias of each
expert (`e_score_correction_bias`) among the experts of its best groups, and weighs them by the
scores times `routed_scaling_factor`; DeepSeek-V2's takes a softmax's k best (of every expert,
or of its best groups, each ranked by its best expert), weighed as they are, times the same.
A shared FFN takes every token beside the chosen experts; the first layers have one dense FFN
instead. `READERS` maps each model type to its reader."""

from __future__ import annotations

from typing import Any

from .errors import UnsupportedModelError
from .llama_like import llama_like_fields, sliding_layers
from .reader import Reader
from .rope import partial_rope, rope_fields, rope_settings, yarn_mscale


def _deepseek_mixtures(c: Reader, layers: int, dense_d_ff: int,
                       dense: tuple[int, ...] | None = None, v2: bool = False
                       ) -> dict[str, Any]:
    """The mixture fields: `n_routed_experts` experts of `moe_intermediate_size` hidden units,
    `num_experts_per_tok` of them for each token among the `topk_group` best of `n_group`
    groups, renormalised where `norm_topk_prob`, times `routed_scaling_factor`, beside a
    shared FFN of `n_shared_experts` times their units; the first `first_k_dense_replace`
    layers (or the layers `dense` names) one dense FFN of `dense_d_ff` units. The
    multi-token-prediction layers of the releases (`num_nextn_predict_layers`, stored after
    the last layer) are left unread, as transformers leaves them. `v2`: DeepSeek-V2's router,
    a softmax's k best weighed as they are: of every expert ("greedy", V2-Lite) or of the
    `topk_group` groups whose best expert scores highest ("group_limited_greedy", V2 and
    V2.5)."""
    # DeepSeek's own keys, where a file has them.
    if v2:
        c.expect("scoring_func", "softmax", "softmax", "DeepSeek-V2's router is a softmax")
        method = c.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise UnsupportedModelError(f"{c.source}: topk_method={method!r}: DeepSeek-V2's "
                                        "routers are 'greedy' and 'group_limited_greedy'")
        c.expect("norm_topk_prob", False, False, "transformers' DeepSeek-V2 router never "
                 "renormalises its weights")
        for key in ("aux_loss_alpha", "seq_aux"):
            c.get(key)  # training's loss
        # Read either way; the greedy router uses neither.
        groups, kept = c.get("n_group") or 1, c.get("topk_group") or 1
        router = ({"router_groups": groups, "router_groups_kept": kept,
                   "router_group_score": "best"}
                  if method == "group_limited_greedy" and groups > 1 else {})
    else:
        c.expect("scoring_func", "sigmoid", "sigmoid", "kvjax runs DeepSeek-V3's router, "
                 "whose scores are sigmoids")
        c.expect("topk_method", "noaux_tc", "noaux_tc", "kvjax runs DeepSeek-V3's router, "
                 "which chooses by its scores plus each expert's bias")
        router = {"router_selection_bias": True, "router_scoring": "sigmoid",
                  "router_groups": c.get("n_group") or 1,
                  "router_groups_kept": c.get("topk_group") or 1}
    for key in ("output_router_logits", "router_aux_loss_coef", "num_nextn_predict_layers",
                "num_mtp_layers"):
        c.get(key)
    if dense is None:
        first = c.get("first_k_dense_replace", 0)
        if not isinstance(first, int) or not 0 <= first < layers:
            raise UnsupportedModelError(f"{c.source}: first_k_dense_replace={first!r} must "
                                        f"leave a mixture among the {layers} layers")
        dense = tuple(range(first))
    c.expect("moe_layer_freq", 1, 1, "dense FFNs between the mixtures")
    c.get("ep_size")  # how DeepSeek's code spreads the experts over devices
    units = c.require("moe_intermediate_size")
    return {"d_ff": units, "num_experts": c.require("n_routed_experts"),
            "experts_per_token": c.require("num_experts_per_tok"),
            "normalize_expert_weights": bool(c.get("norm_topk_prob", False)),
            "shared_expert_d_ff": units * (c.get("n_shared_experts") or 0), **router,
            "routed_scaling": float(c.get("routed_scaling_factor", 1.0)),
            "dense_ffn_layers": dense, "dense_d_ff": dense_d_ff if dense else 0}


def _glm4_moe(c: Reader) -> dict[str, Any]:
    """GLM-4.5: Llama's layer with biases on q, k and v where `attention_bias` (none on the
    output), RMSNorm over each head's query and key where `use_qk_norm`, and RoPE turning
    the halves of the leading `partial_rotary_factor` (a half by default) of each head."""
    width, heads = c.require("hidden_size"), c.require("num_attention_heads")
    rope = partial_rope(c, rope_settings(c), c.get("partial_rotary_factor", 0.5),
                        c.get("rope_theta", 10000.0), c.get("head_dim") or width // heads)
    fields = llama_like_fields(c, qkv_bias=bool(c.get("attention_bias", False)),
                               out_bias=False, ffn_bias=False, rope=rope)
    fields["qk_norm"] = bool(c.get("use_qk_norm", False))
    return {**fields, **_deepseek_mixtures(c, fields["num_decoder_layers"], fields["d_ff"])}


def _dots1(c: Reader) -> dict[str, Any]:
    """dots.llm1: Qwen3's attention (RMSNorm over each head's query and key; biases on q,
    k, v and the output where `attention_bias`), the layers from `max_window_layers` on (or
    those `layer_types` names) over the last `sliding_window` positions, as Dots1Config
    decides them (none in the releases, whose `max_window_layers` is their depth)."""
    bias = bool(c.get("attention_bias", False))
    fields = {**llama_like_fields(c, qkv_bias=bias, out_bias=bias, ffn_bias=False),
              "qk_norm": True}
    layers = fields["num_decoder_layers"]
    first_sliding = c.get("max_window_layers", 62)
    has_window = c.given("sliding_window", 4096) is not None
    window, full = sliding_layers(c, [
        "sliding_attention" if has_window and i >= first_sliding else "full_attention"
        for i in range(layers)], window_default=4096)
    if window is not None and len(full) < layers:
        fields.update(sliding_window=window, full_attention_layers=full)
    return {**fields, **_deepseek_mixtures(c, layers, fields["d_ff"])}


def _latent_attention(c: Reader) -> dict[str, Any]:
    """DeepSeek's multi-head latent attention (`model/latent_attention.py`): keys and values
    from `kv_lora_rank` latent dimensions (each head's `qk_nope_head_dim` key and
    `v_head_dim` value dimensions) beside `qk_rope_head_dim` turned key dimensions every head
    shares, queries from `q_lora_rank` dimensions (or the token where null); RoPE over the
    turned dimensions in pairs (`rope_interleave`), read as halves
    (`latent_weights.py`); the scale 1/√(qk_nope_head_dim + qk_rope_head_dim), times
    YaRN's mscale(factor, `mscale_all_dim`)² where the RoPE is stretched."""
    heads = c.require("num_attention_heads")
    # Every head's own K and V come out of the latent whatever this says, in transformers too.
    c.get("num_key_value_heads")
    c.expect("attention_bias", False, False, "biases on latent attention's projections")
    c.expect("rope_interleave", True, True, "kvjax reads the releases' RoPE over pairs")
    c.get("head_dim")  # transformers writes qk_rope_head_dim there; kvjax sizes a head below
    turned, unturned = c.require("qk_rope_head_dim"), c.require("qk_nope_head_dim")
    value = c.require("v_head_dim")
    c.expect("qk_head_dim", turned + unturned, turned + unturned,
             "transformers derives it: qk_nope_head_dim + qk_rope_head_dim")
    params = rope_settings(c)
    rope = rope_fields(params, 10000.0, c.source, c.get("max_position_embeddings"))
    scale = (turned + unturned) ** -0.5
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default" and params.get("mscale_all_dim"):
        scale *= yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
    return {**rope, "rotary_dim": turned, "head_dim": max(turned + unturned, value),
            "num_kv_heads": heads, "latent_kv_rank": c.require("kv_lora_rank"),
            "latent_q_rank": c.get("q_lora_rank") or 0, "latent_nope_dim": unturned,
            "latent_value_dim": value, "attention_scale": scale}


def _latent_layer(c: Reader) -> dict[str, Any]:
    """Llama's layer fields with latent attention in place of its own, no biases."""
    attention = _latent_attention(c)
    rope = {k: v for k, v in attention.items() if k.startswith(("rope", "positional"))}
    return {**llama_like_fields(c, qkv_bias=False, out_bias=False, ffn_bias=False, rope=rope),
            **attention}


def _deepseek_v3(c: Reader, v2: bool = False) -> dict[str, Any]:
    """DeepSeek-V3: Llama's layer with latent attention and DeepSeek's mixtures after
    `first_k_dense_replace` dense layers; DeepSeek-V2 (`v2`) the same with its router."""
    if v2:
        c.expect("mlp_bias", False, False, "biases on the FFNs")
    fields = _latent_layer(c)
    return {**fields, **_deepseek_mixtures(c, fields["num_decoder_layers"], fields["d_ff"],
                                           v2=v2)}


def _glm4_moe_lite(c: Reader) -> dict[str, Any]:
    """GLM-4.7-Flash: DeepSeek-V3's layers, the layers `mlp_layer_types` names "dense" (the
    first where absent) with one dense FFN."""
    fields = _latent_layer(c)
    layers = fields["num_decoder_layers"]
    kinds = c.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    if len(kinds) != layers or set(kinds) - {"dense", "sparse"} or "sparse" not in kinds:
        raise UnsupportedModelError(f"{c.source}: mlp_layer_types={kinds} must name 'dense' "
                                    f"or 'sparse' for each of the {layers} layers, one sparse "
                                    "at least")
    dense = tuple(i for i, kind in enumerate(kinds) if kind == "dense")
    return {**fields, **_deepseek_mixtures(c, layers, fields["d_ff"], dense)}


READERS = {"glm4_moe": _glm4_moe, "dots1": _dots1, "deepseek_v3": _deepseek_v3,
           "deepseek_v2": lambda c: _deepseek_v3(c, v2=True), "glm4_moe_lite": _glm4_moe_lite}
