"""Positional encodings: sinusoidal (the original paper), learned, and rotary (RoPE).

Every function takes explicit per-row positions `[B, T]`, because rows of a batch may be at
different positions (each row's prompt has its own length).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sinusoidal(positions_BT: jax.Array, d_model: int) -> jax.Array:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...). Returns [B, T, D] f32."""
    pairs = d_model // 2
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(pairs, dtype=jnp.float32) * 2.0 / d_model))
    angles = positions_BT.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    interleaved = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)
    pe = interleaved.reshape(*positions_BT.shape, 2 * pairs)
    if d_model % 2:  # an odd width gets one last sine column
        last = jnp.sin(positions_BT.astype(jnp.float32)[..., None] / 10000.0)
        pe = jnp.concatenate([pe, last], axis=-1)
    return pe


def apply_rope(x_BTNH: jax.Array, positions_BT: jax.Array, base: float) -> jax.Array:
    """Rotates each (x[i], x[i + H/2]) pair by the angle pos * base^(-2i/H).

    The dot product of a rotated query and a rotated key then depends only on their
    distance, so keys can be rotated once when they are written to the cache.
    """
    half = x_BTNH.shape[-1] // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / x_BTNH.shape[-1])
    angles = positions_BT.astype(jnp.float32)[..., None, None] * inv_freq  # [B, T, 1, H/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BTNH.dtype)
