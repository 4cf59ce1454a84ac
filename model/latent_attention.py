"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, Moonlight, GLM-4.7-Flash;
`latent_kv_rank` > 0): every head's keys and values from a token's few latent dimensions, in
place of `SelfAttention`'s `qkv` projection, and a cache that holds only those.

Each token's keys and values come from one latent vector of `latent_kv_rank` dimensions
(`kv_down`, RMS-normed, then `kv_up` to each head's `latent_nope_dim` key dimensions and
`latent_value_dim` value dimensions) and one key part of `rotary_dim` dimensions that every
head shares, which RoPE turns. The queries come from `latent_q_rank` dimensions the same way
(`q_down`, RMS-normed, `q_up`), or straight from the token (`q`) where that rank is 0.

The cache holds the latent row [the shared key part, the latent] of each token: one "head"
of `rotary_dim + latent_kv_rank` dimensions and no values (`config.cached_heads`), where the
heads' expanded keys and values would take `2 × num_heads × head_dim`. Two ways to attend,
equal in exact arithmetic:
  - expanded (`expand`), over the new tokens of a call that reads no cache (a prefill, a
    training step): each head's key and value from the latent, laid out [turned, unturned,
    zeros up to `head_dim`] as any other layer's; the matmuls such a call is bound by stay
    as small as the heads are;
  - absorbed (`absorb`, `values`), over the cache (a decode step): each query's unturned part
    taken through `kv_up`'s key half, so it meets the latent itself ([turned, latent] · [turned
    key part, latent]); the same weights give the mix of latents, and `kv_up`'s value half
    turns it into each head's value. A step then reads one latent per token, never a head's
    expansion of it: decoding is bound by what it reads.

Shape letters as in `model/attention.py`; the latent and per-head part widths have none of
their own and are named in full.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from . import lora_rows
from .config import TransformerConfig
from .norms import RMSNorm

# The RMSNorms over the latents take DeepSeek's epsilon whatever the layer norms' is.
LATENT_NORM_EPS = 1e-6


class LatentKernel(nn.Module):
    """`kv_up`'s kernel [latent_kv_rank, N, latent_nope_dim + latent_value_dim], read whole:
    the expanded way applies it to latents, the absorbed way to queries and outputs. Drawn as
    `nn.DenseGeneral` draws its kernel (LeCun normal over the latent)."""

    shape: tuple[int, int, int]
    dtype: jnp.dtype

    @nn.compact
    def __call__(self):
        def init(key, shape, dtype):
            flat = nn.initializers.lecun_normal()(key, (shape[0], int(np.prod(shape[1:]))),
                                                  dtype)
            return flat.reshape(shape)

        return self.param("kernel", init, self.shape, self.dtype)


class LatentQKV(nn.Module):
    """A latent attention layer's projections (module docstring): called, [B, T, D] -> the
    queries [B, T, N, H] and the latent rows [B, T, 1, rotary_dim + latent_kv_rank] that the
    cache holds, the shared key part not yet turned."""

    config: TransformerConfig

    def setup(self):
        c = self.config
        heads, turned, unturned = c.num_heads, c.rotary_dims, c.latent_nope_dim
        dense = functools.partial(nn.DenseGeneral, use_bias=False, dtype=c.compute_dtype,
                                  param_dtype=c.weights_dtype)
        norm_config = c.replace(layer_norm_eps=LATENT_NORM_EPS)
        if c.latent_q_rank:
            self.q_down = dense(c.latent_q_rank)
            self.q_norm = RMSNorm(norm_config)
            self.q_up = dense((heads, turned + unturned))
        else:
            self.q = dense((heads, turned + unturned))
        self.kv_down = dense(c.latent_kv_rank + turned)
        self.kv_norm = RMSNorm(norm_config)
        self.kv_up = LatentKernel((c.latent_kv_rank, heads, unturned + c.latent_value_dim),
                                  c.weights_dtype)

    def __call__(self, x_BTD):
        c = self.config
        if c.latent_q_rank:
            q_in = self.q_norm(self.q_down(x_BTD))
            q_BTNH = self.q_up(q_in)
        else:
            q_in = x_BTD
            q_BTNH = self.q(x_BTD)
        q_BTNH = lora_rows.add_update(self, "q", q_in, q_BTNH)
        down = self.kv_down(x_BTD)
        latent = self.kv_norm(down[..., :c.latent_kv_rank])
        rows = jnp.concatenate([down[..., c.latent_kv_rank:], latent], axis=-1)
        return _pad_heads(q_BTNH, c.head_dim), rows[:, :, None, :]

    def expand(self, rows_BT1H):
        """Latent rows [B, T, 1, rotary_dim + latent_kv_rank], the key part turned -> every
        head's keys and values [B, T, N, H]: keys [the turned part, the unturned ones, zeros],
        values [the value dimensions, zeros]."""
        c = self.config
        turned, unturned = c.rotary_dims, c.latent_nope_dim
        latent = rows_BT1H[:, :, 0, turned:].astype(c.compute_dtype)
        up = jnp.tensordot(latent, self._kernel(), axes=1)
        for target, part in (("k", slice(None, unturned)), ("v", slice(unturned, None))):
            delta = lora_rows.update(self, target, latent)
            if delta is not None:  # each row's adapter of kv_up's key or value half
                up = up.at[..., part].add(delta.reshape(*up.shape[:3], -1).astype(up.dtype))
        shared = jnp.broadcast_to(rows_BT1H[..., :turned], (*up.shape[:3], turned))
        k_BTNH = jnp.concatenate([shared.astype(up.dtype), up[..., :unturned]], axis=-1)
        return _pad_heads(k_BTNH, c.head_dim), _pad_heads(up[..., unturned:], c.head_dim)

    def absorb(self, q_BTNH):
        """Queries [B, T, N, H] -> [B, T, N, rotary_dim + latent_kv_rank]: the turned part as
        it is, the unturned part through `kv_up`'s key half (per head [nope, rank]), so that
        its product with a latent row is the product with that head's expanded key."""
        c = self.config
        turned, unturned = c.rotary_dims, c.latent_nope_dim
        key_half = jnp.transpose(self._kernel()[..., :unturned], (1, 2, 0))  # per head
        nope = q_BTNH[..., turned:turned + unturned].astype(key_half.dtype)
        latent_queries = jnp.matmul(nope[..., None, :], key_half)[..., 0, :]
        delta = lora_rows.absorbed_update(self, "k", nope)
        if delta is not None:
            latent_queries = latent_queries + delta.astype(latent_queries.dtype)
        return jnp.concatenate([q_BTNH[..., :turned].astype(latent_queries.dtype),
                                latent_queries], axis=-1)

    def values(self, mixed_BTNH):
        """What absorbed queries mixed from the latent rows [B, T, N, rotary_dim +
        latent_kv_rank] -> each head's value [B, T, N, H]: the latent part through `kv_up`'s
        value half (per head [rank, value]); the mixed key parts are dropped."""
        c = self.config
        value_half = jnp.transpose(self._kernel()[..., c.latent_nope_dim:], (1, 0, 2))
        latent = mixed_BTNH[..., c.rotary_dims:].astype(value_half.dtype)
        values = jnp.matmul(latent[..., None, :], value_half)[..., 0, :]
        delta = lora_rows.headwise_update(self, "v", latent)
        if delta is not None:
            values = values + delta.astype(values.dtype)
        return _pad_heads(values, c.head_dim)

    def _kernel(self) -> jax.Array:
        return self.kv_up().astype(self.config.compute_dtype)


def _pad_heads(x, head_dim: int):
    return jnp.pad(x, ((0, 0),) * 3 + ((0, head_dim - x.shape[-1]),))
