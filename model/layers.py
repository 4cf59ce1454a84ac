"""Transformer layers: feed-forward network, residual + LayerNorm, encoder and decoder layers.

Shape letters as in `model/cache.py`. Layers are written for `nn.scan`: they take the
running activations as the carry and return `(x, per-layer output)`.
Dropout is active exactly when the caller passes a `'dropout'` rng.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax

from .attention import CrossAttention, SelfAttention
from .config import TransformerConfig


@flax.struct.dataclass
class LayerInputs:
    """What every layer of a stack shares for one call.

    positions: [B, T] position of each new token.
    self_mask: [B, T, S] True where a query may attend a key (causal + padding).
    starts:    [B] slot where each row's new K/V are written (None without a cache).
    fits:      [B] whether those T slots fit in the cache (None without a cache).
    cross_mask: [B, T, S_src] valid source keys (encoder-decoder only).
    """

    positions: jax.Array
    self_mask: jax.Array
    starts: jax.Array | None = None
    fits: jax.Array | None = None
    cross_mask: jax.Array | None = None


class FeedForward(nn.Module):
    """Position-wise FFN: W2 act(W1 x), or W2 (silu(W1 x) * W3 x) for SwiGLU. [B,T,D]->[B,T,D]."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BTD):
        c = self.config

        def dense(features, name):
            return nn.Dense(features, dtype=c.compute_dtype, param_dtype=c.weights_dtype,
                            name=name)

        h = dense(c.d_ff, "wi")(x_BTD)
        if c.activation == "swiglu":
            h = nn.silu(h) * dense(c.d_ff, "wi_gate")(x_BTD)
        elif c.activation == "gelu":
            h = nn.gelu(h)
        else:
            h = nn.relu(h)
        return dense(c.d_model, "wo")(h)


class Residual(nn.Module):
    """x + Sublayer(x) with LayerNorm after (`post`, the paper) or before (`pre`) the sublayer."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x, sublayer):
        c = self.config
        norm = nn.LayerNorm(epsilon=c.layer_norm_eps, dtype=c.compute_dtype,
                            param_dtype=c.weights_dtype, name="norm")
        dropout = nn.Dropout(c.dropout)
        deterministic = not self.has_rng("dropout")
        if c.norm == "pre":
            out, extra = sublayer(norm(x))
            return x + dropout(out, deterministic=deterministic), extra
        out, extra = sublayer(x)
        return norm(x + dropout(out, deterministic=deterministic)), extra


class EncoderLayer(nn.Module):
    """Bidirectional self-attention over the (padded) source, then the FFN."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BSD, inputs: LayerInputs):
        attention = SelfAttention(self.config, name="self_attention")
        x, _ = Residual(self.config, name="attention_block")(
            x_BSD, lambda h: attention(h, inputs.positions, inputs.self_mask))
        ffn = FeedForward(self.config, name="ffn")
        x, _ = Residual(self.config, name="ffn_block")(x, lambda h: (ffn(h), None))
        return x, None


class DecoderLayer(nn.Module):
    """Masked self-attention (reading/writing the layer cache), cross-attention, FFN.

    The carry is `(x [B, T, D], cache_kv)`: `cache_kv` is `(k, v)`, either every layer's
    stacked self-attention cache [L, B, K, S, H] (scanned layers: carried whole, not sliced
    per layer, so each layer writes its new slots in place) or this layer's own [B, K, S, H]
    buffers (unrolled layers); None without a cache. `layer` holds this layer's inputs: its
    `index` into a stacked cache (scanned only) and, for an encoder-decoder, `cross_k` and
    `cross_v` ([B, S_src, K, H], or the cache's [B, K, S_src, H] with a cache).
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, carry, layer: dict[str, Any], inputs: LayerInputs):
        c = self.config
        x_BTD, cache_kv = carry
        attention = SelfAttention(c, name="self_attention")
        x, cache_kv = Residual(c, name="attention_block")(
            x_BTD,
            lambda h: attention(h, inputs.positions, inputs.self_mask, cache_kv,
                                layer.get("index"), inputs.starts, inputs.fits))
        if layer.get("cross_k") is not None:
            cross = CrossAttention(c, name="cross_attention")
            x, _ = Residual(c, name="cross_block")(
                x, lambda h: (cross(h, layer["cross_k"], layer["cross_v"], inputs.cross_mask,
                                    cached=cache_kv is not None), None))
        ffn = FeedForward(c, name="ffn")
        x, _ = Residual(c, name="ffn_block")(x, lambda h: (ffn(h), None))
        return (x, cache_kv), None


class Unrolled(nn.Module):
    """`num_layers` copies of `layer_cls` applied one after another, each with its own params
    (`<name>/0`, `<name>/1`, ...), in place of the `nn.scan` stack below.

    Decoder layers take a list of per-layer inputs (one dict each) where the scan takes one
    dict of stacked arrays, and their cache carry `(k, v)` holds a tuple of per-layer
    buffers: layer i reads and writes `(k[i], v[i])`. Per-layer outputs come back as tuples
    over layers (CrossKV's K/V, held that way in the cache).
    """

    layer_cls: Any
    config: TransformerConfig
    num_layers: int

    @nn.compact
    def __call__(self, carry, *args):
        outputs = []
        for i in range(self.num_layers):
            layer = self.layer_cls(self.config, name=str(i))
            if self.layer_cls is not DecoderLayer:
                carry, out = layer(carry, *args)
            else:
                x, cache_kv = carry
                own_kv = None if cache_kv is None else tuple(c[i] for c in cache_kv)
                (x, own_kv), out = layer((x, own_kv), args[0][i], *args[1:])
                if cache_kv is not None:
                    cache_kv = tuple(c[:i] + (new,) + c[i + 1:]
                                     for c, new in zip(cache_kv, own_kv, strict=True))
                carry = (x, cache_kv)
            outputs.append(out)
        return carry, jax.tree.map(lambda *per_layer: per_layer, *outputs)


def scanned(layer_cls, config: TransformerConfig, num_layers: int, name: str):
    """`num_layers` copies of `layer_cls`, stacked with `nn.scan` when `config.scan_layers`:
    params get a leading [L] axis and the program is traced once, so compile time does not
    grow with depth. Otherwise the layers are unrolled (see `TransformerConfig.scan_layers`).
    """
    if not config.scan_layers:
        return Unrolled(layer_cls, config, num_layers, name=name)
    in_axes = {DecoderLayer: (0, nn.broadcast), EncoderLayer: (nn.broadcast,)}.get(layer_cls, ())
    return nn.scan(
        layer_cls,
        variable_axes={"params": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=in_axes,
        length=num_layers,
    )(config, name=name)
