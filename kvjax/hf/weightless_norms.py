"""The `config.json` readers of the families whose norms hold no learned parameters
(`norm_params` off): OLMo's first releases (LayerNorm) and nanochat (RMSNorm). `READERS`
maps each model type to its reader."""

from __future__ import annotations

from typing import Any

from .llama_like import llama_like_fields
from .reader import Reader


def _olmo(c: Reader) -> dict[str, Any]:
    """OLMo (1B, 7B, 1.7-7B: OLMo 2's forerunners): Llama's layout with LayerNorms without
    scale or bias, their epsilon 1e-5 (transformers' OLMo fixes it; the file has no key for
    it), biases where `attention_bias`, and the queries, keys and values clipped to
    ±`clip_qkv` as they leave their projections where it is set (OLMo 1.7)."""
    bias = bool(c.get("attention_bias", False))
    return {**llama_like_fields(c, qkv_bias=bias, out_bias=bias, ffn_bias=False),
            "norm_type": "layernorm", "norm_params": False, "layer_norm_eps": 1e-5,
            "qkv_clip": c.get("clip_qkv")}


def _nanochat(c: Reader) -> dict[str, Any]:
    """nanochat (Karpathy's d20 and d32, as transformers converts them): Llama's attention
    (biases where `attention_bias`) with RoPE turning each pair the other way, which kvjax
    turns as its own with each head's halves swapped as they load
    (`weights.swapped_halves_order`), then RMSNorm over each head's query and key; an FFN of
    squared ReLU without a gate (`fc1`, `fc2`); every norm without a learned scale, one over
    the embeddings before the first layer too; the output logits soft-capped by
    `final_logit_softcapping` (15 where absent, as transformers fills it in)."""
    bias = bool(c.get("attention_bias", False))
    return {**llama_like_fields(c, qkv_bias=bias, out_bias=bias, ffn_bias=False, gated=False,
                                activation=c.activation("hidden_act", "relu2")),
            "qk_norm": True, "qk_norm_after_rope": True, "norm_params": False,
            "embedding_norm": True,
            "logits_softcap": c.given("final_logit_softcapping", 15.0)}


READERS = {"olmo": _olmo, "nanochat": _nanochat}
