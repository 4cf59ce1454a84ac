"""Scaled dot-product multi-head attention: softmax(QKᵀ/√d_k + mask)V.

Shape letters: B batch, T queries, S keys, N query heads, K kv heads, G = N/K query heads per
kv head, H head dim, D model dim. With grouped-query attention (K < N) each group of G query
heads shares one K/V head, so the cache holds K heads, not N.

Fresh keys and values come out of their projections as [B, S, K, H]; the cache stores them
as [B, K, S, H] (see `model/cache.py`), so `attend` and `attend_cached` take each layout.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from .cache import write_rows
from .config import TransformerConfig
from .positional import apply_rope


def attend(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
           mask_BTS: jax.Array) -> jax.Array:
    """softmax(QKᵀ/√H + mask)V with a boolean mask (True = may attend). Returns [B, T, N, H].

    Masked keys get exactly zero weight; the softmax runs in float32 for every input dtype.
    A query row with no key to attend to (all masked) returns zeros rather than NaN or a
    uniform average. `jax.nn.dot_product_attention` picks a fused kernel where one exists.
    """
    out = jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=mask_BTS[:, None])
    return _zero_rows_without_keys(out, mask_BTS).astype(q_BTNH.dtype)


def attend_cached(q_BTNH: jax.Array, k_BKSH: jax.Array, v_BKSH: jax.Array,
                  mask_BTS: jax.Array) -> jax.Array:
    """`attend` for keys and values in the cache's [B, K, S, H] layout. Returns [B, T, N, H].

    Both products are batched over (B, K) with each head's [S, H] block contiguous, so they
    read the cache in place; a decode step (T = 1) is then a matrix-vector product per head
    that streams the cache from memory once.
    """
    batch, num_queries, num_heads, head_dim = q_BTNH.shape
    kv_heads, capacity = k_BKSH.shape[1], k_BKSH.shape[2]
    group = num_heads // kv_heads
    # (B, K) merged into one batch axis X of heads and (G, T) into M query rows: with one
    # batch axis the products take K and V as they lie in the cache. With two, (B, K), a
    # backend that drops a unit B axis (XLA:CPU does) copies K transposed for every product.
    q_XMH = q_BTNH.reshape(batch, num_queries, kv_heads, group, head_dim).transpose(
        0, 2, 3, 1, 4).reshape(batch * kv_heads, group * num_queries, head_dim)
    k_XSH = k_BKSH.reshape(batch * kv_heads, capacity, head_dim)
    v_XSH = v_BKSH.reshape(batch * kv_heads, capacity, head_dim)
    logits_XMS = jnp.einsum("XMH,XSH->XMS", q_XMH, k_XSH,
                            preferred_element_type=jnp.float32) / jnp.sqrt(float(head_dim))
    logits_BKGTS = logits_XMS.reshape(batch, kv_heads, group, num_queries, capacity)
    logits_BKGTS = jnp.where(mask_BTS[:, None, None], logits_BKGTS, -jnp.inf)
    # A row with every key masked gets -inf everywhere; any finite max keeps exp() NaN-free.
    row_max = jnp.max(logits_BKGTS, axis=-1, keepdims=True)
    weights = jnp.exp(logits_BKGTS - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    probs_BKGTS = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1e-30)
    probs_XMS = probs_BKGTS.reshape(batch * kv_heads, group * num_queries, capacity)
    out_XMH = jnp.einsum("XMS,XSH->XMH", probs_XMS.astype(v_BKSH.dtype), v_XSH)
    out = out_XMH.reshape(batch, kv_heads, group, num_queries, head_dim).transpose(
        0, 3, 1, 2, 4).reshape(q_BTNH.shape)
    return _zero_rows_without_keys(out, mask_BTS).astype(q_BTNH.dtype)


def _zero_rows_without_keys(out_BTNH, mask_BTS):
    has_key_BT = jnp.any(mask_BTS, axis=-1)
    return jnp.where(has_key_BT[:, :, None, None], out_BTNH, 0)


def _projection(config: TransformerConfig, heads: int, name: str) -> nn.DenseGeneral:
    return nn.DenseGeneral(
        features=(heads, config.head_dim), use_bias=False, dtype=config.compute_dtype,
        param_dtype=config.weights_dtype, name=name,
    )


class OutputProjection(nn.Module):
    """Heads back to the model width: [B, T, N, H] -> [B, T, D] with a kernel [N, H, D].

    Computed as one [B·T, N·H] x [N·H, D] matmul: a contraction over two axes at once
    is slower on some backends (XLA:CPU among them) than the same 2-D product.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BTNH):
        c = self.config
        kernel = self.param("kernel", nn.initializers.lecun_normal(in_axis=(0, 1), out_axis=2),
                            (c.num_heads, c.head_dim, c.d_model), c.weights_dtype)
        x_BTNH, kernel = nn.dtypes.promote_dtype(x_BTNH, kernel, dtype=c.compute_dtype)
        x_BTF = x_BTNH.reshape(*x_BTNH.shape[:2], -1)
        return x_BTF @ kernel.reshape(-1, c.d_model)


class SelfAttention(nn.Module):
    """Masked self-attention that reads and writes this layer's K/V in the cache.

    `cache_kv` is `(k, v)`, the stacks [L, B, K, S, H] that hold this layer at index `layer`
    (see `model/cache.py`), or None. With a cache, the new K/V are written at each row's
    `starts` slot and the queries attend over all S cached slots of this layer; without one,
    they attend over the T new tokens only.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BTD, positions_BT, mask_BTS, cache_kv=None, layer=None, starts_B=None,
                 fits_B=None):
        config = self.config
        # One projection to all heads, split after: one matmul streams the weights where
        # three smaller ones would each pay a kernel launch (a decode step is many of them).
        qkv = _projection(config, config.num_heads + 2 * config.kv_heads, "qkv")(x_BTD)
        q, k, v = jnp.split(qkv, [config.num_heads, config.num_heads + config.kv_heads], axis=2)
        if config.positional_encoding == "rope":
            q = apply_rope(q, positions_BT, config.rope_base)
            k = apply_rope(k, positions_BT, config.rope_base)
        if cache_kv is None:
            out = attend(q, k, v, mask_BTS)
        else:
            cache_kv = tuple(write_rows(stack, layer, new, starts_B, fits_B)
                             for stack, new in zip(cache_kv, (k, v), strict=True))
            out = attend_cached(q, cache_kv[0][layer], cache_kv[1][layer], mask_BTS)
        return OutputProjection(config, name="out")(out), cache_kv


class CrossKV(nn.Module):
    """Projects the encoder output to one decoder layer's cross-attention K and V, [B, S, K, H].

    Run once per source, then held in the cache: decoding steps never re-project it.
    A layer of a `LayerStack`: the encoder output passes through unchanged.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, carry, layer, shared):
        encoded_BSD, _ = carry
        kv = _projection(self.config, 2 * self.config.kv_heads, "kv")(encoded_BSD)
        k, v = jnp.split(kv, 2, axis=2)
        return carry, {"cross_k": k, "cross_v": v}


class CrossAttention(nn.Module):
    """Decoder queries over precomputed encoder K/V: [B, S, K, H] each, or the cache's
    [B, K, S, H] when `cached`."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BTD, cross_k, cross_v, mask_BTS, cached: bool = False):
        q = _projection(self.config, self.config.num_heads, "query")(x_BTD)
        out = (attend_cached if cached else attend)(q, cross_k, cross_v, mask_BTS)
        return OutputProjection(self.config, name="out")(out)
