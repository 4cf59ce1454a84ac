"""The `config.json` readers of the families whose mixtures of experts route as DeepSeek-V3's
do, with standard attention: GLM-4.5 (`glm4_moe`: GLM-4.5, GLM-4.5-Air, GLM-4.6) and
dots.llm1 (`dots1`). Their router scores each expert by a sigmoid, chooses a token's experts
by the scores plus a learned bias of each expert (`e_score_correction_bias`) among the
experts of its best groups, and weighs them by the scores times `routed_scaling_factor`; a
shared FFN takes every token beside them; the first layers have one dense FFN instead.
`READERS` maps each model type to its reader."""

from __future__ import annotations

from typing import Any

from .errors import UnsupportedModelError
from .llama_like import llama_like_fields, sliding_layers
from .reader import Reader
from .rope import partial_rope, rope_settings


def _deepseek_mixtures(c: Reader, layers: int, dense_d_ff: int) -> dict[str, Any]:
    """The mixture fields: `n_routed_experts` experts of `moe_intermediate_size` hidden units,
    `num_experts_per_tok` of them for each token among the `topk_group` best of `n_group`
    groups, renormalised where `norm_topk_prob`, times `routed_scaling_factor`, beside a
    shared FFN of `n_shared_experts` times their units; the first `first_k_dense_replace`
    layers one dense FFN of `dense_d_ff` units. The multi-token-prediction layers of the
    releases (`num_nextn_predict_layers`, stored after the last layer) are left unread, as
    transformers leaves them."""
    # DeepSeek's own keys, where a file has them.
    c.expect("scoring_func", "sigmoid", "sigmoid", "kvjax runs DeepSeek-V3's router, whose "
             "scores are sigmoids")
    c.expect("topk_method", "noaux_tc", "noaux_tc", "kvjax runs DeepSeek-V3's router, which "
             "chooses by its scores plus each expert's bias")
    for key in ("output_router_logits", "router_aux_loss_coef", "num_nextn_predict_layers",
                "num_mtp_layers"):
        c.get(key)
    dense = c.get("first_k_dense_replace", 0)
    if not isinstance(dense, int) or not 0 <= dense < layers:
        raise UnsupportedModelError(f"{c.source}: first_k_dense_replace={dense!r} must leave "
                                    f"a mixture among the {layers} layers")
    units = c.require("moe_intermediate_size")
    return {"d_ff": units, "num_experts": c.require("n_routed_experts"),
            "experts_per_token": c.require("num_experts_per_tok"),
            "normalize_expert_weights": bool(c.get("norm_topk_prob", False)),
            "shared_expert_d_ff": units * (c.get("n_shared_experts") or 0),
            "router_selection_bias": True, "router_scoring": "sigmoid",
            "router_groups": c.get("n_group") or 1, "router_groups_kept": c.get("topk_group") or 1,
            "routed_scaling": float(c.get("routed_scaling_factor", 1.0)),
            "dense_ffn_layers": tuple(range(dense)), "dense_d_ff": dense_d_ff if dense else 0}


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


READERS = {"glm4_moe": _glm4_moe, "dots1": _dots1}
