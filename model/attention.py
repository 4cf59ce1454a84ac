"""Scaled dot-product multi-head attention: softmax(QKᵀ/√d_k + mask)V.

Shape letters: B batch, T queries, S keys, N query heads, K kv heads, H head dim, D model dim.
With grouped-query attention (K < N) each group of N/K query heads shares one K/V head, so
the cache holds K heads, not N.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.cache import write_rows
from model.config import TransformerConfig
from model.positional import apply_rope


def attend(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
           mask_BTS: jax.Array) -> jax.Array:
    """softmax(QKᵀ/√H + mask)V with a boolean mask (True = may attend). Returns [B, T, N, H].

    Masked keys get exactly zero weight; the softmax runs in float32 for every input dtype.
    A query row with no key to attend to (all masked) returns zeros rather than NaN or a
    uniform average. `jax.nn.dot_product_attention` picks a fused kernel where one exists.
    """
    out = jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=mask_BTS[:, None])
    has_key_BT = jnp.any(mask_BTS, axis=-1)
    return jnp.where(has_key_BT[:, :, None, None], out, 0).astype(q_BTNH.dtype)


def _projection(config: TransformerConfig, heads: int, name: str) -> nn.DenseGeneral:
    return nn.DenseGeneral(
        features=(heads, config.head_dim), use_bias=False, dtype=config.compute_dtype,
        param_dtype=config.weights_dtype, name=name,
    )


def _output_projection(config: TransformerConfig) -> nn.DenseGeneral:
    return nn.DenseGeneral(
        features=config.d_model, axis=(-2, -1), use_bias=False, dtype=config.compute_dtype,
        param_dtype=config.weights_dtype, name="out",
    )


class SelfAttention(nn.Module):
    """Masked self-attention that reads and writes one layer's K/V cache.

    `cache_kv` is `(k, v)` of shape [B, S, K, H] or None. With a cache, the new K/V are
    written at each row's `starts` slot and the queries attend over all S cached slots;
    without one, they attend over the T new tokens only.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BTD, positions_BT, mask_BTS, cache_kv=None, starts_B=None,
                 fits_B=None):
        config = self.config
        q = _projection(config, config.num_heads, "query")(x_BTD)
        k = _projection(config, config.kv_heads, "key")(x_BTD)
        v = _projection(config, config.kv_heads, "value")(x_BTD)
        if config.positional_encoding == "rope":
            q = apply_rope(q, positions_BT, config.rope_base)
            k = apply_rope(k, positions_BT, config.rope_base)
        if cache_kv is not None:
            k = write_rows(cache_kv[0], k, starts_B, fits_B)
            v = write_rows(cache_kv[1], v, starts_B, fits_B)
            cache_kv = (k, v)
        out = attend(q, k, v, mask_BTS)
        return _output_projection(config)(out), cache_kv


class CrossKV(nn.Module):
    """Projects the encoder output to one decoder layer's cross-attention K and V, [B, S, K, H].

    Run once per source, then held in the cache: decoding steps never re-project it.
    Shaped for `nn.scan` over layers: the encoder output is the (unchanged) carry.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, encoded_BSD):
        k = _projection(self.config, self.config.kv_heads, "key")(encoded_BSD)
        v = _projection(self.config, self.config.kv_heads, "value")(encoded_BSD)
        return encoded_BSD, (k, v)


class CrossAttention(nn.Module):
    """Decoder queries over precomputed encoder K/V ([B, S, K, H] each)."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BTD, cross_k, cross_v, mask_BTS):
        q = _projection(self.config, self.config.num_heads, "query")(x_BTD)
        out = attend(q, cross_k, cross_v, mask_BTS)
        return _output_projection(self.config)(out)
