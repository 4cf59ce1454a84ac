"""Positional encodings: sinusoidal (the original paper), learned, rotary (RoPE), and biases
on the attention logits by the distance from query to key (`PositionBias`: ALiBi's slopes,
T5's learned buckets).

Every function takes explicit per-row positions `[B, T]`, because rows of a batch may be at
different positions (each row's prompt has its own length).
"""

from __future__ import annotations

import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from .config import TransformerConfig
from .config_checks import longrope_factors_field


@flax.struct.dataclass
class PositionBias:
    """A bias added to each head's attention logits by the distance d = key position - query
    position (d <= 0 for the keys a causal query sees): ALiBi's `slopes` [N], m_h · d (BLOOM,
    MPT), or T5's learned `table` [buckets, N], the row of d's bucket (`relative_position_buckets`,
    `bidirectional` in an encoder). `positions` [B, T] are the queries'."""

    positions_BT: jax.Array
    slopes_N: jax.Array | None = None
    table: jax.Array | None = None
    num_buckets: int = flax.struct.field(pytree_node=False, default=32)
    max_distance: int = flax.struct.field(pytree_node=False, default=128)
    bidirectional: bool = flax.struct.field(pytree_node=False, default=False)

    def logits_BKGTS(self, kv_heads: int, key_positions) -> jax.Array:
        """The bias [B, K, G, T, S] in float32 for keys at `key_positions` ([S] slots of a
        cache, slot s holding position s, or [B, S])."""
        distance_BTS = (jnp.asarray(key_positions)[..., None, :] - self.positions_BT[..., None])
        if self.slopes_N is not None:
            per_head_BTSN = (distance_BTS.astype(jnp.float32)[..., None]
                             * self.slopes_N.astype(jnp.float32))
        else:
            per_head_BTSN = jnp.take(self.table.astype(jnp.float32), relative_position_buckets(
                distance_BTS, self.bidirectional, self.num_buckets, self.max_distance), axis=0)
        batch, queries, keys, heads = per_head_BTSN.shape
        return jnp.moveaxis(per_head_BTSN, -1, 1).reshape(batch, kv_heads, heads // kv_heads,
                                                         queries, keys)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi's slope of each head [N] (Press et al.; BLOOM's): with c the largest power of two
    <= N, 2^(-8i/c) for i = 1..c, then for the N - c heads left 2^(-4i/c) for i = 1, 3, 5...
    (every other slope of 2c heads)."""
    closest = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = 2.0 ** (-8.0 / closest * np.arange(1, closest + 1))
    extra = 2.0 ** (-4.0 / closest * np.arange(1, 2 * (num_heads - closest), 2))
    return np.concatenate([slopes, extra]).astype(np.float32)


def relative_position_buckets(distance: jax.Array, bidirectional: bool, num_buckets: int,
                              max_distance: int) -> jax.Array:
    """T5's bucket of each distance (key - query position), int32 of `distance`'s shape.
    Bidirectional (an encoder), half the buckets are for keys after the query; causal, only
    keys at or before it count. Of a direction's buckets, the first half hold the distances
    0, 1, ... one each, the rest distances growing logarithmically up to `max_distance`
    (farther ones share the last). In float32, as transformers computes it."""
    buckets = jnp.zeros_like(distance, jnp.int32)
    if bidirectional:
        num_buckets //= 2
        buckets = (distance > 0).astype(jnp.int32) * num_buckets
        distance = jnp.abs(distance)
    else:
        distance = -jnp.minimum(distance, 0)
    max_exact = num_buckets // 2
    ratio = jnp.log(distance.astype(jnp.float32) / max_exact) / math.log(
        max_distance / max_exact) * (num_buckets - max_exact)
    large = jnp.minimum(max_exact + jnp.where(distance < max_exact, 0, ratio).astype(jnp.int32),
                        num_buckets - 1)
    return buckets + jnp.where(distance < max_exact, distance, large).astype(jnp.int32)


def sinusoidal(positions_BT: jax.Array, d_model: int, layout: str = "interleaved") -> jax.Array:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...). Returns [B, T, D] f32.

    `layout="halves"` writes the same values as every sine column, then every cosine column
    (Marian's layout). An odd width gets one sine more than cosines. `layout="fairseq"`
    (M2M100, NLLB): every sine, then every cosine, of the D/2 frequencies
    10000^(-i / (D/2 - 1)), an odd width's last column zero.
    """
    positions = positions_BT.astype(jnp.float32)[..., None]
    if layout == "fairseq":
        half = d_model // 2
        # float32 throughout, as fairseq and transformers compute it
        step = np.float32(-np.log(10000.0) / (half - 1))
        inv_freq = np.exp(np.arange(half, dtype=np.float32) * step)
        angles = positions * jnp.asarray(inv_freq, jnp.float32)  # [B, T, D/2]
        odd = [jnp.zeros_like(angles[..., :1])] if d_model % 2 else []
        return jnp.concatenate([jnp.sin(angles), jnp.cos(angles), *odd], axis=-1)
    if layout == "halves":
        sines, cosines = (d_model + 1) // 2, d_model // 2
        inv_freq = 1.0 / (10000.0 ** (np.arange(sines, dtype=np.float64) * 2.0 / d_model))
        angles = positions * jnp.asarray(inv_freq, jnp.float32)  # [B, T, ceil(D/2)]
        return jnp.concatenate([jnp.sin(angles), jnp.cos(angles[..., :cosines])], axis=-1)
    pairs = d_model // 2
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(pairs, dtype=jnp.float32) * 2.0 / d_model))
    angles = positions * inv_freq  # [B, T, D/2]
    interleaved = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)
    pe = interleaved.reshape(*positions_BT.shape, 2 * pairs)
    if d_model % 2:  # an odd width gets one last sine column
        pe = jnp.concatenate([pe, jnp.sin(positions / 10000.0)], axis=-1)
    return pe


def layer_rope(config: TransformerConfig, local) -> tuple[jax.Array | np.ndarray, Any]:
    """The inverse frequencies and attention factor (`apply_rope`'s) of a layer that attends
    over a sliding window (`local`) or not: the config's (`rope_frequencies`,
    `rope_attention_factor`), or with a `local_rope_base` the local layers' own, unscaled.
    `local` is a bool, or traced for scanned layers (then a select between the two)."""
    if config.local_rope_base is None:
        return rope_frequencies(config), rope_attention_factor(config)
    own = config.replace(rope_base=config.local_rope_base, rope_scaling="none")
    if isinstance(local, bool):
        chosen = own if local else config
        return rope_frequencies(chosen), rope_attention_factor(chosen)
    inv_freq = jnp.where(local, rope_frequencies(own).astype(np.float32),
                         rope_frequencies(config).astype(np.float32))
    factor = rope_attention_factor(config)
    return inv_freq, (factor if factor == 1.0 else jnp.where(local, 1.0, factor))


def rope_frequencies(config: TransformerConfig) -> np.ndarray:
    """RoPE's inverse frequencies [r/2] (float64) for the r = `config.rotary_dims` leading
    dimensions of each head it turns: base^(-2i/r), stretched as `config.rope_scaling` says.

    llama3: wavelengths (2π / frequency) longer than original_len / low_freq_factor are
    divided by the factor, those shorter than original_len / high_freq_factor are kept, and
    the ones between are blended linearly in original_len / wavelength.

    yarn: dimension pair i turns original_len / wavelength times over the original length,
    fewer as i grows; the pairs up to the one that turns `rope_beta_fast` times are kept,
    those from the one that turns `rope_beta_slow` times on are divided by the factor, and
    the ones between are blended linearly in i.

    longrope: pair i's frequency is divided by its factor: `rope_short_factors[i]` when the
    model's max_len is within the original length, else `rope_long_factors[i]`, at every
    position (as vLLM and llama.cpp decide by the context a model is set up for; transformers
    switches to the long factors once a sequence passes the original length, and then turns
    the whole sequence with them again).
    """
    dims = config.rotary_dims
    inv_freq = 1.0 / config.rope_base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    factor = config.rope_scaling_factor
    if config.rope_scaling == "linear":
        return inv_freq / factor
    if config.rope_scaling == "llama3":
        original = float(config.rope_original_max_len)
        low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
        wavelength = 2 * math.pi / inv_freq
        smooth = np.clip((original / wavelength - low) / (high - low), 0.0, 1.0)
        return (1 - smooth) * inv_freq / factor + smooth * inv_freq
    if config.rope_scaling == "yarn":
        kept = 1 - _yarn_ramp(config)
        return (1 - kept) * inv_freq / factor + kept * inv_freq
    if config.rope_scaling == "longrope":
        factors = getattr(config, longrope_factors_field(config))
        return inv_freq / np.asarray(factors, np.float64)
    return inv_freq


def _yarn_ramp(config: TransformerConfig) -> np.ndarray:
    """[r/2]: 0 for the dimension pairs YaRN keeps, 1 for those it divides by the factor."""
    dims, base = config.rotary_dims, config.rope_base
    original = float(config.rope_original_max_len)

    def pair_turning(rotations: float) -> float:  # the pair that turns `rotations` times
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(config.rope_beta_fast), pair_turning(config.rope_beta_slow)
    if config.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # as the reference implementation does, for a ramp of one step
    return np.clip((np.arange(dims // 2, dtype=np.float64) - low) / (high - low), 0, 1)


def rope_attention_factor(config: TransformerConfig) -> float:
    """What the turned queries and keys are multiplied by, for YaRN and longrope: their
    `rope_attention_factor`, by default 0.1 · ln(factor) + 1 (YaRN) or
    sqrt(1 + ln(factor) / ln(original length)) (longrope), which keep the attention's entropy
    as the context stretches; 1 for every other RoPE."""
    if config.rope_scaling not in ("yarn", "longrope"):
        return 1.0
    if config.rope_attention_factor is not None:
        return float(config.rope_attention_factor)
    factor = config.rope_scaling_factor
    if factor <= 1:
        return 1.0
    if config.rope_scaling == "yarn":
        return 0.1 * math.log(factor) + 1.0
    return math.sqrt(1 + math.log(factor) / math.log(config.rope_original_max_len))


def apply_rope(x_BTNH: jax.Array, positions_BT: jax.Array, inv_freq: np.ndarray,
               attention_factor: Any = 1.0) -> jax.Array:
    """Rotates each (x[i], x[i + r/2]) pair of the r = 2 · len(inv_freq) leading dimensions
    by the angle pos * inv_freq[i] (`rope_frequencies`) and multiplies them by
    `attention_factor` (`rope_attention_factor`); the dimensions past r pass through.

    The dot product of a rotated query and a rotated key then depends only on their
    distance, so keys can be rotated once when they are written to the cache.
    """
    inv_freq = jnp.asarray(inv_freq, jnp.float32)
    turned = 2 * inv_freq.shape[-1]
    if turned < x_BTNH.shape[-1]:
        return jnp.concatenate([apply_rope(x_BTNH[..., :turned], positions_BT, inv_freq,
                                           attention_factor), x_BTNH[..., turned:]], axis=-1)
    angles = positions_BT.astype(jnp.float32)[..., None, None] * inv_freq  # [B, T, 1, r/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if not (isinstance(attention_factor, float) and attention_factor == 1.0):
        cos, sin = cos * attention_factor, sin * attention_factor
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BTNH.dtype)
