"""How many bytes a KV cache takes: `2 × length × layers × kv_heads × head_dim × bytes` per
sequence, and that formula written out with a config's numbers.

Only K and V are cached: a past token's query is never needed again, since each new token's
query attends to the keys and values of the tokens before it.

A model with multi-head latent attention (DeepSeek-V2/V3) caches less: each token's latent
and the key part its heads share, `length × layers × (latent_kv_rank + rotary_dim) × bytes`,
from which every head's key and value follow (`model/latent_attention.py`).

A layer over a sliding window need hold only what its window reads: `generate` keeps such
layers' K/V in rings of the window's slots (`model/ring.py`), so a long row costs its
full length only in the layers that attend over everything (`generate_cache_bytes`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .config import TransformerConfig
from .config_checks import CACHE_SCALE_DTYPE
from .ring import paged_ring_slots, ring_layers, ring_slots


@dataclasses.dataclass(frozen=True)
class CacheSize:
    """Bytes of a KV cache. `self_attention` is the formula
    `2 × length × layers × kv_heads × (head_dim × bytes + scale bytes) × batch`, where an
    int8 cache adds a float32 scale per (token, kv head) and a float one adds nothing;
    `cross_attention` is the encoder-decoder's cache of projected encoder K/V (0 for a
    decoder-only model). With latent attention `self_attention` is
    `length × layers × (latent_kv_rank + rotary_dim) × bytes (+ scale bytes) × batch`."""

    self_attention: int
    cross_attention: int

    @property
    def total(self) -> int:
        return self.self_attention + self.cross_attention


def _cache_dtype(config: TransformerConfig, dtype: Any) -> np.dtype:
    """`dtype` (a name or dtype), else the config's cache dtype."""
    return np.dtype(dtype if dtype is not None else config.kv_cache_dtype)


def scale_bytes(dtype: Any) -> int:
    """Bytes of the scale held with each (token, kv head) of a cache of `dtype`."""
    return CACHE_SCALE_DTYPE.itemsize if np.dtype(dtype) == np.int8 else 0


def cache_size_bytes(
    config: TransformerConfig,
    batch: int,
    length: int,
    dtype: Any = None,
    source_length: int | None = None,
) -> CacheSize:
    """K and V (the 2) for every layer, kv head and position of every sequence.

    `dtype` defaults to the config's `kv_cache_dtype`. `source_length` sizes the
    cross-attention cache of an encoder-decoder (defaults to `length`). Only K and V are
    cached: the query of a past token is never needed again.
    """
    dtype = _cache_dtype(config, dtype)
    per_head = config.cached_head_dim * dtype.itemsize + scale_bytes(dtype)
    self_bytes = sum(config.cached_heads) * per_head * batch * length * config.num_decoder_layers
    cross_bytes = 0
    if config.is_encoder_decoder:
        src = length if source_length is None else source_length
        cross_head = config.head_dim * dtype.itemsize + scale_bytes(dtype)
        cross_bytes = 2 * config.kv_heads * cross_head * batch * src * config.num_decoder_layers
    return CacheSize(self_bytes, cross_bytes)


def generate_cache_bytes(config: TransformerConfig, batch: int, length: int, dtype: Any = None,
                         step_tokens: int = 1) -> int:
    """Bytes of the self-attention cache `generate` makes for `batch` rows of `length`
    positions whose decode calls write `step_tokens` tokens each (1; a speculative step's
    draft and one): `cache_size_bytes`' formula with a ring of window + step_tokens - 1
    slots, not `length`, in each layer that keeps one (`model/ring.py`)."""
    one_layer = cache_size_bytes(config, batch, 1, dtype).self_attention // (
        config.num_decoder_layers)  # a position of one layer
    ring = ring_slots(config, length, step_tokens)
    in_rings = 0 if ring is None else ring_layers(config)
    return one_layer * (in_rings * (ring or 0) + (config.num_decoder_layers - in_rings) * length)


def paged_cache_bytes(config: TransformerConfig, capacity: int, dtype: Any = None,
                      step_tokens: int = 1) -> tuple[int, int]:
    """(bytes of one slot of a page, bytes of one row's rings) of the paged cache
    `init_paged_cache(..., step_tokens=step_tokens)` makes for rows of `capacity` positions:
    where a model mixes windowed layers with global ones, a page holds the global layers and
    each row a ring per windowed layer (`model/ring.py`)."""
    layers = config.num_decoder_layers
    one_layer = cache_size_bytes(config, 1, 1, dtype).self_attention // layers
    ring = paged_ring_slots(config, capacity, step_tokens)
    in_rings = 0 if ring is None else ring_layers(config)
    return one_layer * (layers - in_rings), one_layer * in_rings * (ring or 0)


def format_bytes(num_bytes: int) -> str:
    """Bytes in binary units: 536870912 -> '512 MiB', 1536 -> '1.5 KiB'."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.4g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def describe_cache_size(config: TransformerConfig, batch: int, length: int, dtype: Any = None,
                        source_length: int | None = None) -> str:
    """The cache-size formula written out with this config's numbers, per sequence and total."""
    dtype = _cache_dtype(config, dtype)
    per_sequence = cache_size_bytes(config, 1, length, dtype, source_length)
    total = cache_size_bytes(config, batch, length, dtype, source_length)
    scale = scale_bytes(dtype)
    width = config.cached_head_dim
    per_head = (f"({width} x {dtype.itemsize} + {scale})" if scale
                else f"{width} x {dtype.itemsize}")
    bytes_named = (f"{dtype.name} ({dtype.itemsize} bytes"
                   + (f", and a {CACHE_SCALE_DTYPE.name} scale per token and kv head)"
                      if scale else ")"))
    layers = config.num_decoder_layers
    if config.latent_kv_rank:
        shape = f"a latent of {config.latent_kv_rank} + {config.rotary_dims} shared key dims"
        factors = f"{length} x {layers}"
    else:
        shape = f"{config.kv_heads} kv heads x {width} head dim"
        factors = f"2 (K and V) x {length} x {layers} x {config.kv_heads}"
    lines = [
        f"KV cache: {layers} layers x {shape}, {length} tokens, {bytes_named}",
        f"  {factors} x {per_head} = {per_sequence.self_attention:,} bytes "
        f"= {format_bytes(per_sequence.self_attention)} per sequence",
    ]
    if config.is_encoder_decoder:
        src = length if source_length is None else source_length
        lines.append(f"  cross-attention K/V of {src} source tokens: "
                     f"{format_bytes(per_sequence.cross_attention)} per sequence")
    lines.append(f"  batch {batch}: {format_bytes(total.total)} ({total.total:,} bytes)")
    rings = generate_cache_bytes(config, batch, length, dtype)
    if rings < total.self_attention:
        window = config.sliding_window
        lines.append(f"  {ring_layers(config)} of {layers} layers over a window of {window}: "
                     f"generate and the engine's slots keep rings of {window} positions "
                     f"there, {format_bytes(rings)} for the batch")
    reach = config.attention_reach
    if reach is not None and reach < length:
        window = cache_size_bytes(config, batch, reach, dtype, source_length).self_attention
        lines.append(f"  every layer over a window of {reach}: a paged cache (the engine's) "
                     f"holds only those positions, {format_bytes(window)} for the batch "
                     "(and up to a page more a sequence)")
    return "\n".join(lines)
