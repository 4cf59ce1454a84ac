"""The attention layers: self-attention over the cache (contiguous or paged), the
cross-attention of an encoder-decoder and the projection of its source to K/V once.

Shape letters as in `model/attention.py`.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from . import lora_rows, paged
from .attention import attend, attend_blocks
from .cache_writes import write_rows, write_slots
from .config import TransformerConfig
from .latent_attention import LatentQKV
from .norms import RMSNorm
from .positional import PositionBias, alibi_slopes, apply_rope, layer_rope
from .projections import OutputProjection, projection
from .quantize import quantize, round_trip


class SelfAttention(nn.Module):
    """Masked self-attention that reads and writes this layer's K/V in the cache.

    `cache_kv` is `(k, v)`, the stacks [L, B, K, S, H] that hold this layer at index `layer`
    (see `model/cache.py`), or `(k, v, k_scale, v_scale)` for an int8 cache, or None. With a
    cache, the new K/V are written at each row's `starts` slot and the queries attend over
    the filled blocks of this layer's cached slots (`attend_blocks`; a latent attention layer
    writes and reads its latent rows, `model/latent_attention.py`); without one, or when
    `fresh` says the cache held nothing before this call (the prefill), they attend over the
    T new tokens only: with an int8 cache, over them as the cache holds them. `local` says
    the layer attends over a sliding window (`TransformerConfig.is_local_layer`; traced for
    scanned layers), which picks its RoPE; `turned` whether RoPE turns its queries and keys
    at all (`TransformerConfig.unrotated_layers`; traced for scanned layers). `key_lengths`
    [B] and `causal` (with the sliding window of a layer known to be local) describe the mask
    of a call that attends over the new tokens alone (as `attend` takes them), or are None.
    `pages` [B, pages per row] are a paged cache's page tables (`model/paged.py`): the stacks
    are then its pools, written and read through the tables. With `attention_sinks` the
    layer holds a sink logit for each query head, `sinks` [N] (`model/attention.py`). With
    ALiBi, or T5's relative bias (`bias_table` [buckets, N], the stack's; with
    `relative_bias_per_layer`, the layer's own `position_bias`), the logits take a bias by
    distance (`positional.PositionBias`), bidirectional where not `causal`. `ring` is
    `(mask [B, T, S], writes [B, T])` of the ring of S slots this layer's stacks are
    (`model/ring.py`; in a paged cache too, beside the other layers' pools), or Nones: the
    layer writes its ring through them and, after the prefill, reads it.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BTD, positions_BT, mask_BTS, cache_kv=None, layer=None, starts_B=None,
                 fits_B=None, fresh: bool = False, local=False, key_lengths_B=None,
                 causal: bool = True, pages=None, turned=True, bias_table=None,
                 ring=(None, None)):
        config = self.config
        ring_mask_BTS, ring_writes_BT = ring
        if cache_kv is None:
            ring_writes_BT = None
        latent = None
        if config.latent_kv_rank:  # k: each token's latent row; the cache holds no values
            latent = LatentQKV(config, name="latent")
            (q, k), v = latent(x_BTD), None
        else:
            # One projection to all heads, split after: one matmul streams the weights where
            # three smaller ones would each pay a kernel launch (a decode step is many).
            qkv = projection(config, config.num_heads + 2 * config.kv_heads, "qkv")(x_BTD)
            qkv = lora_rows.add_qkv_updates(self, config, x_BTD, qkv)
            q, k, v = jnp.split(qkv, [config.num_heads, config.num_heads + config.kv_heads],
                                axis=2)
        if config.qk_norm and not config.qk_norm_after_rope:
            q, k = _qk_norm(config, q, "q_norm"), _qk_norm(config, k, "k_norm")
        if config.qkv_clip is not None:
            q, k, v = (jnp.clip(x, -config.qkv_clip, config.qkv_clip) for x in (q, k, v))
        if config.positional_encoding == "rope" and turned is not False:
            inv_freq, attention_factor = layer_rope(config, local)
            q_turned = apply_rope(q, positions_BT, inv_freq, attention_factor)
            k_turned = apply_rope(k, positions_BT, inv_freq, attention_factor)
            q, k = ((q_turned, k_turned) if turned is True else
                    (jnp.where(turned, q_turned, q), jnp.where(turned, k_turned, k)))
        if config.qk_norm and config.qk_norm_after_rope:
            q, k = _qk_norm(config, q, "q_norm"), _qk_norm(config, k, "k_norm")
        if config.query_scale_beta:
            q = q * _query_scales(config, positions_BT)[:, :, None, None].astype(q.dtype)
        bias = None
        if config.positional_encoding == "alibi":
            bias = PositionBias(positions_BT, slopes_N=jnp.asarray(alibi_slopes(config.num_heads)))
        elif config.positional_encoding == "relative":
            if config.relative_bias_per_layer:
                bias_table = self.param("position_bias", nn.initializers.normal(stddev=0.02),
                                        (config.relative_buckets, config.num_heads),
                                        config.weights_dtype)
            bias = PositionBias(positions_BT, table=bias_table,
                                num_buckets=config.relative_buckets,
                                max_distance=config.relative_max_distance, bidirectional=not causal)
        sinks = None
        if config.attention_sinks:
            sinks = self.param("sinks", nn.initializers.zeros_init(), (config.num_heads,),
                               config.weights_dtype)
        quantized = cache_kv is not None and len(cache_kv) == 4
        if cache_kv is not None:
            new = (k, v)
            if quantized:
                (k_int8, k_scale), (v_int8, v_scale) = (
                    quantize(k), (None, None) if v is None else quantize(v))
                new = (k_int8, v_int8, k_scale, v_scale)
            def write(stack, fresh_kv):
                if fresh_kv is None:  # a latent layer's values: held in its latent rows
                    return stack
                if ring_writes_BT is not None:
                    return write_slots(stack, layer, fresh_kv, ring_writes_BT)
                if pages is None:
                    return write_rows(stack, layer, fresh_kv, starts_B, fits_B)
                return paged.write_pages(stack, layer, fresh_kv, starts_B, fits_B, pages)

            cache_kv = tuple(map(write, cache_kv, new))
        if cache_kv is None or fresh:
            if quantized:
                k, v = round_trip(k), None if v is None else round_trip(v)
            if latent is not None:
                k, v = latent.expand(k)
            window, described = _described_window(config, local, causal)
            out = attend(q, k, v, mask_BTS[..., :k.shape[1]], _scale(config),
                         config.attention_softcap,
                         key_lengths_B=key_lengths_B if described else None, causal=causal,
                         window=window, sinks_N=sinks, bias=bias)
        else:
            if ring_writes_BT is not None:
                mask_BTS = ring_mask_BTS
            stacks, scales = cache_kv[:2], cache_kv[2:] or None
            if latent is not None:  # every head reads the latent rows as its keys and values
                q, stacks = latent.absorb(q), (cache_kv[0],) * 2
                scales = None if scales is None else (scales[0],) * 2
            if pages is not None and ring_writes_BT is None:
                out = paged.attend_pages(q, *stacks, layer, pages, mask_BTS,
                                         config.attention_block, scales=scales,
                                         scale=_scale(config), softcap=config.attention_softcap,
                                         sinks_N=sinks, bias=bias)
            else:
                out, _ = attend_blocks(q, *stacks, layer, mask_BTS, config.attention_block,
                                       scales=scales, scale=_scale(config),
                                       softcap=config.attention_softcap, sinks_N=sinks,
                                       bias=bias)
            if latent is not None:
                out = latent.values(out)
        return lora_rows.add_update(self, "o", out, OutputProjection(config, name="out")(out)), \
            cache_kv


def _scale(config: TransformerConfig) -> float | None:
    """What multiplies QKᵀ in self-attention: `attention_scale`, or where it is None,
    1/√H (`attend`'s default) or over latent attention's query and key dimensions (the rest
    of each head is zeros)."""
    if config.attention_scale is None and config.latent_kv_rank:
        return (config.rotary_dims + config.latent_nope_dim) ** -0.5
    return config.attention_scale


def _query_scales(config: TransformerConfig, positions_BT):
    """[B, T] what each position's queries are multiplied by: 1 + beta · ln(1 +
    floor(position / length)), exactly 1 before the first `length` positions."""
    steps_BT = (positions_BT // config.query_scale_length).astype(jnp.float32)
    return 1.0 + config.query_scale_beta * jnp.log1p(steps_BT)


def _described_window(config: TransformerConfig, local, causal: bool):
    """`(window, described)`: the sliding window a layer's mask adds to what `key_lengths`
    and `causal` describe (None for a global layer), and whether that describes it all. A
    causal layer known to be local or global while tracing describes its window; a scanned
    layer whose kind is traced, or a window without `causal`, does not."""
    if config.sliding_window is None:
        return None, True
    if not isinstance(local, bool) or not causal:
        return None, False
    return (config.sliding_window if local else None), True


def _qk_norm(config: TransformerConfig, x_BTNH, name: str):
    """RMSNorm of queries or keys [B, T, N, H] over each head (Qwen3), or over all heads of
    a position together (`qk_norm_across_heads`, OLMo 2), before RoPE turns them."""
    if not config.qk_norm_across_heads:
        return RMSNorm(config, name=name)(x_BTNH)
    heads_side_by_side = x_BTNH.reshape(*x_BTNH.shape[:2], -1)
    return RMSNorm(config, name=name)(heads_side_by_side).reshape(x_BTNH.shape)


class CrossKV(nn.Module):
    """Projects the encoder output to one decoder layer's cross-attention K and V, [B, S, K, H].

    Run once per source, then held in the cache: decoding steps never re-project it.
    A layer of a `LayerStack`: the encoder output passes through unchanged.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, carry, layer, shared):
        encoded_BSD, _ = carry
        kv = projection(self.config, 2 * self.config.kv_heads, "kv")(encoded_BSD)
        k, v = jnp.split(kv, 2, axis=2)
        return carry, {"cross_k": k, "cross_v": v}


class CrossAttention(nn.Module):
    """Decoder queries over precomputed encoder K/V: [B, S, K, H] each, or the cache's
    [B, K, S, H] when `cached`, read block by block up to the longest source
    (`attend_blocks`), with their scales [B, K, S] from an int8 cache. Uncached, `source_lengths`
    [B] (where given) describe the mask to a fused kernel, as `attend` takes them."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BTD, cross_k, cross_v, mask_BTS, cached: bool = False, scales=None,
                 source_lengths_B=None):
        q = projection(self.config, self.config.num_heads, "query")(x_BTD)
        if cached:
            scales = None if scales is None else tuple(s[None] for s in scales)
            out, _ = attend_blocks(q, cross_k[None], cross_v[None], 0, mask_BTS,
                                   self.config.attention_block, scales=scales,
                                   scale=self.config.attention_scale)
        else:
            out = attend(q, cross_k, cross_v, mask_BTS, self.config.attention_scale,
                         key_lengths_B=source_lengths_B)
        return OutputProjection(self.config, name="out")(out)
