"""Multi-head latent attention's projections (DeepSeek-V2/V3, Kimi K2, Moonlight,
GLM-4.7-Flash; `latent_kv_rank` > 0): the queries, keys and values of every head from a
token's few latent dimensions, in place of `SelfAttention`'s `qkv` projection.

Each token's keys and values come from one latent vector of `latent_kv_rank` dimensions
(`kv_down`, RMS-normed, then `kv_up` to each head's `latent_nope_dim` key dimensions and
`latent_value_dim` value dimensions) and one key part of `rotary_dim` dimensions that every
head shares, which RoPE turns. The queries come from `latent_q_rank` dimensions the same way
(`q_down`, RMS-normed, `q_up`), or straight from the token (`q`) where that rank is 0. A
head is laid out as [the turned dimensions, the unturned ones, zeros up to `head_dim`], so
that the rest of attention (RoPE over the leading `rotary_dim`, the cache, the output
projection) runs as for any other layer: the zeros add nothing to a query's product with a
key, and the output projection reads nothing from a value's. The cache holds each head's
K and V expanded, `head_dim` wide (what transformers' cache holds is the latent itself).

Shape letters as in `model/attention.py`; the latent and per-head part widths have none of
their own and are named in full.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax.numpy as jnp

from .config import TransformerConfig
from .norms import RMSNorm

# The RMSNorms over the latents take DeepSeek's epsilon whatever the layer norms' is.
LATENT_NORM_EPS = 1e-6


class LatentQKV(nn.Module):
    """[B, T, D] -> q, k, v [B, T, N, H] of every head (module docstring)."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BTD):
        c = self.config
        heads, turned, unturned = c.num_heads, c.rotary_dims, c.latent_nope_dim
        dense = functools.partial(nn.DenseGeneral, use_bias=False, dtype=c.compute_dtype,
                                  param_dtype=c.weights_dtype)
        norm_config = c.replace(layer_norm_eps=LATENT_NORM_EPS)
        if c.latent_q_rank:
            q_latent = RMSNorm(norm_config, name="q_norm")(
                dense(c.latent_q_rank, name="q_down")(x_BTD))
            q_BTNH = dense((heads, turned + unturned), name="q_up")(q_latent)
        else:
            q_BTNH = dense((heads, turned + unturned), name="q")(x_BTD)
        down = dense(c.latent_kv_rank + turned, name="kv_down")(x_BTD)
        kv_latent = RMSNorm(norm_config, name="kv_norm")(down[..., :c.latent_kv_rank])
        shared_turned = down[..., None, c.latent_kv_rank:]  # [B, T, 1, turned]
        kv_BTNH = dense((heads, unturned + c.latent_value_dim), name="kv_up")(kv_latent)
        k_BTNH = jnp.concatenate([jnp.broadcast_to(shared_turned, (*x_BTD.shape[:2], heads,
                                                                   turned)),
                                  kv_BTNH[..., :unturned]], axis=-1)
        v_BTNH = kv_BTNH[..., unturned:]
        return tuple(jnp.pad(x, ((0, 0),) * 3 + ((0, c.head_dim - x.shape[-1]),))
                     for x in (q_BTNH, k_BTNH, v_BTNH))
