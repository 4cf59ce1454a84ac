"""The `config.json` reader of HunYuan's dense models (`hunyuan_v1_dense`: Hunyuan 0.5B,
1.8B, 4B and 7B, Tencent): Llama's layers whose RMSNorms over each head's query and key take
them after RoPE has turned them, and whose RoPE base is stretched by a fixed NTK `alpha`.
`READERS` maps the model type to its reader."""

from __future__ import annotations

from typing import Any

from .llama_like import llama_like_fields
from .reader import Reader
from .rope import partial_rope, rope_settings

# Keys a HunYuan file's "dynamic" RoPE with an `alpha` holds that transformers' HunYuan reads
# nowhere: with a fixed alpha it turns at one stretched base, whatever the length.
UNREAD_WITH_ALPHA = ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def _hunyuan_dense(c: Reader) -> dict[str, Any]:
    """HunYuan dense: Llama's layers (biases where `attention_bias`), RMSNorm over each
    head's query and key after RoPE, and RoPE with `rope_type` "dynamic" and an `alpha`
    turning at the base theta · alpha^(H / (H - 2)) at every position (transformers'
    "ntk_alpha"); without an alpha, RoPE as Llama's."""
    params = dict(rope_settings(c))
    alpha = params.pop("alpha", None)
    width, heads = c.require("hidden_size"), c.require("num_attention_heads")
    head_dim = c.get("head_dim") or width // heads
    base = params.get("rope_theta", c.get("rope_theta", 10000.0))
    if alpha is not None and params.get("rope_type", params.get("type")) == "dynamic":
        for key in UNREAD_WITH_ALPHA:
            params.pop(key, None)
        params = {**params, "rope_type": "default",
                  "rope_theta": base * float(alpha) ** (head_dim / (head_dim - 2))}
        params.pop("type", None)
    elif alpha is not None:
        params["alpha"] = alpha  # refused below, as transformers reads it only so
    rope = partial_rope(c, params, None, base)
    c.get("eod_token_id")  # a token id of its tokenizer's, which generation_config names
    bias = bool(c.get("attention_bias", False))
    fields = llama_like_fields(c, qkv_bias=bias, out_bias=bias,
                               ffn_bias=bool(c.get("mlp_bias", False)), rope=rope)
    return {**fields, "qk_norm": True, "qk_norm_after_rope": True}


READERS = {"hunyuan_v1_dense": _hunyuan_dense}
