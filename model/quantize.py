"""The int8 KV cache's quantisation: symmetric, one float32 scale per (token, kv head).

A new token's K (or V) head `x` [H] is stored as `round(x / scale)` in int8 with
`scale = max|x| / 127`, so every stored value lies in [-127, 127] without clipping, and
`value * scale` is `x` to within `scale / 2` per element. One scale per token and head, not
per block of tokens: a decode step writes one token, so its scale is known the moment it
is written and no earlier slot is ever rescaled. The scale stays float32: a bfloat16 scale
would add a relative error of up to 2⁻⁹ to every element, as much again as the int8
rounding, to save 2 of the 2·H + 8 bytes a token's K and V take per head.

Attention never dequantises the cache as a whole. A product of queries with stored keys is
`(q · k_int8) × scale_k`, and one of weights with stored values is `(w × scale_v) · v_int8`
(`model/attention.py`): the scales are applied to the logits and the weights, block by block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .config_checks import CACHE_SCALE_DTYPE

INT8_MAX = 127


def quantize(x_BTKH: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(values [B, T, K, H] int8, scales [B, T, K] float32)` with `values * scales ≈ x`.

    A head of all zeros gets scale 0 and values 0 (dequantised exactly).
    """
    x = x_BTKH.astype(jnp.float32)
    scale_BTK = jnp.max(jnp.abs(x), axis=-1) / INT8_MAX
    safe_BTK1 = jnp.where(scale_BTK > 0, scale_BTK, 1.0)[..., None]
    values = jnp.round(x / safe_BTK1).astype(jnp.int8)
    return values, scale_BTK.astype(CACHE_SCALE_DTYPE)


def dequantize(values: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """`values [..., H] * scales [...]` in `dtype`: what a stored K or V stands for."""
    return (values.astype(jnp.float32) * scales[..., None]).astype(dtype)


def round_trip(x_BTKH: jax.Array) -> jax.Array:
    """`x` as the int8 cache holds it: quantised, then dequantised to x's dtype."""
    return dequantize(*quantize(x_BTKH), x_BTKH.dtype)
