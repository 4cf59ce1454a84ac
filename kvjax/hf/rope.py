"""A Hugging Face model's RoPE settings as `TransformerConfig` fields, read as transformers
reads them (`modeling_rope_utils`): plain, linear, Llama 3's, dynamic NTK, YaRN and LongRoPE,
and a refusal naming any other type or setting; where a `config.json` keeps them (the
families' keys for them, partial rotation, RoPE per layer type)."""

from __future__ import annotations

import json
import math
from typing import Any

from .errors import UnsupportedModelError
from .reader import Reader


def rope_fields(params: dict[str, Any], base: float, source: str,
                max_len: int | None) -> dict[str, Any]:
    """The config fields of one set of RoPE parameters (`base` where they name none), as
    transformers reads them (`modeling_rope_utils`); `max_len` is the model's
    max_position_embeddings."""
    base = params.get("rope_theta", base)
    kind = params.get("rope_type", params.get("type", "default"))
    fields: dict[str, Any] = {"positional_encoding": "rope", "rope_base": float(base)}
    known = {"rope_theta", "rope_type", "type"}
    if kind == "linear":
        fields.update(rope_scaling="linear", rope_scaling_factor=params["factor"])
        known |= {"factor"}
    elif kind == "llama3":
        fields.update(rope_scaling="llama3", rope_scaling_factor=params["factor"],
                      rope_low_freq_factor=params["low_freq_factor"],
                      rope_high_freq_factor=params["high_freq_factor"],
                      rope_original_max_len=params["original_max_position_embeddings"])
        known |= {"factor", "low_freq_factor", "high_freq_factor",
                  "original_max_position_embeddings"}
    elif kind == "yarn":
        fields.update(_yarn_fields(params, max_len, source))
        known |= {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                  "attention_factor", "mscale", "mscale_all_dim", "truncate"}
    elif kind == "dynamic":
        # Dynamic NTK turns as plain RoPE up to max_position_embeddings and raises the base
        # only past it, where kvjax's max_len (that length) never goes.
        known |= {"factor"}
    elif kind == "longrope":
        fields.update(_longrope_fields(params, max_len, source))
        known |= {"factor", "original_max_position_embeddings", "short_factor", "long_factor",
                  "attention_factor"}
    elif kind != "default":
        raise UnsupportedModelError(f"{source}: rope scaling of type {kind!r} is not "
                                    "supported; kvjax implements 'default', 'linear', "
                                    "'dynamic', 'llama3', 'yarn' and 'longrope'")
    extra = {k: v for k, v in params.items() if k not in known and v not in (None, 1.0)}
    if extra:
        raise UnsupportedModelError(f"{source}: rope settings {json.dumps(extra)} are not "
                                    f"supported for rope type {kind!r}")
    return fields


def _original_and_factor(params: dict[str, Any], max_len: int | None, source: str,
                         kind: str) -> tuple[int, float]:
    """A scaling's original length (max_position_embeddings where the file gives none) and
    its factor (max_position_embeddings over the original length where none is given), as
    transformers takes them."""
    original = params.get("original_max_position_embeddings") or max_len
    if original is None:
        raise UnsupportedModelError(f"{source}: {kind} rope scaling needs "
                                    "original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        if max_len is None:
            raise UnsupportedModelError(f"{source}: the rope scaling gives no factor and "
                                        "there is no max_position_embeddings to take it from")
        factor = max_len / original
    return int(original), float(factor)


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's attention factor for a RoPE stretched by `factor`: 0.1 · m · ln(factor) + 1,
    and 1 where it is not stretched (DeepSeek's `mscale` and `mscale_all_dim` are such m)."""
    return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0


def _yarn_fields(params: dict[str, Any], max_len: int | None, source: str) -> dict[str, Any]:
    """YaRN's settings: the original length defaults to max_position_embeddings and the
    factor to their ratio; the attention factor, when not given, is `yarn_mscale` with
    DeepSeek's `mscale` over the same with its `mscale_all_dim` (m = 1 without them)."""
    original, factor = _original_and_factor(params, max_len, source, "yarn")
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None and mscale and mscale_all_dim:
        attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return dict(rope_scaling="yarn", rope_scaling_factor=factor,
                rope_original_max_len=original,
                rope_beta_fast=float(params.get("beta_fast") or 32),
                rope_beta_slow=float(params.get("beta_slow") or 1),
                rope_truncate=bool(params.get("truncate", True)),
                rope_attention_factor=None if attention_factor is None else float(
                    attention_factor))


def _longrope_fields(params: dict[str, Any], max_len: int | None, source: str
                     ) -> dict[str, Any]:
    """LongRoPE's settings: each frequency divided by its short factor within the original
    length, by its long factor past it (`model/positional.py` says which a model turns with);
    the factor defaults to max_position_embeddings over the original length, and the
    attention factor, when not given, to sqrt(1 + ln(factor) / ln(original length))."""
    if not params.get("short_factor"):
        raise UnsupportedModelError(f"{source}: longrope rope scaling needs "
                                    "original_max_position_embeddings and short_factor")
    original, factor = _original_and_factor(params, max_len, source, "longrope")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) \
            if factor > 1 else 1.0
    return dict(rope_scaling="longrope", rope_scaling_factor=factor,
                rope_original_max_len=original,
                rope_short_factors=tuple(float(f) for f in params["short_factor"]),
                rope_long_factors=tuple(float(f) for f in params.get("long_factor") or ()),
                rope_attention_factor=float(attention_factor))


def rope_settings(c: Reader) -> dict[str, Any]:
    """RoPE's settings: transformers 5's `rope_parameters` over the older `rope_scaling`."""
    return {**(c.get("rope_scaling") or {}), **(c.get("rope_parameters") or {})}


def partial_rope(c: Reader, rope_params: dict[str, Any], fraction: float | None,
                  base: float, head_dim: int | None = None) -> dict[str, Any]:
    """RoPE's fields, turning the leading `fraction` of each head's `head_dim` dimensions
    (where `rope_params` names no `partial_rotary_factor`) at `base` (where it names no
    `rope_theta`). `fraction` None: every dimension turns, and a `partial_rotary_factor`
    among `rope_params` is refused as any setting `rope_fields` does not know."""
    params = dict(rope_params)
    if fraction is not None:
        given = params.pop("partial_rotary_factor", None)
        fraction = float(fraction if given is None else given)
    fields = rope_fields(params, base, c.source, c.get("max_position_embeddings"))
    rotated_halves(c)
    if fraction is None or int(head_dim * fraction) == head_dim:
        return fields
    return {**fields, "rotary_dim": int(head_dim * fraction)}


def rope_of(c: Reader, phi3: bool = False, params: dict[str, Any] | None = None,
            base: float = 10000.0) -> dict[str, Any]:
    """RoPE's base and scaling from `rope_parameters` (transformers 5) or the older
    `rope_theta` and `rope_scaling` (or from `params`, read from them by the caller), at
    `base` where neither names a `rope_theta`. Phi-3's (`phi3`) may turn only the leading
    `partial_rotary_factor` of each head's dimensions, and its 'su' and 'yarn' are longrope."""
    params = rope_settings(c) if params is None else params
    fraction = head_dim = None
    if phi3:
        if params.get("rope_type", params.get("type")) in ("su", "yarn"):
            params = {**params, "rope_type": "longrope"}
        # Where the RoPE parameters give one too, transformers reads theirs.
        fraction = c.get("partial_rotary_factor", 1.0)
        head_dim = c.get("head_dim") or c.require("hidden_size") // c.require(
            "num_attention_heads")
    if params.get("rope_type", params.get("type")) in ("llama3", "yarn", "longrope"):
        # As transformers reads it: a top-level original length (Phi-3 keeps one there)
        # wins over the one among the RoPE parameters.
        top = c.get("original_max_position_embeddings")
        params = params if top is None else {**params, "original_max_position_embeddings": top}
    return partial_rope(c, params, fraction, c.get("rope_theta", base), head_dim)


def rotated_halves(c: Reader) -> None:
    """Refuses RoPE that turns the pairs (x[2i], x[2i+1]) instead of the halves."""
    c.expect("rope_interleaved", False, False, "kvjax rotates the halves (x[i], x[i + H/2])")


def ropes_by_layer_type(c: Reader, default_base: float, local_base: float | None):
    """(RoPE fields of the full-attention layers, the RoPE base of the sliding-window ones,
    which turn unscaled): from `rope_parameters` per layer type (transformers 5), or the
    older `rope_theta` and `rope_scaling` of the full layers, the sliding ones turning with
    `local_base` (None: the same base)."""
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
    rope = rope_fields(full, c.get("rope_theta", default_base), c.source, max_len)
    local_rope = rope_fields(local, rope["rope_base"] if local_base is None else local_base,
                             c.source, max_len)
    if local_rope.get("rope_scaling", "none") != "none":
        raise UnsupportedModelError(f"{c.source}: scaled RoPE on sliding_attention layers is "
                                    "not supported")
    rotated_halves(c)
    return rope, local_rope["rope_base"]
