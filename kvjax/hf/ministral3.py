"""The `config.json` reader of Ministral 3 (`ministral3`: 3B, 8B and 14B, the text model of
Mistral's December 2025 releases): Mistral's layers with YaRN, whose queries are scaled by
their position as Llama 4's attention temperature scales them. `READERS` maps the model type
to its reader."""

from __future__ import annotations

from typing import Any

from .errors import UnsupportedModelError
from .llama_like import llama_like_fields
from .reader import Reader
from .rope import partial_rope, rope_settings

# Keys of Ministral 3's `rope_parameters` that are not RoPE's: the queries' scale reads the
# first; transformers reads the second nowhere (it is the top level's, copied there).
QUERY_SCALE_BETA = "llama_4_scaling_beta"
UNREAD_ROPE_KEYS = ("max_position_embeddings",)


def _ministral3(c: Reader) -> dict[str, Any]:
    """Ministral 3: Llama's layers over every position (over the last `sliding_window`
    where the file sets one: transformers' Ministral 3 reads no `layer_types`), RoPE from
    `rope_parameters` (YaRN in the releases), and each query at position p multiplied, after
    RoPE, by 1 + llama_4_scaling_beta · ln(1 + floor(p / original_max_position_embeddings)),
    both from `rope_parameters`."""
    params = dict(rope_settings(c))
    beta = params.pop(QUERY_SCALE_BETA, None)
    length = params.get("original_max_position_embeddings")
    if beta is None or length is None:
        raise UnsupportedModelError(
            f"{c.source}: Ministral 3's rope_parameters need {QUERY_SCALE_BETA} and "
            "original_max_position_embeddings, which scale its queries (transformers cannot "
            "run the file without them)")
    for key in UNREAD_ROPE_KEYS:
        params.pop(key, None)
    rope = partial_rope(c, params, None, c.get("rope_theta", 10000.0))
    fields = llama_like_fields(c, qkv_bias=False, out_bias=False, ffn_bias=False, rope=rope)
    return {**fields, "sliding_window": c.given("sliding_window", None),
            "query_scale_beta": float(beta), "query_scale_length": int(length)}


READERS = {"ministral3": _ministral3}
