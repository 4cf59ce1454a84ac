"""The `config.json` readers of the families built on Llama's layer: RMSNorm (or LayerNorm) before
each sublayer, RoPE, a gated FFN, GQA; with their variations of norms, windows and scales (Qwen,
SmolLM3, Granite, Mistral, Ministral, Phi-3, StableLM, Gemma, GLM-4, Helium, ERNIE 4.5,
Seed-OSS) and those whose FFN is a mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
GraniteMoE, gpt-oss). `READERS` maps each model type to its reader; `llama_like_fields` is what
every family of Llama's layer shares, here and in the modules of the others (`output_norms.py`,
`plain_ffn.py`, `cohere.py`)."""

from __future__ import annotations

import json
from typing import Any

from .errors import UnsupportedModelError
from .reader import Reader
from .rope import partial_rope, rope_of, rope_settings, ropes_by_layer_type


def llama_like_fields(c: Reader, *, qkv_bias: bool, out_bias: bool, ffn_bias: bool,
                activation_key: str = "hidden_act", rope: dict[str, Any] | None = None,
                activation: str | None = None, gated: bool = True):
    width, heads = c.require("hidden_size"), c.require("num_attention_heads")
    c.expect("is_encoder_decoder", False, False, "decoder-only model")
    activation = activation or c.activation(activation_key, "silu")
    rope = rope_of(c) if rope is None else rope
    max_len = c.require("max_position_embeddings")
    if rope.get("rope_scaling") == "longrope":  # the short factors' length, unless asked for more
        max_len = min(max_len, rope["rope_original_max_len"])
    return dict(
        vocab_size=c.require("vocab_size"), d_model=width, num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads", heads), head_dim=c.get("head_dim"),
        d_ff=c.require("intermediate_size"), num_decoder_layers=c.require("num_hidden_layers"),
        max_len=max_len, norm="pre", norm_type="rmsnorm",
        layer_norm_eps=c.get("rms_norm_eps", 1e-6),
        activation=_gated(activation, c.source) if gated else activation,
        qkv_bias=qkv_bias, out_bias=out_bias, ffn_bias=ffn_bias, scale_embeddings=False,
        **rope)


def _gated(activation: str, source: str) -> str:
    gated = {"silu": "swiglu", "gelu": "geglu"}
    if activation not in gated:
        raise UnsupportedModelError(f"{source}: a gated feed-forward network with "
                                    f"{activation} is not supported (SiLU: SwiGLU, tanh GELU: "
                                    "GeGLU)")
    return gated[activation]


def read_llama(c: Reader, rope_base: float = 10000.0) -> dict[str, Any]:
    """Llama: biases on q, k, v and the output where `attention_bias`, on the FFN where
    `mlp_bias`; RoPE at `rope_base` where the file names no `rope_theta`."""
    bias = bool(c.get("attention_bias", False))
    return llama_like_fields(c, qkv_bias=bias, out_bias=bias,
                             ffn_bias=bool(c.get("mlp_bias", False)),
                             rope=rope_of(c, base=rope_base))


def _full_attention_layers(c: Reader) -> None:
    """Checks that a Qwen model's file asks for full attention in every layer: refuses
    `use_sliding_window` (Qwen's mixtures of experts), and sliding layers named in
    `layer_types` of a file that turns the windows off, since which it means is unclear."""
    c.expect("use_sliding_window", False, False, "sliding-window attention")
    c.get("sliding_window")  # read only when use_sliding_window is on
    layer_types = c.get("layer_types") or []
    sliding = [i for i, kind in enumerate(layer_types) if kind != "full_attention"]
    if sliding:
        raise UnsupportedModelError(f"{c.source}: layers {sliding} use "
                                    f"{layer_types[sliding[0]]!r} with use_sliding_window "
                                    "false; kvjax runs full attention there")


def _qwen_windows(c: Reader, layers: int) -> dict[str, Any]:
    """Qwen2's and Qwen3's sliding windows: with `use_sliding_window`, the layers from
    `max_window_layers` on (or those `layer_types` names) attend over the last
    `sliding_window` positions and the others over all of them; without it, every layer
    over all of them."""
    if not c.get("use_sliding_window", False):
        _full_attention_layers(c)
        return {}
    first_sliding = c.get("max_window_layers", 28)
    window, full = sliding_layers(
        c, ["sliding_attention" if i >= first_sliding else "full_attention"
            for i in range(layers)], window_default=4096)
    if len(full) == layers:
        return {}
    return {"sliding_window": window, "full_attention_layers": full}


def _qwen2(c: Reader) -> dict[str, Any]:
    fields = llama_like_fields(c, qkv_bias=True, out_bias=False, ffn_bias=False)
    return {**fields, **_qwen_windows(c, fields["num_decoder_layers"])}


def _qwen3(c: Reader) -> dict[str, Any]:
    """Qwen2's architecture with RMSNorm over each head's query and key and, by default, no
    biases."""
    bias = bool(c.get("attention_bias", False))
    fields = {**llama_like_fields(c, qkv_bias=bias, out_bias=bias, ffn_bias=False), "qk_norm": True}
    return {**fields, **_qwen_windows(c, fields["num_decoder_layers"])}


def _qwen3_moe(c: Reader) -> dict[str, Any]:
    """Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3's attention and a mixture of experts of
    `moe_intermediate_size` hidden units in every layer (`decoder_sparse_step` 1, no
    `mlp_only_layers`; the dense width `intermediate_size` is then used nowhere)."""
    c.expect("decoder_sparse_step", 1, 1, "dense FFNs between the expert layers")
    c.expect("mlp_only_layers", [], [], "dense FFNs in some layers")
    # Its layers, unlike Qwen3's, would all take the window: refused until a file needs it.
    c.expect("use_sliding_window", False, False, "sliding-window attention")
    fields = {**_qwen3(c), "d_ff": c.require("moe_intermediate_size")}
    return {**fields, **experts_fields(c, bool(c.get("norm_topk_prob", False)))}


def _qwen2_moe(c: Reader) -> dict[str, Any]:
    """Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention and, in every layer,
    a mixture of experts of `moe_intermediate_size` hidden units beside a shared expert of
    `shared_expert_intermediate_size` that every token goes through, scaled by a sigmoid
    gate (dense layers, `decoder_sparse_step` > 1 or `mlp_only_layers`, are refused as for
    Qwen3-MoE); q, k and v have biases unless `qkv_bias` is false."""
    c.expect("decoder_sparse_step", 1, 1, "dense FFNs between the expert layers")
    c.expect("mlp_only_layers", [], [], "dense FFNs in some layers")
    _full_attention_layers(c)
    attention = llama_like_fields(c, qkv_bias=bool(c.get("qkv_bias", True)), out_bias=False,
                            ffn_bias=False)
    fields = {**attention, "d_ff": c.require("moe_intermediate_size"),
              "shared_expert_d_ff": c.require("shared_expert_intermediate_size"),
              "shared_expert_gate": True}
    return {**fields, **experts_fields(c, bool(c.get("norm_topk_prob", False)))}


def experts_fields(c: Reader, normalize: bool) -> dict[str, Any]:
    """The mixture-of-experts fields: `num_experts` (or `num_local_experts`, as Mixtral's
    files and transformers 5 write it) experts, `num_experts_per_tok` of them for each
    token, their weights divided by their sum where `normalize`. The router's training
    settings (its auxiliary loss and whether to return its logits, its jitter noise) change
    nothing in inference: transformers applies them in training only, and kvjax fine-tunes
    without them, as transformers does by default (`kvjax train --router-aux-loss-coef`
    adds the loss)."""
    for key in ("output_router_logits", "router_aux_loss_coef", "router_jitter_noise"):
        c.get(key)
    count, local = c.get("num_experts"), c.get("num_local_experts")
    if None not in (count, local) and count != local:
        raise UnsupportedModelError(f"{c.source}: num_experts={count} and "
                                    f"num_local_experts={local} differ")
    count = local if count is None else count
    if count is None:
        raise UnsupportedModelError(f"{c.source}: num_experts (or num_local_experts) is "
                                    "missing")
    return {"num_experts": count, "experts_per_token": c.require("num_experts_per_tok"),
            "normalize_expert_weights": normalize}


def _gpt_oss(c: Reader) -> dict[str, Any]:
    """gpt-oss (20b, 120b): Llama's layout with biases on every attention projection (unless
    `attention_bias` is false), a sink logit for each query head, every other layer over a
    sliding window (or as `layer_types` says), and a mixture of experts in every layer whose
    router and experts have biases, each token's chosen experts weighted by a softmax over
    their router logits alone, their units the clamped SwiGLU (`swiglu_alpha`,
    `swiglu_limit`). transformers runs that SwiGLU whatever `hidden_act` says, so does kvjax.
    The releases' experts are MXFP4 (`quantization_config`), unpacked as they load
    (`mxfp4.py`); the files say which tensors are packed."""
    c.get("hidden_act")
    # OpenAI's releases repeat two settings under their own names, which transformers does
    # not read: the experts a token takes, and the length YaRN's scaling starts from.
    c.get("initial_context_length")
    own, count = c.get("experts_per_token"), c.require("num_experts_per_tok")
    if own is not None and own != count:
        raise UnsupportedModelError(f"{c.source}: experts_per_token={own} and "
                                    f"num_experts_per_tok={count} differ")
    quantization = c.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        if method != "mxfp4":
            raise UnsupportedModelError(f"{c.source}: quantization_config with quant_method="
                                        f"{method!r} is not supported (gpt-oss: 'mxfp4', its "
                                        "experts' weights, unpacked as they load)")
    bias = bool(c.get("attention_bias", True))
    fields = llama_like_fields(c, qkv_bias=bias, out_bias=bias, ffn_bias=True,
                         activation="clamped_swiglu", gated=False)
    layers = fields["num_decoder_layers"]
    window, full = sliding_layers(c, ["sliding_attention" if i % 2 == 0 else "full_attention"
                                       for i in range(layers)], window_default=128)
    return {**fields, **experts_fields(c, normalize=True), "sliding_window": window,
            "full_attention_layers": full if window is not None else (),
            "attention_sinks": True, "router_bias": True,
            "swiglu_alpha": float(c.get("swiglu_alpha", 1.702)),
            "swiglu_limit": float(c.get("swiglu_limit", 7.0))}


def _smollm3(c: Reader) -> dict[str, Any]:
    """Llama's architecture where the layers `no_rope_layers` marks 0 attend with no position
    encoding (NoPE); without the list, every `no_rope_layer_interval`-th layer, as
    transformers fills it in."""
    _full_attention_layers(c)
    layers = c.require("num_hidden_layers")
    interval = c.get("no_rope_layer_interval", 4)
    flags = c.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers or any(flag not in (0, 1) for flag in flags):
        raise UnsupportedModelError(f"{c.source}: no_rope_layers={json.dumps(flags)} must hold "
                                    f"a 1 (RoPE) or 0 (none) for each of the {layers} layers")
    return {**read_llama(c),
            "unrotated_layers": tuple(i for i, flag in enumerate(flags) if not flag)}


def _granite(c: Reader) -> dict[str, Any]:
    """Llama's architecture with four multipliers: on the embeddings, on each sublayer's
    output before the residual sum, as the attention scale (in place of 1/√head_dim; 1 where
    absent, as transformers takes it), and dividing the logits."""
    return {**read_llama(c),
            "embedding_multiplier": float(c.get("embedding_multiplier", 1.0)),
            "residual_multiplier": float(c.get("residual_multiplier", 1.0)),
            "attention_scale": float(c.get("attention_multiplier", 1.0)),
            "logits_scaling": float(c.get("logits_scaling", 1.0))}


def _granitemoe(c: Reader) -> dict[str, Any]:
    """Granite 3 MoE (1B-A400M, 3B-A800M): Granite's multipliers and a mixture of
    `num_local_experts` experts in every layer, each token's chosen ones weighted by a softmax
    over their router logits alone (the full softmax's weights divided by their sum)."""
    return {**_granite(c), **experts_fields(c, normalize=True)}


MISTRAL_WINDOW = 4096  # transformers' Mistral, Ministral and Gemma where the key is absent


def _mistral(c: Reader) -> dict[str, Any]:
    """Llama's architecture where every layer attends over the last `sliding_window`
    positions (null: all of them; absent: transformers' 4,096)."""
    return {**llama_like_fields(c, qkv_bias=False, out_bias=False, ffn_bias=False),
            "sliding_window": c.given("sliding_window", MISTRAL_WINDOW)}


def _mixtral(c: Reader) -> dict[str, Any]:
    """Mixtral (8x7B, 8x22B): Mistral's attention and a mixture of `num_local_experts`
    experts in every layer, each token's chosen weights divided by their sum."""
    return {**_mistral(c), **experts_fields(c, normalize=True)}


def _phi3(c: Reader) -> dict[str, Any]:
    """Mistral's architecture (an optional sliding window) whose files hold q, k and v in one
    projection and the gate and up projections in another. RoPE may turn only the leading
    `partial_rotary_factor` of each head's dimensions (Phi-4 mini), and the long-context
    variants' `longrope` by default within the original length, where transformers turns
    with the short factors (`rope.py`; a longer `max_len` turns with the long ones)."""
    c.get("original_max_position_embeddings")  # every Phi-3 file has it; only scaling reads it
    # Phi-4 mini's files carry two keys of its training code that transformers' Phi-3 reads
    # nowhere. At 1, the value its releases hold, they leave every layer in full attention
    # and positions uninterpolated; another value would be ignored, so it is refused.
    for key, meaning in (("full_attn_mod", "every layer in full attention"),
                         ("interpolate_factor", "positions not interpolated")):
        c.expect(key, 1, 1, f"Phi-4 mini's files hold 1, {meaning}; transformers' Phi-3 "
                            "ignores the key, so only that value runs as it does")
    return {**llama_like_fields(c, qkv_bias=False, out_bias=False, ffn_bias=False,
                          rope=rope_of(c, phi3=True)),
            "sliding_window": c.get("sliding_window")}


def _glm(c: Reader, post_norms: bool = False) -> dict[str, Any]:
    """GLM-4 (GLM-4-9B-Chat; `glm4`, GLM-4-9B-0414 and GLM-Z1, with `post_norms`): Llama's
    layout with biases on q, k and v (unless `attention_bias` is false) but not on the
    output, the gate and up projections in one `gate_up_proj`, and RoPE over the leading
    `partial_rotary_factor` (a half by default) of each head turning the pairs
    (x[2i], x[2i + 1]): kvjax turns the halves, so each head's query and key rows are put
    in that order as they load (`weights.rope_rows_in_kvjax_order`), which leaves every
    product of a query and a key as it was. `post_norms`: an RMSNorm on each sublayer's
    output too, before the residual sum."""
    width, heads = c.require("hidden_size"), c.require("num_attention_heads")
    rope = partial_rope(c, rope_settings(c), c.get("partial_rotary_factor", 0.5),
                        c.get("rope_theta", 10000.0), c.get("head_dim") or width // heads)
    fields = llama_like_fields(c, qkv_bias=bool(c.get("attention_bias", True)), out_bias=False,
                         ffn_bias=False, rope=rope)
    return {**fields, "sandwich_norms": True} if post_norms else fields


def _helium(c: Reader) -> dict[str, Any]:
    """Helium (Kyutai, 2B): Llama's layout whose RoPE turns pairs of each head's dimensions
    (read as GLM's are, `weights.rope_halves_order`), biases on q, k and v where
    `attention_bias`, none on the output."""
    return llama_like_fields(c, qkv_bias=bool(c.get("attention_bias", False)), out_bias=False,
                       ffn_bias=bool(c.get("mlp_bias", False)))


def _ernie4_5(c: Reader) -> dict[str, Any]:
    """ERNIE 4.5 (Baidu's dense 0.3B): Llama's layout whose RoPE turns pairs of each head's
    dimensions (as Helium's), biases on every projection where `use_bias`."""
    bias = bool(c.get("use_bias", False))
    return llama_like_fields(c, qkv_bias=bias, out_bias=bias, ffn_bias=bias)


def _seed_oss(c: Reader) -> dict[str, Any]:
    """Seed-OSS (ByteDance, 36B): Llama's layout with biases on q, k and v
    (`attention_bias`, on by default), on the output where `attention_out_bias`, on the FFN
    where `mlp_bias`."""
    return llama_like_fields(c, qkv_bias=bool(c.get("attention_bias", True)),
                       out_bias=bool(c.get("attention_out_bias", False)),
                       ffn_bias=bool(c.get("mlp_bias", False)))


def _ministral(c: Reader) -> dict[str, Any]:
    """Ministral (8B): Mistral's layers, each over a sliding window or all positions as
    `layer_types` says (every layer over the window where it names none)."""
    fields = llama_like_fields(c, qkv_bias=False, out_bias=False, ffn_bias=False)
    windowed = c.given("sliding_window", MISTRAL_WINDOW) is not None
    kind = "sliding_attention" if windowed else "full_attention"
    window, full = sliding_layers(c, [kind] * fields["num_decoder_layers"],
                                  window_default=MISTRAL_WINDOW)
    return {**fields, "sliding_window": window, "full_attention_layers": full}


def _stablelm(c: Reader) -> dict[str, Any]:
    """StableLM (StableLM 2 1.6B, StableLM-3B-4E1T, Stable Code 3B): Llama's layer with
    LayerNorm (with biases) for RMSNorm, RoPE over the leading `partial_rotary_factor` of each
    head (0.25 where absent), q/k/v biases where `use_qkv_bias`."""
    c.expect("qk_layernorm", False, False, "a LayerNorm of its own for each head's query and key")
    c.expect("use_parallel_residual", False, False, "attention and FFN side by side: StableLM 2 "
             "12B's layout, which also needs per-head query and key norms")
    width, heads = c.require("hidden_size"), c.require("num_attention_heads")
    rope = partial_rope(c, rope_settings(c), c.get("partial_rotary_factor", 0.25),
                         c.get("rope_theta", 10000.0), width // heads)
    return {**llama_like_fields(c, qkv_bias=bool(c.get("use_qkv_bias", False)), out_bias=False,
                          ffn_bias=False, rope=rope),
            "norm_type": "layernorm", "layer_norm_eps": c.get("layer_norm_eps", 1e-5)}


def every_nth_full(layers: int, pattern, source: str) -> list[str]:
    """The layer types of a model whose every `pattern`-th layer attends over all positions
    and the others over a sliding window; a `pattern` (the file's `sliding_window_pattern`)
    that is not an integer >= 1 is refused by name."""
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise UnsupportedModelError(f"{source}: sliding_window_pattern={pattern!r} must be an "
                                    "integer >= 1")
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)]


def sliding_layers(c: Reader, default_types: list[str], window_default=None):
    """(sliding_window, full_attention_layers) of a model whose layers mix sliding-window
    and full attention: `layer_types` names each layer's, or else `default_types`. The
    window is the file's, `window_default` where it has no `sliding_window` key; a window of
    null leaves every layer full, which only a model without sliding layers may ask."""
    layers = len(default_types)
    layer_types = c.get("layer_types") or default_types
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown or len(layer_types) != layers:
        raise UnsupportedModelError(f"{c.source}: layer_types={json.dumps(layer_types)} must "
                                    f"name 'full_attention' or 'sliding_attention' for each "
                                    f"of the {layers} layers")
    window = c.given("sliding_window", window_default)
    full = tuple(i for i, kind in enumerate(layer_types) if kind == "full_attention")
    if window is None:
        if len(full) < layers:
            raise UnsupportedModelError(f"{c.source}: sliding_attention layers need a "
                                        "sliding_window")
        full = ()
    return window, full


def _gemma(c: Reader, rope: dict[str, Any], default_pattern: int) -> dict[str, Any]:
    """What Gemma 2 and 3 share: Llama's layout with √D-scaled embeddings, (1 + w) RMSNorms
    around each sublayer as well as before it, GeGLU, 1/√query_pre_attn_scalar as the
    attention scale, optional soft caps, and sliding-window layers among global ones
    (`layer_types`, or every `sliding_window_pattern`-th layer global in older files)."""
    c.get("hidden_act")  # transformers' Gemma reads hidden_activation only
    c.expect("use_bidirectional_attention", False, False, "kvjax's Gemma is causal")
    bias = bool(c.get("attention_bias", False))
    fields = llama_like_fields(c, qkv_bias=bias, out_bias=bias, ffn_bias=False,
                         activation_key="hidden_activation", rope=rope)
    pattern = c.get("sliding_window_pattern", c.get("_sliding_window_pattern", default_pattern))
    window, full = sliding_layers(c, every_nth_full(fields["num_decoder_layers"], pattern,
                                                    c.source),
                                  window_default=MISTRAL_WINDOW)
    c.expect("sliding_window_size", window, window, "older files repeat sliding_window")
    return {**fields, "scale_embeddings": True, "norm_unit_offset": True,
            "sandwich_norms": True, "sliding_window": window, "full_attention_layers": full,
            "attention_scale": float(c.require("query_pre_attn_scalar")) ** -0.5,
            "attention_softcap": c.get("attn_logit_softcapping"),
            "logits_softcap": c.get("final_logit_softcapping")}


def _gemma1(c: Reader) -> dict[str, Any]:
    """Gemma (2B, 7B) and CodeGemma: Llama's layout with √D-scaled embeddings, (1 + w)
    RMSNorms and GeGLU. The releases' `hidden_act` "gelu" means tanh GELU, as transformers
    reads it; their `hidden_activation`, which says so too, transformers does not read."""
    c.expect("use_bidirectional_attention", False, False, "kvjax's Gemma is causal")
    c.get("hidden_activation")
    activation = "gelu" if c.get("hidden_act") == "gelu" else c.activation(
        "hidden_act", "gelu_pytorch_tanh")
    bias = bool(c.get("attention_bias", False))
    return {**llama_like_fields(c, qkv_bias=bias, out_bias=bias, ffn_bias=False,
                          activation=activation),
            "scale_embeddings": True, "norm_unit_offset": True}


def _gemma2(c: Reader) -> dict[str, Any]:
    """Gemma 2: every other layer global, soft caps on attention and output logits."""
    return _gemma(c, rope_of(c), default_pattern=2)


def _vaultgemma(c: Reader) -> dict[str, Any]:
    """VaultGemma: Gemma 2's layers with one (1 + w) RMSNorm before each sublayer and none
    on its output (`pre_feedforward_layernorm` before the FFN)."""
    return {**_gemma(c, rope_of(c), default_pattern=2), "sandwich_norms": False}


def _gemma3(c: Reader) -> dict[str, Any]:
    """Gemma 3's text model: Gemma 2's layers with (1 + w) RMSNorm over each head's query
    and key, every sixth layer global by default, and RoPE of their own for the local
    layers (`rope_parameters` per layer type, or the older `rope_theta`, `rope_scaling` of
    the global layers and `rope_local_base_freq`)."""
    rope, local_base = ropes_by_layer_type(c, 1000000.0, c.get("rope_local_base_freq", 10000.0))
    fields = {**_gemma(c, rope, default_pattern=6), "qk_norm": True}
    if fields["sliding_window"] is not None:
        fields["local_rope_base"] = local_base
    return fields


def _olmoe(c: Reader) -> dict[str, Any]:
    """OLMoE (1B-7B): Llama's pre-norm layers with one RMSNorm over all heads' queries (and
    one over the keys) before RoPE, the queries, keys and values then clipped to
    ±`clip_qkv` where it is set, and a mixture of experts in every layer, whose weights are
    divided by their sum only where `norm_topk_prob`."""
    bias = bool(c.get("attention_bias", False))
    return {**llama_like_fields(c, qkv_bias=bias, out_bias=bias, ffn_bias=False),
            "qk_norm": True, "qk_norm_across_heads": True, "qkv_clip": c.get("clip_qkv"),
            "layer_norm_eps": c.get("rms_norm_eps", 1e-5),
            **experts_fields(c, bool(c.get("norm_topk_prob", False)))}


READERS = {"llama": read_llama, "mistral": _mistral, "phi3": _phi3, "qwen2": _qwen2,
           "qwen3": _qwen3, "smollm3": _smollm3, "granite": _granite, "gemma2": _gemma2,
           "gemma3_text": _gemma3, "vaultgemma": _vaultgemma, "stablelm": _stablelm,
           "gemma": _gemma1, "mixtral": _mixtral,
           "qwen3_moe": _qwen3_moe, "olmoe": _olmoe, "granitemoe": _granitemoe,
           "qwen2_moe": _qwen2_moe, "gpt_oss": _gpt_oss, "glm": _glm,
           "glm4": lambda c: _glm(c, post_norms=True), "helium": _helium,
           "ernie4_5": _ernie4_5, "seed_oss": _seed_oss, "ministral": _ministral}
