"""The `config.json` reader of Phi-3.5-MoE (`phimoe`, Microsoft): Mixtral's mixture of
experts (16 of w1, w3 and w2, two a token) routed by SparseMixer (`model/experts.py`), with
Phi-3's attention (biases on q, k, v and the output where `attention_bias`), LayerNorms in
place of RMSNorms, an output layer with a bias (`lm_head_bias`) and LongRoPE, whose attention
factor the file gives as `short_mscale` and `long_mscale`. `READERS` maps the model type to
its reader."""

from __future__ import annotations

from typing import Any

from .errors import UnsupportedModelError
from .llama_like import experts_fields, llama_like_fields
from .reader import Reader
from .rope import rope_of, rope_settings


def _phimoe(c: Reader) -> dict[str, Any]:
    """Phi-3.5-MoE. SparseMixer routes with the router's jitter (`router_jitter_noise`) as its
    threshold at inference too, so that setting is read as the router's; the input jitter is
    training's alone, as transformers applies it. Within the original length LongRoPE turns
    with the short factors scaled by `short_mscale`; a longer context would turn with the long
    ones by `long_mscale`, so the two must agree."""
    params = dict(rope_settings(c))
    short, long = params.pop("short_mscale", None), params.pop("long_mscale", None)
    if params.get("rope_type", params.get("type")) in ("su", "longrope"):
        params["rope_type"] = "longrope"
        params.pop("type", None)
        if short != long:
            raise UnsupportedModelError(f"{c.source}: short_mscale={short} and long_mscale="
                                        f"{long} differ; kvjax turns one RoPE at every length")
        if short is not None:
            params["attention_factor"] = short
    elif (short, long) != (None, None):
        raise UnsupportedModelError(f"{c.source}: short_mscale and long_mscale belong to "
                                    "longrope rope scaling")
    rope = rope_of(c, params=params, base=1e6)  # transformers' Phi-3.5-MoE's base
    bias = bool(c.get("attention_bias", False))
    fields = llama_like_fields(c, qkv_bias=bias, out_bias=bias, ffn_bias=False, rope=rope)
    c.get("input_jitter_noise")  # training's alone
    return {**fields, **experts_fields(c, normalize=False), "norm_type": "layernorm",
            "logits_bias": bool(c.get("lm_head_bias", False)),
            "sliding_window": c.get("sliding_window"),
            "sparsemixer_eps": float(c.get("router_jitter_noise", 0.01))}


READERS = {"phimoe": _phimoe}
