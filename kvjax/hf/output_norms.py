"""The `config.json` readers of the families whose layers norm each sublayer's output rather
than its input, x + norm(f(x)), with Llama's projections, RoPE and gated FFN: OLMo 2, OLMo 3,
FlexOlmo and EXAONE 4.0. `READERS` maps each model type to its reader."""

from __future__ import annotations

from typing import Any

from .errors import UnsupportedModelError
from .llama_like import every_nth_full, experts_fields, llama_like_fields, sliding_layers
from .reader import Reader
from .rope import ropes_by_layer_type


def _olmo2(c: Reader, rope: dict[str, Any] | None = None) -> dict[str, Any]:
    """OLMo 2: Llama's layout with each sublayer's RMSNorm on its output, x + norm(f(x)),
    and one RMSNorm over all heads' queries (and one over the keys) before RoPE."""
    bias = bool(c.get("attention_bias", False))
    return {**llama_like_fields(c, qkv_bias=bias, out_bias=bias, ffn_bias=False, rope=rope),
            "norm": "output", "qk_norm": True, "qk_norm_across_heads": True,
            "layer_norm_eps": c.get("rms_norm_eps", 1e-5)}


def _flex_olmo(c: Reader) -> dict[str, Any]:
    """FlexOlmo: OLMo 2's layers with OLMoE's mixture of experts in every layer (the router's
    softmax weights divided by their sum only where `norm_topk_prob`)."""
    return {**_olmo2(c), **experts_fields(c, bool(c.get("norm_topk_prob", False)))}


def _olmo3(c: Reader) -> dict[str, Any]:
    """OLMo 3: OLMo 2's layers, three of every four attending over a sliding window (by
    default) and turning with unscaled RoPE where the full layers may scale theirs."""
    rope, local_base = ropes_by_layer_type(c, 500000.0, None)
    fields = _olmo2(c, rope)
    window, full = sliding_layers(c, every_nth_full(fields["num_decoder_layers"], 4, c.source),
                                  window_default=4096)
    fields.update(sliding_window=window, full_attention_layers=full)
    if window is not None and (local_base != rope["rope_base"]
                               or rope.get("rope_scaling", "none") != "none"):
        fields["local_rope_base"] = local_base
    return fields


EXAONE4_WINDOW = 4096  # transformers' default where a file names no sliding_window


def _exaone4(c: Reader) -> dict[str, Any]:
    """EXAONE 4.0 (1.2B, 32B): OLMo 2's norms on each sublayer's output, with an RMSNorm
    over each head's query and key (as Qwen3's) before RoPE. Where `sliding_window` is set
    (transformers' default where the key is absent; null turns it off), the layers that
    `layer_types` names local (or else the `sliding_window_pattern`: every n-th layer
    global, or a string of L and G repeated) attend over the window and turn with RoPE, the
    global ones attend over every position with no position encoding at all (NoPE)."""
    fields = {**llama_like_fields(c, qkv_bias=False, out_bias=False, ffn_bias=False),
              "norm": "output", "qk_norm": True, "layer_norm_eps": c.get("rms_norm_eps", 1e-5)}
    layers = fields["num_decoder_layers"]
    windowed = c.given("sliding_window", EXAONE4_WINDOW) is not None
    pattern = c.get("sliding_window_pattern", 4)
    if not windowed:  # transformers' default layer types would divide by 0
        default_types = ["full_attention"] * layers
    elif isinstance(pattern, str):
        if not pattern or set(pattern) - {"L", "G"}:
            raise UnsupportedModelError(f"{c.source}: sliding_window_pattern={pattern!r} must "
                                        "be a string of L (local) and G (global) layers")
        default_types = ["sliding_attention" if pattern[i % len(pattern)] == "L"
                         else "full_attention" for i in range(layers)]
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 1:
        default_types = every_nth_full(layers, pattern, c.source)
    else:
        raise UnsupportedModelError(f"{c.source}: sliding_window_pattern={pattern!r} must be "
                                    "an integer >= 1 or a string of L and G")
    window, full = sliding_layers(c, default_types, window_default=EXAONE4_WINDOW)
    return {**fields, "sliding_window": window, "full_attention_layers": full,
            "unrotated_layers": full}


READERS = {"olmo2": _olmo2, "olmo3": _olmo3, "flex_olmo": _flex_olmo, "exaone4": _exaone4}
