"""The `config.json` readers of Cohere's models: Command R and Aya (`cohere`), Command R7B and
Command A (`cohere2`). Llama's projections and gated FFN in a parallel layer, x + Attn(norm(x))
+ FFN(norm(x)) through one LayerNorm without a bias, RoPE turning pairs of each head's
dimensions, a tied output layer whose logits are multiplied by `logit_scale`. `READERS` maps
each model type to its reader."""

from __future__ import annotations

from typing import Any

from .errors import UnsupportedModelError
from .llama_like import every_nth_full, llama_like_fields, sliding_layers
from .reader import Reader

COHERE2_WINDOW = 4096  # transformers' default where a file names no sliding_window


def _parallel_layers(c: Reader) -> dict[str, Any]:
    bias = bool(c.get("attention_bias", False))
    return {**llama_like_fields(c, qkv_bias=bias, out_bias=bias, ffn_bias=False),
            "norm_type": "layernorm", "layer_norm_eps": c.get("layer_norm_eps", 1e-5),
            "parallel_residual": True, "shared_norm": True,
            "logits_scaling": 1 / c.get("logit_scale", 0.0625)}


def _cohere(c: Reader) -> dict[str, Any]:
    """Command R, Aya 23 and Aya Expanse: every layer attends over every position with RoPE;
    a LayerNorm over each head's query and key (`use_qk_norm`, Command R+) is refused."""
    c.expect("use_qk_norm", False, False, "a LayerNorm over each head's query and key")
    return _parallel_layers(c)


def _cohere2(c: Reader) -> dict[str, Any]:
    """Command R7B and Command A: the layers `layer_types` names (or else three of every
    `sliding_window_pattern`, four by default) attend over a sliding window and turn with RoPE;
    the others attend over every position with no position encoding (NoPE). A file whose
    `sliding_window` is null is refused: transformers' Cohere 2 cannot run it either."""
    fields = _parallel_layers(c)
    layers = fields["num_decoder_layers"]
    if c.given("sliding_window", COHERE2_WINDOW) is None:
        raise UnsupportedModelError(f"{c.source}: sliding_window=null is not supported (Cohere "
                                    "2's local layers need a window)")
    types = every_nth_full(layers, c.get("sliding_window_pattern", 4), c.source)
    window, full = sliding_layers(c, types, window_default=COHERE2_WINDOW)
    return {**fields, "sliding_window": window, "full_attention_layers": full,
            "unrotated_layers": full}


READERS = {"cohere": _cohere, "cohere2": _cohere2}
