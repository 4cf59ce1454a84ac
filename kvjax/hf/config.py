"""A Hugging Face `config.json` as a `TransformerConfig`, refusing what kvjax does not run.

Every key of the file is either read, known to change nothing in inference (training-time
dropout, labels, caching switches, bookkeeping), checked to hold the one value kvjax
implements, or refused: a key this module does not know, with a value that is not empty,
false or null, is an error naming it. A loader that silently ignores, say, `rope_scaling`
gives a model that runs and writes worse text; this one stops and says so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvjax.model import TransformerConfig

from .errors import UnsupportedModelError
from .rope import rope_fields

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mistral", "phi3", "qwen2", "qwen3", "smollm3",
                         "granite", "gemma2", "gemma3_text", "marian")


# Keys that change nothing in inference: dropout (kvjax imports models for inference and
# fine-tunes them without dropout), initialisation, heads for other tasks, caching and
# output switches, token ids the tokenizer and generation_config.json own, bookkeeping.
_INFERENCE_NEUTRAL = frozenset({
    "_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype",
    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "id2label",
    "label2id", "problem_type", "chunk_size_feed_forward", "is_decoder", "add_cross_attention",
    "initializer_range", "init_std", "bos_token_id", "eos_token_id", "pad_token_id",
    "sep_token_id", "forced_eos_token_id", "forced_bos_token_id", "tokenizer_class",
    "task_specific_params", "prefix", "finetuning_task", "use_bfloat16", "torchscript",
    "pruned_heads", "tf_legacy_loss", "tie_encoder_decoder", "max_length", "min_length",
    "num_beams", "bad_words_ids", "do_sample", "early_stopping", "length_penalty",
    "no_repeat_ngram_size", "num_return_sequences", "temperature", "top_k", "top_p",
    "repetition_penalty", "transformers.js_config", "is_llama_config", "model_type",
    "tie_word_embeddings",  # tied or not follows the weight files (lm_head present or not)
    "attn_pdrop", "embd_pdrop", "resid_pdrop", "attention_dropout", "dropout",
    "activation_dropout", "classifier_dropout", "classif_dropout", "summary_activation",
    "summary_first_dropout", "summary_proj_to_labels", "summary_type", "summary_use_proj",
    "encoder_layerdrop", "decoder_layerdrop", "pretraining_tp", "num_hidden_layers",
    "max_window_layers",  # read only with sliding windows, which are refused
    "gradient_checkpointing", "scale_attn_weights", "_num_labels", "output_past",
    "_attn_implementation", "_attn_implementation_autoset",
    "cache_implementation",  # Gemma's "hybrid" cache: how transformers holds it
    # Classes of the model's own code (Phi-3's first releases), which transformers passes
    # over for its built-in implementation of the model type, as kvjax implements that one.
    "auto_map",
    # Marian: transformers' Marian reads none of these (its layers are always post-LN, its
    # positions always static sinusoids), so the same model runs here.
    "normalize_before", "add_final_layer_norm", "normalize_embedding",
    "static_position_embeddings", "extra_pos_embeddings", "add_bias_logits",
})

_ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_fast": "gelu",
                "gelu": "gelu_exact", "relu": "relu", "silu": "silu", "swish": "silu"}


def read_hf_config(directory: str | os.PathLike) -> dict[str, Any]:
    """The parsed `config.json` of a Hugging Face model directory."""
    path = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        raise FileNotFoundError(f"{directory} is not a directory")
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{directory} has no config.json: not a Hugging Face model "
                                "directory") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return values


def to_kvjax_config(hf: dict[str, Any], *, tied: bool, dtype: str = "float32",
                    source: str = "config.json", max_len: int | None = None
                    ) -> TransformerConfig:
    """The `TransformerConfig` of the model `hf` (a parsed config.json) describes.

    `tied` says whether the output layer is the embedding table (the weight files hold no
    separate `lm_head.weight`). `max_len`, for a RoPE model, is the longest sequence it will
    run, up to its max_position_embeddings (None: that, or a LongRoPE model's original
    length). Raises `UnsupportedModelError` naming what is not supported.
    """
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"{source}: model_type {model_type!r} is not supported; "
                                    f"kvjax loads {', '.join(SUPPORTED_MODEL_TYPES)}")
    reader = _Reader(hf, source)
    fields = {"gpt2": _gpt2, "llama": _llama, "mistral": _mistral, "phi3": _phi3,
              "qwen2": _qwen2, "qwen3": _qwen3, "smollm3": _smollm3, "granite": _granite,
              "gemma2": _gemma2, "gemma3_text": _gemma3, "marian": _marian}[model_type](reader)
    reader.refuse_unread()
    if max_len is not None:
        fields["max_len"] = _chosen_max_len(hf, fields, max_len, source)
    try:
        return TransformerConfig(**fields, tie_embeddings=tied, dtype=dtype, param_dtype=dtype,
                                 dropout=0.0)
    except ValueError as e:
        raise UnsupportedModelError(f"{source}: {e}") from None


def _chosen_max_len(hf: dict[str, Any], fields: dict[str, Any], max_len, source: str) -> int:
    longest = hf.get("max_position_embeddings")
    if fields.get("positional_encoding") != "rope" or not longest:
        raise UnsupportedModelError(f"{source}: max_len is chosen only for a RoPE model with a "
                                    f"max_position_embeddings; {hf.get('model_type')!r} runs "
                                    f"the length of its positions ({fields['max_len']})")
    if isinstance(max_len, bool) or not isinstance(max_len, int) or not 1 <= max_len <= longest:
        raise UnsupportedModelError(f"{source}: max_len={max_len!r} must be an int from 1 to "
                                    f"max_position_embeddings={longest}")
    return max_len


class _Reader:
    """Reads keys of a config.json and remembers which were read."""

    def __init__(self, values: dict[str, Any], source: str):
        self.values, self.source, self.read = values, source, set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        value = self.values.get(key)
        return default if value is None else value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.source} has no {key!r}")
        return value

    def expect(self, key: str, wanted: Any, default: Any, why: str) -> None:
        """Refuses the model unless `key` (or `default` when absent) is `wanted`."""
        value = self.get(key, default)
        if value != wanted:
            raise UnsupportedModelError(f"{self.source}: {key}={json.dumps(value)} is not "
                                        f"supported ({why})")

    def activation(self, key: str, default: str) -> str:
        name = self.get(key, default)
        if name not in _ACTIVATIONS:
            raise UnsupportedModelError(f"{self.source}: {key}={name!r} is not supported; "
                                        f"kvjax runs {sorted(_ACTIVATIONS)}")
        return _ACTIVATIONS[name]

    def refuse_unread(self) -> None:
        unknown = sorted(key for key, value in self.values.items()
                         if key not in self.read and key not in _INFERENCE_NEUTRAL
                         and value not in (None, False, 0, "", [], {}))
        if unknown:
            shown = ", ".join(f"{key}={json.dumps(self.values[key])}" for key in unknown)
            raise UnsupportedModelError(
                f"{self.source}: kvjax does not implement {shown}; it refuses a setting it "
                "would otherwise ignore")


def _gpt2(c: _Reader) -> dict[str, Any]:
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


def _rope(c: _Reader, phi3: bool = False) -> dict[str, Any]:
    """RoPE's base and scaling from `rope_parameters` (transformers 5) or the older
    `rope_theta` and `rope_scaling`. Phi-3's (`phi3`) may turn only the leading
    `partial_rotary_factor` of each head's dimensions, and its 'su' and 'yarn' are longrope."""
    params = {**(c.get("rope_scaling") or {}), **(c.get("rope_parameters") or {})}
    fraction = 1.0
    if phi3:
        if params.get("rope_type", params.get("type")) in ("su", "yarn"):
            params = {**params, "rope_type": "longrope"}
        fraction = float(params.pop("partial_rotary_factor", None)
                         or c.get("partial_rotary_factor", 1.0))
        c.get("partial_rotary_factor")  # where both give it, transformers reads the former
    if params.get("rope_type", params.get("type")) in ("llama3", "yarn", "longrope"):
        # As transformers reads it: a top-level original length (Phi-3 keeps one there)
        # wins over the one among the RoPE parameters.
        top = c.get("original_max_position_embeddings")
        params = params if top is None else {**params, "original_max_position_embeddings": top}
    fields = rope_fields(params, c.get("rope_theta", 10000.0), c.source,
                         c.get("max_position_embeddings"))
    _rotated_halves(c)
    if fraction != 1.0:
        head_dim = c.get("head_dim") or c.require("hidden_size") // c.require(
            "num_attention_heads")
        fields["rotary_dim"] = int(head_dim * fraction)
    return fields


def _rotated_halves(c: _Reader) -> None:
    """Refuses RoPE that turns the pairs (x[2i], x[2i+1]) instead of the halves."""
    c.expect("rope_interleaved", False, False, "kvjax rotates the halves (x[i], x[i + H/2])")


def _llama_like(c: _Reader, *, qkv_bias: bool, out_bias: bool, ffn_bias: bool,
                activation_key: str = "hidden_act", rope: dict[str, Any] | None = None):
    width, heads = c.require("hidden_size"), c.require("num_attention_heads")
    c.expect("is_encoder_decoder", False, False, "decoder-only model")
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
        activation=_gated(c.activation(activation_key, "silu"), c.source),
        qkv_bias=qkv_bias, out_bias=out_bias, ffn_bias=ffn_bias, scale_embeddings=False,
        **rope)


def _gated(activation: str, source: str) -> str:
    gated = {"silu": "swiglu", "gelu": "geglu"}
    if activation not in gated:
        raise UnsupportedModelError(f"{source}: a gated feed-forward network with "
                                    f"{activation} is not supported (SiLU: SwiGLU, tanh GELU: "
                                    "GeGLU)")
    return gated[activation]


def _llama(c: _Reader) -> dict[str, Any]:
    bias = bool(c.get("attention_bias", False))
    return _llama_like(c, qkv_bias=bias, out_bias=bias, ffn_bias=bool(c.get("mlp_bias", False)))


def _full_attention_layers(c: _Reader) -> None:
    """Refuses Qwen's per-layer sliding windows (`use_sliding_window` with `layer_types`):
    kvjax gives every layer the same attention."""
    c.expect("use_sliding_window", False, False, "sliding-window attention")
    c.get("sliding_window")  # read only when use_sliding_window is on
    layer_types = c.get("layer_types") or []
    sliding = [i for i, kind in enumerate(layer_types) if kind != "full_attention"]
    if sliding:
        raise UnsupportedModelError(f"{c.source}: layers {sliding} use "
                                    f"{layer_types[sliding[0]]!r}; kvjax runs full attention")


def _qwen2(c: _Reader) -> dict[str, Any]:
    _full_attention_layers(c)
    return _llama_like(c, qkv_bias=True, out_bias=False, ffn_bias=False)


def _qwen3(c: _Reader) -> dict[str, Any]:
    """Qwen2's architecture with RMSNorm over each head's query and key and, by default, no
    biases."""
    _full_attention_layers(c)
    bias = bool(c.get("attention_bias", False))
    return {**_llama_like(c, qkv_bias=bias, out_bias=bias, ffn_bias=False), "qk_norm": True}


def _smollm3(c: _Reader) -> dict[str, Any]:
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


def _granite(c: _Reader) -> dict[str, Any]:
    """Llama's architecture with four multipliers: on the embeddings, on each sublayer's
    output before the residual sum, as the attention scale (in place of 1/√head_dim; 1 where
    absent, as transformers takes it), and dividing the logits."""
    return {**_llama(c),
            "embedding_multiplier": float(c.get("embedding_multiplier", 1.0)),
            "residual_multiplier": float(c.get("residual_multiplier", 1.0)),
            "attention_scale": float(c.get("attention_multiplier", 1.0)),
            "logits_scaling": float(c.get("logits_scaling", 1.0))}


def _mistral(c: _Reader) -> dict[str, Any]:
    """Llama's architecture where every layer attends over the last `sliding_window`
    positions (null: all of them)."""
    return {**_llama_like(c, qkv_bias=False, out_bias=False, ffn_bias=False),
            "sliding_window": c.get("sliding_window")}


def _phi3(c: _Reader) -> dict[str, Any]:
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


def _gemma(c: _Reader, rope: dict[str, Any], default_pattern: int) -> dict[str, Any]:
    """What Gemma 2 and 3 share: Llama's layout with √D-scaled embeddings, (1 + w) RMSNorms
    around each sublayer as well as before it, GeGLU, 1/√query_pre_attn_scalar as the
    attention scale, optional soft caps, and sliding-window layers among global ones
    (`layer_types`, or every `sliding_window_pattern`-th layer global in older files)."""
    c.get("hidden_act")  # transformers' Gemma reads hidden_activation only
    c.expect("use_bidirectional_attention", False, False, "kvjax's Gemma is causal")
    bias = bool(c.get("attention_bias", False))
    fields = _llama_like(c, qkv_bias=bias, out_bias=bias, ffn_bias=False,
                         activation_key="hidden_activation", rope=rope)
    layers = fields["num_decoder_layers"]
    pattern = c.get("sliding_window_pattern", c.get("_sliding_window_pattern", default_pattern))
    layer_types = c.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(layers)]
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown or len(layer_types) != layers:
        raise UnsupportedModelError(f"{c.source}: layer_types={json.dumps(layer_types)} must "
                                    f"name 'full_attention' or 'sliding_attention' for each "
                                    f"of the {layers} layers")
    window = c.get("sliding_window")
    c.expect("sliding_window_size", window, window, "older files repeat sliding_window")
    full = tuple(i for i, kind in enumerate(layer_types) if kind == "full_attention")
    if window is None:
        if len(full) < layers:
            raise UnsupportedModelError(f"{c.source}: sliding_attention layers need a "
                                        "sliding_window")
        full = ()
    return {**fields, "scale_embeddings": True, "norm_unit_offset": True,
            "sandwich_norms": True, "sliding_window": window, "full_attention_layers": full,
            "attention_scale": float(c.require("query_pre_attn_scalar")) ** -0.5,
            "attention_softcap": c.get("attn_logit_softcapping"),
            "logits_softcap": c.get("final_logit_softcapping")}


def _gemma2(c: _Reader) -> dict[str, Any]:
    """Gemma 2: every other layer global, soft caps on attention and output logits."""
    return _gemma(c, _rope(c), default_pattern=2)


def _gemma3(c: _Reader) -> dict[str, Any]:
    """Gemma 3's text model: Gemma 2's layers with (1 + w) RMSNorm over each head's query
    and key, every sixth layer global by default, and RoPE of their own for the local
    layers (`rope_parameters` per layer type, or the older `rope_theta`, `rope_scaling` of
    the global layers and `rope_local_base_freq`)."""
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
    rope = rope_fields(full, c.get("rope_theta", 1000000.0), c.source, max_len)
    local_rope = rope_fields(local, c.get("rope_local_base_freq", 10000.0), c.source, max_len)
    if local_rope.get("rope_scaling", "none") != "none":
        raise UnsupportedModelError(f"{c.source}: scaled RoPE on sliding_attention layers is "
                                    "not supported")
    _rotated_halves(c)
    fields = {**_gemma(c, rope, default_pattern=6), "qk_norm": True}
    if fields["sliding_window"] is not None:
        fields["local_rope_base"] = local_rope["rope_base"]
    return fields


def _marian(c: _Reader) -> dict[str, Any]:
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
