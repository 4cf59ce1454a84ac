"""Each supported model type's `config.json` as `TransformerConfig` fields (`READERS`).

A reader takes the file through a `Reader`, which accounts for every key: what a family's
transformers implementation reads becomes a field, a key holding another value than the
one kvjax runs is refused by name.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import UnsupportedModelError
from .reader import Reader
from .rope import rope_fields


def _gpt2(c: Reader) -> dict[str, Any]:
    width = c.require("n_embd")
    c.expect("scale_attn_by_inverse_layer_idx", False, False, "attention scaled by layer")
    c.expect("reorder_and_upcast_attn", False, False, "kvjax computes softmax in float32")
    c.expect("is_encoder_decoder", False, False, "GPT-2 is decoder-only")
    positions = c.require("n_positions")
    c.expect("n_ctx", positions, positions, "older files repeat n_positions as n_ctx")
    return dict(
        vocab_size=c.require("vocab_size"), d_model=width, num_heads=c.require("n_head"),
        d_ff=c.get("n_inner") or 4 * width, num_decoder_layers=c.require("n_layer"),
        max_len=positions, positional_encoding="learned", norm="pre",
        activation=c.activation("activation_function", "gelu_new"),
        layer_norm_eps=c.get("layer_norm_epsilon", 1e-5), qkv_bias=True, out_bias=True,
        scale_embeddings=False)


def _opt(c: Reader) -> dict[str, Any]:
    """OPT (125M to 66B): GPT-2's layer with ReLU, learned positions (the files' table
    starts two rows later, its first two unused) and biases where `enable_bias`. OPT-350m's
    layout (post-LN, embeddings narrower than the layers) is refused."""
    width = c.require("hidden_size")
    c.expect("is_encoder_decoder", False, False, "OPT is decoder-only")
    c.expect("do_layer_norm_before", True, True, "OPT-350m's post-LN layers")
    c.expect("word_embed_proj_dim", width, width, "OPT-350m's embeddings projected to the "
             "layers' width")
    c.expect("_remove_final_layer_norm", False, False, "no norm after the last layer")
    c.expect("layer_norm_elementwise_affine", True, True, "LayerNorm without scale and bias")
    bias = bool(c.get("enable_bias", True))
    return dict(
        vocab_size=c.require("vocab_size"), d_model=width, num_heads=c.require(
            "num_attention_heads"), d_ff=c.require("ffn_dim"),
        num_decoder_layers=c.require("num_hidden_layers"),
        max_len=c.require("max_position_embeddings"), positional_encoding="learned",
        norm="pre", activation=c.activation("activation_function", "relu"),
        layer_norm_eps=1e-5, qkv_bias=bias, out_bias=bias, ffn_bias=bias,
        scale_embeddings=False)


def _gpt_neox(c: Reader) -> dict[str, Any]:
    """GPT-NeoX and Pythia: LayerNorm before each sublayer, the attention and the FFN side by
    side on the layer's input (`use_parallel_residual`, on unless false), biases on every
    projection (attention's unless `attention_bias` is false), RoPE on the leading
    `partial_rotary_factor` of each head's dimensions. Released files give that fraction and
    RoPE's base as `rotary_pct` (0.25 where absent) and `rotary_emb_base`, which transformers
    reads where `rope_parameters` names none; `rope_scaling`, if set, replaces
    `rope_parameters` whole."""
    scaling, parameters = c.get("rope_scaling"), c.get("rope_parameters")
    bias = bool(c.get("attention_bias", True))
    return _parallel(c, dict(scaling or parameters or {}), c.get("rotary_pct", 0.25),
                     c.get("rotary_emb_base", 10000.0), activation="gelu",
                     parallel_residual=bool(c.get("use_parallel_residual", True)),
                     qkv_bias=bias, out_bias=bias)


def _phi(c: Reader) -> dict[str, Any]:
    """Phi-1, Phi-1.5 and Phi-2: GPT-NeoX's parallel layer with one LayerNorm that both the
    attention and the FFN read, x + Attn(norm(x)) + FFN(norm(x)); RoPE over the leading
    `partial_rotary_factor` of each head (0.5 where absent), GQA where
    `num_key_value_heads` says, a bias on the output layer."""
    c.expect("qk_layernorm", False, False, "LayerNorm over each head's query and key")
    heads = c.require("num_attention_heads")
    return {**_parallel(c, _rope_params(c), c.get("partial_rotary_factor", 0.5),
                        c.get("rope_theta", 10000.0), activation="gelu_new",
                        parallel_residual=True, qkv_bias=True, out_bias=True),
            "shared_norm": True, "logits_bias": True,
            "num_kv_heads": c.get("num_key_value_heads", heads)}


def _parallel(c: Reader, rope_params: dict[str, Any], fraction: float, base: float, *,
              activation: str, **fields) -> dict[str, Any]:
    """The fields GPT-NeoX and Phi share: pre-LN (LayerNorm), biases in the FFN, RoPE over the
    leading `fraction` of each head (where `rope_params` names no `partial_rotary_factor`)
    at `base` (where it names no `rope_theta`)."""
    width, heads = c.require("hidden_size"), c.require("num_attention_heads")
    c.expect("is_encoder_decoder", False, False, "decoder-only model")
    max_len = c.require("max_position_embeddings")
    return dict(
        vocab_size=c.require("vocab_size"), d_model=width, num_heads=heads,
        d_ff=c.require("intermediate_size"), num_decoder_layers=c.require("num_hidden_layers"),
        max_len=max_len, norm="pre", activation=c.activation("hidden_act", activation),
        layer_norm_eps=c.get("layer_norm_eps", 1e-5), ffn_bias=True, scale_embeddings=False,
        **_partial_rope(c, rope_params, fraction, base, width // heads), **fields)


def _partial_rope(c: Reader, rope_params: dict[str, Any], fraction: float | None,
                  base: float, head_dim: int | None = None) -> dict[str, Any]:
    """RoPE's fields, turning the leading `fraction` of each head's `head_dim` dimensions
    (where `rope_params` names no `partial_rotary_factor`) at `base` (where it names no
    `rope_theta`). `fraction` None: every dimension turns, and a `partial_rotary_factor`
    among `rope_params` is refused as any setting `rope_fields` does not know."""
    params = dict(rope_params)
    if fraction is not None:
        given = params.pop("partial_rotary_factor", None)
        fraction = float(fraction if given is None else given)
    fields = rope_fields(params, base, c.source, c.get("max_position_embeddings"))
    _rotated_halves(c)
    if fraction is None or int(head_dim * fraction) == head_dim:
        return fields
    return {**fields, "rotary_dim": int(head_dim * fraction)}


def _rope_params(c: Reader) -> dict[str, Any]:
    """RoPE's settings: transformers 5's `rope_parameters` over the older `rope_scaling`."""
    return {**(c.get("rope_scaling") or {}), **(c.get("rope_parameters") or {})}


def _stablelm(c: Reader) -> dict[str, Any]:
    """StableLM (StableLM 2 1.6B, StableLM-3B-4E1T, Stable Code 3B): Llama's layer with
    LayerNorm (with biases) for RMSNorm, RoPE over the leading `partial_rotary_factor` of each
    head (0.25 where absent), q/k/v biases where `use_qkv_bias`."""
    c.expect("qk_layernorm", False, False, "a LayerNorm of its own for each head's query and key")
    c.expect("use_parallel_residual", False, False, "attention and FFN side by side: StableLM 2 "
             "12B's layout, which also needs per-head query and key norms")
    width, heads = c.require("hidden_size"), c.require("num_attention_heads")
    rope = _partial_rope(c, _rope_params(c), c.get("partial_rotary_factor", 0.25),
                         c.get("rope_theta", 10000.0), width // heads)
    return {**_llama_like(c, qkv_bias=bool(c.get("use_qkv_bias", False)), out_bias=False,
                          ffn_bias=False, rope=rope),
            "norm_type": "layernorm", "layer_norm_eps": c.get("layer_norm_eps", 1e-5)}


def _rope(c: Reader, phi3: bool = False) -> dict[str, Any]:
    """RoPE's base and scaling from `rope_parameters` (transformers 5) or the older
    `rope_theta` and `rope_scaling`. Phi-3's (`phi3`) may turn only the leading
    `partial_rotary_factor` of each head's dimensions, and its 'su' and 'yarn' are longrope."""
    params = _rope_params(c)
    fraction = head_dim = None
    if phi3:
        if params.get("rope_type", params.get("type")) in ("su", "yarn"):
            params = {**params, "rope_type": "longrope"}
        # Where the RoPE parameters give one too, transformers reads theirs.
        fraction = c.get("partial_rotary_factor", 1.0)
        head_dim = c.get("head_dim") or c.require("hidden_size") // c.require(
            "num_attention_heads")
    if params.get("rope_type", params.get("type")) in ("llama3", "yarn", "longrope"):
        # As transformers reads it: a top-level original length (Phi-3 keeps one there)
        # wins over the one among the RoPE parameters.
        top = c.get("original_max_position_embeddings")
        params = params if top is None else {**params, "original_max_position_embeddings": top}
    return _partial_rope(c, params, fraction, c.get("rope_theta", 10000.0), head_dim)


def _rotated_halves(c: Reader) -> None:
    """Refuses RoPE that turns the pairs (x[2i], x[2i+1]) instead of the halves."""
    c.expect("rope_interleaved", False, False, "kvjax rotates the halves (x[i], x[i + H/2])")


def _llama_like(c: Reader, *, qkv_bias: bool, out_bias: bool, ffn_bias: bool,
                activation_key: str = "hidden_act", rope: dict[str, Any] | None = None,
                activation: str | None = None, gated: bool = True):
    width, heads = c.require("hidden_size"), c.require("num_attention_heads")
    c.expect("is_encoder_decoder", False, False, "decoder-only model")
    activation = activation or c.activation(activation_key, "silu")
    rope = _rope(c) if rope is None else rope
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


def _llama(c: Reader) -> dict[str, Any]:
    bias = bool(c.get("attention_bias", False))
    return _llama_like(c, qkv_bias=bias, out_bias=bias, ffn_bias=bool(c.get("mlp_bias", False)))


def _full_attention_layers(c: Reader) -> None:
    """Refuses Qwen's per-layer sliding windows (`use_sliding_window` with `layer_types`):
    kvjax gives every layer the same attention."""
    c.expect("use_sliding_window", False, False, "sliding-window attention")
    c.get("sliding_window")  # read only when use_sliding_window is on
    layer_types = c.get("layer_types") or []
    sliding = [i for i, kind in enumerate(layer_types) if kind != "full_attention"]
    if sliding:
        raise UnsupportedModelError(f"{c.source}: layers {sliding} use "
                                    f"{layer_types[sliding[0]]!r}; kvjax runs full attention")


def _qwen2(c: Reader) -> dict[str, Any]:
    _full_attention_layers(c)
    return _llama_like(c, qkv_bias=True, out_bias=False, ffn_bias=False)


def _qwen3(c: Reader) -> dict[str, Any]:
    """Qwen2's architecture with RMSNorm over each head's query and key and, by default, no
    biases."""
    _full_attention_layers(c)
    bias = bool(c.get("attention_bias", False))
    return {**_llama_like(c, qkv_bias=bias, out_bias=bias, ffn_bias=False), "qk_norm": True}


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
    return {**_llama(c), "unrotated_layers": tuple(i for i, flag in enumerate(flags) if not flag)}


def _granite(c: Reader) -> dict[str, Any]:
    """Llama's architecture with four multipliers: on the embeddings, on each sublayer's
    output before the residual sum, as the attention scale (in place of 1/√head_dim; 1 where
    absent, as transformers takes it), and dividing the logits."""
    return {**_llama(c),
            "embedding_multiplier": float(c.get("embedding_multiplier", 1.0)),
            "residual_multiplier": float(c.get("residual_multiplier", 1.0)),
            "attention_scale": float(c.get("attention_multiplier", 1.0)),
            "logits_scaling": float(c.get("logits_scaling", 1.0))}


def _mistral(c: Reader) -> dict[str, Any]:
    """Llama's architecture where every layer attends over the last `sliding_window`
    positions (null: all of them)."""
    return {**_llama_like(c, qkv_bias=False, out_bias=False, ffn_bias=False),
            "sliding_window": c.get("sliding_window")}


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
    return {**_llama_like(c, qkv_bias=False, out_bias=False, ffn_bias=False,
                          rope=_rope(c, phi3=True)),
            "sliding_window": c.get("sliding_window")}


def _sliding_layers(c: Reader, layers: int, pattern: int, window_default=None):
    """(sliding_window, full_attention_layers) of a model whose layers mix sliding-window
    and full attention: `layer_types` names each layer's, or every `pattern`-th layer is
    full. A window of null leaves every layer full, which only a model without sliding
    layers may ask."""
    layer_types = c.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(layers)]
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown or len(layer_types) != layers:
        raise UnsupportedModelError(f"{c.source}: layer_types={json.dumps(layer_types)} must "
                                    f"name 'full_attention' or 'sliding_attention' for each "
                                    f"of the {layers} layers")
    window = c.get("sliding_window", window_default)
    full = tuple(i for i, kind in enumerate(layer_types) if kind == "full_attention")
    if window is None:
        if len(full) < layers:
            raise UnsupportedModelError(f"{c.source}: sliding_attention layers need a "
                                        "sliding_window")
        full = ()
    return window, full


def _ropes_by_layer_type(c: Reader, default_base: float, local_base: float | None):
    """(RoPE fields of the full-attention layers, the RoPE base of the sliding-window ones,
    which turn unscaled): from `rope_parameters` per layer type (transformers 5), or the
    older `rope_theta` and `rope_scaling` of the full layers, the sliding ones turning with
    `local_base` (None: the same base)."""
    params = c.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        unknown = sorted(set(params) - {"full_attention", "sliding_attention"})
        if unknown:
            raise UnsupportedModelError(f"{c.source}: rope_parameters for {unknown} are not "
                                        "supported")
    else:
        full, local = {**(c.get("rope_scaling") or {}), **params}, {}
    max_len = c.get("max_position_embeddings")
    rope = rope_fields(full, c.get("rope_theta", default_base), c.source, max_len)
    local_rope = rope_fields(local, rope["rope_base"] if local_base is None else local_base,
                             c.source, max_len)
    if local_rope.get("rope_scaling", "none") != "none":
        raise UnsupportedModelError(f"{c.source}: scaled RoPE on sliding_attention layers is "
                                    "not supported")
    _rotated_halves(c)
    return rope, local_rope["rope_base"]


def _gemma(c: Reader, rope: dict[str, Any], default_pattern: int) -> dict[str, Any]:
    """What Gemma 2 and 3 share: Llama's layout with √D-scaled embeddings, (1 + w) RMSNorms
    around each sublayer as well as before it, GeGLU, 1/√query_pre_attn_scalar as the
    attention scale, optional soft caps, and sliding-window layers among global ones
    (`layer_types`, or every `sliding_window_pattern`-th layer global in older files)."""
    c.get("hidden_act")  # transformers' Gemma reads hidden_activation only
    c.expect("use_bidirectional_attention", False, False, "kvjax's Gemma is causal")
    bias = bool(c.get("attention_bias", False))
    fields = _llama_like(c, qkv_bias=bias, out_bias=bias, ffn_bias=False,
                         activation_key="hidden_activation", rope=rope)
    pattern = c.get("sliding_window_pattern", c.get("_sliding_window_pattern", default_pattern))
    window, full = _sliding_layers(c, fields["num_decoder_layers"], pattern)
    c.expect("sliding_window_size", window, window, "older files repeat sliding_window")
    return {**fields, "scale_embeddings": True, "norm_unit_offset": True,
            "sandwich_norms": True, "sliding_window": window, "full_attention_layers": full,
            "attention_scale": float(c.require("query_pre_attn_scalar")) ** -0.5,
            "attention_softcap": c.get("attn_logit_softcapping"),
            "logits_softcap": c.get("final_logit_softcapping")}


def _starcoder2(c: Reader) -> dict[str, Any]:
    """StarCoder2 (3B, 7B, 15B): Llama's attention with biases where `use_bias`, LayerNorm,
    an FFN of tanh GELU without a gate (`c_fc`, `c_proj`), every layer over the last
    `sliding_window` positions where it is set."""
    bias = bool(c.get("use_bias", True))
    return {**_llama_like(c, qkv_bias=bias, out_bias=bias, ffn_bias=bias, gated=False,
                          activation=c.activation("hidden_act", "gelu_pytorch_tanh")),
            "norm_type": "layernorm", "layer_norm_eps": c.get("norm_epsilon", 1e-5),
            "sliding_window": c.get("sliding_window")}


def _gemma1(c: Reader) -> dict[str, Any]:
    """Gemma (2B, 7B) and CodeGemma: Llama's layout with √D-scaled embeddings, (1 + w)
    RMSNorms and GeGLU. The releases' `hidden_act` "gelu" means tanh GELU, as transformers
    reads it; their `hidden_activation`, which says so too, transformers does not read."""
    c.expect("use_bidirectional_attention", False, False, "kvjax's Gemma is causal")
    c.get("hidden_activation")
    activation = "gelu" if c.get("hidden_act") == "gelu" else c.activation(
        "hidden_act", "gelu_pytorch_tanh")
    bias = bool(c.get("attention_bias", False))
    return {**_llama_like(c, qkv_bias=bias, out_bias=bias, ffn_bias=False,
                          activation=activation),
            "scale_embeddings": True, "norm_unit_offset": True}


def _gemma2(c: Reader) -> dict[str, Any]:
    """Gemma 2: every other layer global, soft caps on attention and output logits."""
    return _gemma(c, _rope(c), default_pattern=2)


def _gemma3(c: Reader) -> dict[str, Any]:
    """Gemma 3's text model: Gemma 2's layers with (1 + w) RMSNorm over each head's query
    and key, every sixth layer global by default, and RoPE of their own for the local
    layers (`rope_parameters` per layer type, or the older `rope_theta`, `rope_scaling` of
    the global layers and `rope_local_base_freq`)."""
    rope, local_base = _ropes_by_layer_type(c, 1000000.0, c.get("rope_local_base_freq", 10000.0))
    fields = {**_gemma(c, rope, default_pattern=6), "qk_norm": True}
    if fields["sliding_window"] is not None:
        fields["local_rope_base"] = local_base
    return fields


def _olmo2(c: Reader, rope: dict[str, Any] | None = None) -> dict[str, Any]:
    """OLMo 2: Llama's layout with each sublayer's RMSNorm on its output, x + norm(f(x)),
    and one RMSNorm over all heads' queries (and one over the keys) before RoPE."""
    bias = bool(c.get("attention_bias", False))
    return {**_llama_like(c, qkv_bias=bias, out_bias=bias, ffn_bias=False, rope=rope),
            "norm": "output", "qk_norm": True, "qk_norm_across_heads": True,
            "layer_norm_eps": c.get("rms_norm_eps", 1e-5)}


def _olmo3(c: Reader) -> dict[str, Any]:
    """OLMo 3: OLMo 2's layers, three of every four attending over a sliding window (by
    default) and turning with unscaled RoPE where the full layers may scale theirs."""
    rope, local_base = _ropes_by_layer_type(c, 500000.0, None)
    fields = _olmo2(c, rope)
    window, full = _sliding_layers(c, fields["num_decoder_layers"], 4, window_default=4096)
    fields.update(sliding_window=window, full_attention_layers=full)
    if window is not None and (local_base != rope["rope_base"]
                               or rope.get("rope_scaling", "none") != "none"):
        fields["local_rope_base"] = local_base
    return fields


def _marian(c: Reader) -> dict[str, Any]:
    width = c.require("d_model")
    heads = c.require("encoder_attention_heads")
    for encoder_key, decoder_key in (("encoder_attention_heads", "decoder_attention_heads"),
                                     ("encoder_ffn_dim", "decoder_ffn_dim")):
        c.expect(decoder_key, c.get(encoder_key), c.get(encoder_key),
                 f"kvjax's encoder and decoder share {encoder_key.split('_', 1)[1]}")
    c.expect("share_encoder_decoder_embeddings", True, True,
             "kvjax's encoder and decoder share one embedding table")
    vocab = c.require("vocab_size")
    c.expect("decoder_vocab_size", vocab, vocab, "one vocabulary for source and target")
    c.expect("is_encoder_decoder", True, True, "Marian is an encoder-decoder")
    return dict(
        vocab_size=vocab, d_model=width, num_heads=heads, d_ff=c.require("encoder_ffn_dim"),
        num_encoder_layers=c.require("encoder_layers"),
        num_decoder_layers=c.require("decoder_layers"),
        max_len=c.require("max_position_embeddings"), positional_encoding="sinusoidal",
        sinusoid_layout="halves", norm="post", layer_norm_eps=1e-5,
        activation=c.activation("activation_function", "swish"), qkv_bias=True, out_bias=True,
        scale_embeddings=bool(c.get("scale_embedding", False)), logits_bias=True,
        bos_id=c.get("decoder_start_token_id", c.get("pad_token_id")))


READERS = {"gpt2": _gpt2, "llama": _llama, "mistral": _mistral, "phi3": _phi3,
           "qwen2": _qwen2, "qwen3": _qwen3, "smollm3": _smollm3, "granite": _granite,
           "gemma2": _gemma2, "gemma3_text": _gemma3, "olmo2": _olmo2, "olmo3": _olmo3,
           "gpt_neox": _gpt_neox, "phi": _phi, "stablelm": _stablelm,
           "opt": _opt, "gemma": _gemma1,
           "starcoder2": _starcoder2, "marian": _marian}
