"""Each supported model type's `config.json` as `TransformerConfig` fields (`READERS`).

A reader takes the file through a `Reader`, which accounts for every key: what a family's
transformers implementation reads becomes a field, a key holding another value than the one
kvjax runs is refused by name. The families built on Llama's layer are read in
`llama_like.py` (and `llama_aliases.py`, those whose releases name keys in their own way),
those of them that norm each sublayer's output in `output_norms.py`, those without a gate in
their FFN in `plain_ffn.py`, those whose norms hold no parameters in `weightless_norms.py`,
Cohere's in `cohere.py`, Falcon's in `falcon.py`, BLOOM's in `bloom.py`, MPT's in `mpt.py`,
T5's in `t5.py`; here, GPT-2's descendants (GPTBigCode,
GPT-Neo, OPT, and GPT-J, GPT-NeoX and Phi with their parallel layers), Marian, M2M100,
BART and mBART.
"""

from __future__ import annotations

import json
from typing import Any

from .bloom import READERS as BLOOM
from .cohere import READERS as COHERE
from .deepseek_moe import READERS as DEEPSEEK_MOE
from .ernie_moe import READERS as ERNIE_MOE
from .errors import UnsupportedModelError
from .falcon import READERS as FALCON
from .granite import READERS as GRANITE
from .hunyuan import READERS as HUNYUAN
from .llama_aliases import READERS as LLAMA_ALIASES
from .llama_like import READERS as LLAMA_LIKE
from .ministral3 import READERS as MINISTRAL3
from .mpt import READERS as MPT
from .output_norms import READERS as OUTPUT_NORMS
from .phimoe import READERS as PHIMOE
from .plain_ffn import READERS as PLAIN_FFN
from .reader import Reader
from .rope import partial_rope, rope_settings
from .t5 import READERS as T5
from .weightless_norms import READERS as WEIGHTLESS_NORMS


def _gpt2(c: Reader) -> dict[str, Any]:
    """GPT-2: LayerNorm before each sublayer, learned positions, biases on every projection;
    attention scaled by 1/√head_dim unless `scale_attn_weights` is false (unscaled)."""
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
        scale_embeddings=False,
        attention_scale=None if c.get("scale_attn_weights", True) else 1.0)


def _gpt_bigcode(c: Reader) -> dict[str, Any]:
    """GPTBigCode (StarCoder and StarCoderBase, SantaCoder, Granite Code 20B and 34B): GPT-2's
    layer as torch Linears, with one key and value head for all query heads where
    `multi_query` (on unless false; else one per query head). Its softmax settings
    (`attention_softmax_in_fp32`, `scale_attention_softmax_in_fp32`) are precisions, which
    kvjax's float32 softmax meets."""
    c.get("attention_softmax_in_fp32")
    c.get("scale_attention_softmax_in_fp32")
    heads = c.require("n_head")
    multi_query = c.get("multi_query", True)
    if not isinstance(multi_query, bool):
        raise UnsupportedModelError(f"{c.source}: multi_query={multi_query!r} must be true or "
                                    "false")
    kv_heads = 1 if multi_query else heads
    c.expect("num_key_value_heads", kv_heads, kv_heads, "transformers repeats what multi_query "
             "says")
    return {**_gpt2(c), "activation": c.activation("activation_function", "gelu_pytorch_tanh"),
            "num_kv_heads": kv_heads}


def _gpt_neo(c: Reader) -> dict[str, Any]:
    """GPT-Neo (125M, 1.3B, 2.7B, and TinyStories' small models): GPT-2's layer with q, k
    and v projections of their own without biases, attention unscaled, and the layers
    `attention_types` calls local attending over the last `window_size` positions."""
    layers = c.require("num_layers")
    kinds = _attention_kinds(c.require("attention_types"), layers, c.source)
    c.expect("attention_layers", kinds, kinds, "transformers expands attention_types into it")
    width = c.require("hidden_size")
    full = tuple(i for i, kind in enumerate(kinds) if kind == "global")
    window = None if len(full) == layers else c.get("window_size", 256)
    return dict(
        vocab_size=c.require("vocab_size"), d_model=width, num_heads=c.require("num_heads"),
        d_ff=c.get("intermediate_size") or 4 * width, num_decoder_layers=layers,
        max_len=c.require("max_position_embeddings"), positional_encoding="learned",
        norm="pre", activation=c.activation("activation_function", "gelu_new"),
        layer_norm_eps=c.get("layer_norm_epsilon", 1e-5), qkv_bias=False, out_bias=True,
        scale_embeddings=False, attention_scale=1.0, sliding_window=window,
        full_attention_layers=full if window is not None else ())


def _gptj(c: Reader) -> dict[str, Any]:
    """GPT-J (6B) and its fine-tunes: GPT-2's sizes with the attention and the FFN side by
    side on one LayerNorm of the layer's input, x + Attn(norm(x)) + FFN(norm(x)); RoPE over
    the leading `rotary_dim` of each head turning pairs (x[2i], x[2i + 1]) (read as GLM's
    are, `weights.rope_halves_order`); no biases in the attention, a bias on the output
    layer."""
    width, heads = c.require("n_embd"), c.require("n_head")
    c.expect("is_encoder_decoder", False, False, "GPT-J is decoder-only")
    rotary, head_dim = c.get("rotary_dim"), width // heads
    if isinstance(rotary, bool) or not isinstance(rotary, int) or not (
            0 < rotary <= head_dim and rotary % 2 == 0):
        raise UnsupportedModelError(f"{c.source}: rotary_dim={rotary!r} must be an even number "
                                    f"of dimensions from 2 to the head's {head_dim}")
    return dict(
        vocab_size=c.require("vocab_size"), d_model=width, num_heads=heads,
        d_ff=c.get("n_inner") or 4 * width, num_decoder_layers=c.require("n_layer"),
        max_len=c.require("n_positions"), positional_encoding="rope", norm="pre",
        activation=c.activation("activation_function", "gelu_new"),
        layer_norm_eps=c.get("layer_norm_epsilon", 1e-5), qkv_bias=False, out_bias=False,
        scale_embeddings=False, parallel_residual=True, shared_norm=True, logits_bias=True,
        rotary_dim=None if rotary == head_dim else rotary)


def _attention_kinds(types, layers: int, source: str) -> list[str]:
    """GPT-Neo's `attention_types`, [[kinds, repeats], ...], as one kind per layer."""
    kinds: list[str] = []
    try:
        for pattern, repeats in types:
            kinds += list(pattern) * repeats
    except (TypeError, ValueError):
        kinds = []
    if len(kinds) != layers or not set(kinds) <= {"global", "local"}:
        raise UnsupportedModelError(f"{source}: attention_types={json.dumps(types)} must name "
                                    f"'global' or 'local' for each of the {layers} layers")
    return kinds


def _opt(c: Reader) -> dict[str, Any]:
    """OPT (125M to 66B): GPT-2's layer with ReLU, learned positions (the files' table
    starts two rows later, its first two unused) and biases where `enable_bias`. OPT-350m:
    post-LN layers with no norm after the last, and a token table narrower than the layers
    (`word_embed_proj_dim`), projected in and out."""
    width = c.require("hidden_size")
    c.expect("is_encoder_decoder", False, False, "OPT is decoder-only")
    pre_norm = c.get("do_layer_norm_before", True)
    if not isinstance(pre_norm, bool):
        raise UnsupportedModelError(f"{c.source}: do_layer_norm_before={pre_norm!r} must be "
                                    "true or false")
    embedding_width = c.get("word_embed_proj_dim", width)
    if isinstance(embedding_width, bool) or not isinstance(embedding_width, int) \
            or embedding_width < 1:
        raise UnsupportedModelError(f"{c.source}: word_embed_proj_dim={embedding_width!r} must "
                                    "be an int >= 1")
    if pre_norm:
        c.expect("_remove_final_layer_norm", False, False, "no norm after the last layer")
    else:  # post-LN layers end normalised: transformers adds no norm after the last
        c.get("_remove_final_layer_norm")
    c.expect("layer_norm_elementwise_affine", True, True, "LayerNorm without scale and bias")
    bias = bool(c.get("enable_bias", True))
    return dict(
        vocab_size=c.require("vocab_size"), d_model=width, num_heads=c.require(
            "num_attention_heads"), d_ff=c.require("ffn_dim"),
        num_decoder_layers=c.require("num_hidden_layers"),
        max_len=c.require("max_position_embeddings"), positional_encoding="learned",
        norm="pre" if pre_norm else "post",
        activation=c.activation("activation_function", "relu"),
        layer_norm_eps=1e-5, qkv_bias=bias, out_bias=bias, ffn_bias=bias,
        scale_embeddings=False, embedding_dim=None if embedding_width == width
        else embedding_width)


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
    return {**_parallel(c, rope_settings(c), c.get("partial_rotary_factor", 0.5),
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
        **partial_rope(c, rope_params, fraction, base, width // heads), **fields)


def _fairseq_encoder_decoder(c: Reader, family: str) -> dict[str, Any]:
    """What Marian, M2M100 and BART share: one width, heads and FFN for the encoder and the
    decoder, biases on every projection; static sinusoids and decoding from
    `decoder_start_token_id`, else the pad id, which BART's reader replaces by its own."""
    width = c.require("d_model")
    for encoder_key, decoder_key in (("encoder_attention_heads", "decoder_attention_heads"),
                                     ("encoder_ffn_dim", "decoder_ffn_dim")):
        c.expect(decoder_key, c.get(encoder_key), c.get(encoder_key),
                 f"kvjax's encoder and decoder share {encoder_key.split('_', 1)[1]}")
    c.expect("is_encoder_decoder", True, True, f"{family} is an encoder-decoder")
    return dict(
        d_model=width, num_heads=c.require("encoder_attention_heads"),
        d_ff=c.require("encoder_ffn_dim"), num_encoder_layers=c.require("encoder_layers"),
        num_decoder_layers=c.require("decoder_layers"),
        max_len=c.require("max_position_embeddings"), positional_encoding="sinusoidal",
        layer_norm_eps=1e-5, qkv_bias=True, out_bias=True,
        bos_id=c.get("decoder_start_token_id", c.get("pad_token_id")))


def _marian(c: Reader) -> dict[str, Any]:
    """Marian (OPUS-MT): LayerNorm after each sublayer, static sinusoids (every sine, then
    every cosine), a bias on the output logits."""
    c.expect("share_encoder_decoder_embeddings", True, True,
             "kvjax's encoder and decoder share one embedding table")
    vocab = c.require("vocab_size")
    c.expect("decoder_vocab_size", vocab, vocab, "one vocabulary for source and target")
    return dict(
        **_fairseq_encoder_decoder(c, "Marian"), vocab_size=vocab, sinusoid_layout="halves",
        norm="post", activation=c.activation("activation_function", "swish"),
        scale_embeddings=bool(c.get("scale_embedding", False)), logits_bias=True)


def _m2m_100(c: Reader) -> dict[str, Any]:
    """M2M100 and NLLB-200: LayerNorm before each sublayer and after each stack, fairseq's
    sinusoids (`sinusoid_layout="fairseq"`) numbered from the padding id + 1, of any
    length."""
    layers = c.require("encoder_layers")
    c.expect("num_hidden_layers", layers, layers, "transformers reads it as encoder_layers")
    return dict(
        **_fairseq_encoder_decoder(c, "M2M100"), vocab_size=c.require("vocab_size"),
        sinusoid_layout="fairseq", sinusoid_offset=c.get("pad_token_id", 1) + 1, norm="pre",
        activation=c.activation("activation_function", "relu"),
        scale_embeddings=bool(c.get("scale_embedding", True)))


def _bart(c: Reader, family: str = "BART", norm: str = "post") -> dict[str, Any]:
    """BART: LayerNorm after each sublayer (mBART: before, and after each stack), each
    stack's own learned positions (two rows of offset first, dropped as the table loads) and
    embedding LayerNorm, GELU, a bias on the logits; decoding from `decoder_start_token_id`,
    else `bos_token_id` (as transformers' generate)."""
    return {**_fairseq_encoder_decoder(c, family), "vocab_size": c.require("vocab_size"),
            "positional_encoding": "learned", "norm": norm, "embedding_norm": True,
            "per_stack_embeddings": True, "activation": c.activation("activation_function",
                                                                     "gelu"),
            "scale_embeddings": bool(c.get("scale_embedding", False)), "logits_bias": True,
            "bos_id": c.get("decoder_start_token_id", c.get("bos_token_id", 0))}


READERS = {"gpt2": _gpt2, "gpt_bigcode": _gpt_bigcode, "gpt_neo": _gpt_neo, "gptj": _gptj,
           "opt": _opt,
           "gpt_neox": _gpt_neox, "phi": _phi, **LLAMA_LIKE, **LLAMA_ALIASES, **OUTPUT_NORMS,
           **PLAIN_FFN, **WEIGHTLESS_NORMS, **COHERE, **MINISTRAL3, **HUNYUAN, **PHIMOE,
           **FALCON, **BLOOM, **MPT, **T5, **GRANITE, **ERNIE_MOE, **DEEPSEEK_MOE,
           "marian": _marian,
           "m2m_100": _m2m_100, "bart": _bart, "mbart": lambda c: _bart(c, "mBART", "pre")}
