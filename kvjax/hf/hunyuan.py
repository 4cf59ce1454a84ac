"""The `config.json` readers of HunYuan's models (Tencent): the dense ones (`hunyuan_v1_dense`:
Hunyuan 0.5B, 1.8B, 4B and 7B), Llama's layers whose RMSNorms over each head's query and key
take them after RoPE has turned them, and whose RoPE base is stretched by a fixed NTK
`alpha`; the mixtures of experts (`hunyuan_v1_moe`: Hunyuan-A13B), the same attention with a
mixture and a shared FFN in every layer. `READERS` maps the model types to their readers."""

from __future__ import annotations

import json
from typing import Any

from .errors import UnsupportedModelError
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


def _hunyuan_moe(c: Reader) -> dict[str, Any]:
    """HunYuan MoE: HunYuan dense's attention, and in every layer `num_experts` experts of
    `intermediate_size` hidden units, `moe_topk` of them for each token (weights: the
    softmax's, renormalised over the chosen), beside a shared FFN of the same width that
    every token goes through, ungated. Either count may be a list with one entry per layer;
    kvjax runs one mixture in every layer, so such a list must repeat one value."""
    fields = _hunyuan_dense(c)
    layers = fields["num_decoder_layers"]
    c.get("output_router_logits")  # training's
    return {**fields, "num_experts": _every_layer(c, "num_experts", layers),
            "experts_per_token": _every_layer(c, "moe_topk", layers),
            "normalize_expert_weights": True, "shared_expert_d_ff": fields["d_ff"]}


def _every_layer(c: Reader, key: str, layers: int) -> int:
    """A count that HunYuan MoE's files give once or once per layer (transformers' default
    1), as the one value of every layer."""
    value = c.get(key, 1)
    if isinstance(value, list):
        if len(value) != layers or len(set(value)) != 1:
            raise UnsupportedModelError(f"{c.source}: {key}={json.dumps(value)} must give "
                                        f"one value for all {layers} layers (kvjax runs the "
                                        "same mixture in every layer)")
        value = value[0]
    if not isinstance(value, int) or value < 1:
        raise UnsupportedModelError(f"{c.source}: {key}={json.dumps(value)} must be a "
                                    "count >= 1")
    return value


READERS = {"hunyuan_v1_dense": _hunyuan_dense, "hunyuan_v1_moe": _hunyuan_moe}
