"""The `config.json` readers of the families of Llama's attention whose FFN has no gate,
W2 act(W1 x): StarCoder2 (tanh GELU), Nemotron, Arcee and Jais 2 (squared ReLU), Apertus
(xIELU).
`READERS` maps each model type to its reader."""

from __future__ import annotations

from typing import Any

from .llama_like import llama_like_fields
from .reader import Reader
from .rope import partial_rope, rope_settings


def _starcoder2(c: Reader) -> dict[str, Any]:
    """StarCoder2 (3B, 7B, 15B): Llama's attention with biases where `use_bias`, LayerNorm,
    an FFN of tanh GELU without a gate (`c_fc`, `c_proj`), every layer over the last
    `sliding_window` positions where it is set."""
    bias = bool(c.get("use_bias", True))
    return {**llama_like_fields(c, qkv_bias=bias, out_bias=bias, ffn_bias=bias, gated=False,
                                activation=c.activation("hidden_act", "gelu_pytorch_tanh")),
            "norm_type": "layernorm", "layer_norm_eps": c.get("norm_epsilon", 1e-5),
            "sliding_window": c.get("sliding_window")}


def _nemotron(c: Reader) -> dict[str, Any]:
    """Nemotron (Nemotron-Mini 4B, Minitron 4B and 8B, Mistral-NeMo-Minitron 8B): Llama's
    attention (biases where `attention_bias`), LayerNorm1P before each sublayer and at the
    end (a LayerNorm with a bias that scales by 1 + its weight, read as a LayerNorm of that
    scale), an FFN of squared ReLU without a gate (`up_proj`, `down_proj`; biases where
    `mlp_bias`), RoPE over the leading `partial_rotary_factor` of each head (a half where
    absent), an untied output layer."""
    width, heads = c.require("hidden_size"), c.require("num_attention_heads")
    rope = partial_rope(c, rope_settings(c), c.get("partial_rotary_factor", 0.5),
                        c.get("rope_theta", 10000.0), c.get("head_dim") or width // heads)
    bias = bool(c.get("attention_bias", False))
    return {**llama_like_fields(c, qkv_bias=bias, out_bias=bias,
                                ffn_bias=bool(c.get("mlp_bias", False)), gated=False,
                                activation=c.activation("hidden_act", "relu2"), rope=rope),
            "norm_type": "layernorm", "layer_norm_eps": c.get("norm_eps", 1e-5)}


def _arcee(c: Reader) -> dict[str, Any]:
    """Arcee (AFM-4.5B): Llama's layers with an FFN of squared ReLU without a gate
    (`up_proj`, `down_proj`; biases where `mlp_bias`)."""
    bias = bool(c.get("attention_bias", False))
    return llama_like_fields(c, qkv_bias=bias, out_bias=bias,
                             ffn_bias=bool(c.get("mlp_bias", False)), gated=False,
                             activation=c.activation("hidden_act", "relu2"))


def _jais2(c: Reader) -> dict[str, Any]:
    """Jais 2 (Inception, 8B and 70B): Llama's attention with LayerNorm before each sublayer
    and at the end, an FFN of squared ReLU without a gate (`up_proj`, `down_proj`), biases on
    every projection unless `attention_bias` or `mlp_bias` is false."""
    return {**llama_like_fields(c, qkv_bias=bool(c.get("attention_bias", True)),
                                out_bias=bool(c.get("attention_bias", True)),
                                ffn_bias=bool(c.get("mlp_bias", True)), gated=False,
                                activation=c.activation("hidden_act", "relu2")),
            "norm_type": "layernorm", "layer_norm_eps": c.get("layer_norm_eps", 1e-5)}


def _apertus(c: Reader) -> dict[str, Any]:
    """Apertus (Swiss AI, 8B and 70B): Llama's attention (biases where `attention_bias`)
    with RMSNorm over each head's query and key (as Qwen3), an FFN of xIELU without a gate
    (`up_proj`, `down_proj`; each layer's two coefficients learned), RoPE with Llama 3's
    scaling in the releases, an untied output layer."""
    bias = bool(c.get("attention_bias", False))
    return {**llama_like_fields(c, qkv_bias=bias, out_bias=bias, ffn_bias=False, gated=False,
                                activation=c.activation("hidden_act", "xielu")),
            "qk_norm": True}


READERS = {"starcoder2": _starcoder2, "nemotron": _nemotron, "arcee": _arcee, "jais2": _jais2,
           "apertus": _apertus}