"""Transformer layers: residual + LayerNorm, encoder and decoder layers.

Shape letters as in `model/cache.py`. Every layer has one signature, written for `nn.scan`:
`layer((x, own), inputs, shared) -> ((x, own), output)`, where `own` is what the layer reads
and updates in place in the arrays held per layer (the cache), `inputs` are its own inputs
(always its `index` in its stack and its `number` in the model) and `shared` is what every
layer of the stack gets.
`LayerStack` and `run_layers` hold layers scanned or unrolled; nothing else needs to know
which.
Dropout is active exactly when the caller passes a `'dropout'` rng.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from . import int8_base, lora_rows
from .attention_layers import CrossAttention, SelfAttention
from .config import TransformerConfig
from .experts import MixtureOfExperts
from .feed_forward import FeedForward
from .norms import make_norm
from .ring import ring_stacks


@flax.struct.dataclass
class LayerInputs:
    """What every layer of a stack shares for one call.

    positions: [B, T] position of each new token.
    self_mask: [B, T, S] True where a query may attend a key (causal + padding, and the
               sliding window if the config has one).
    full_mask: [B, T, S] the same without the window, for `config.full_attention_layers`
               (None when there are none).
    starts:    [B] slot where each row's new K/V are written (None without a cache).
    fits:      [B] whether those T slots fit in the cache (None without a cache).
    cross_mask: [B, T, S_src] valid source keys (encoder-decoder only).
    source_lengths: [B] valid source keys per row, `cross_mask` described for a fused
               attention kernel, when cross-attention reads no cache (else None).
    fresh:     static; True when the cache held nothing before this call (the prefill), so
               self-attention needs only the new tokens' K/V and reads nothing back.
    key_lengths: [B] valid keys per row when self-attention's keys are the new tokens
               alone, from slot 0 (no cache, or a fresh one): `self_mask` is then exactly
               slot < key_lengths (and causal, in a decoder), what a fused attention kernel
               takes in its place; None otherwise.
    pages:     [B, pages per row] a paged cache's page tables (`model/paged.py`), else None.
    bias_table: [R, N] the stack's table of T5's relative position bias
               (`positional_encoding="relative"`), else None.
    ring_mask: [B, T, S] what each query sees of the rings of S slots that windowed layers
               keep (`model/ring.py`), and ring_writes [B, T] where each new token goes in
               them; None when the cache keeps no rings.
    """

    positions: jax.Array
    self_mask: jax.Array
    full_mask: jax.Array | None = None
    starts: jax.Array | None = None
    fits: jax.Array | None = None
    cross_mask: jax.Array | None = None
    fresh: bool = flax.struct.field(pytree_node=False, default=False)
    key_lengths: jax.Array | None = None
    source_lengths: jax.Array | None = None
    pages: jax.Array | None = None
    bias_table: jax.Array | None = None
    ring_mask: jax.Array | None = None
    ring_writes: jax.Array | None = None


def _feed_forward(config: TransformerConfig, number) -> nn.Module:
    """Decoder layer `number`'s FFN, named `ffn`: a mixture of experts when the config has
    them, but in its `dense_ffn_layers` (unrolled layers: `number` is an int there)."""
    dense = bool(config.dense_ffn_layers) and number in config.dense_ffn_layers
    if config.num_experts and not dense:
        return MixtureOfExperts(config, name="ffn")
    return FeedForward(config, config.dense_d_ff if dense else None, name="ffn")


class Residual(nn.Module):
    """x + Sublayer(x) with the norm after the sum (`post`, the paper), before the sublayer
    (`pre`) or on its output (`output`); with `sandwich_norms`, x + post_norm(Sublayer(norm(x)));
    the sublayer's output times `residual_multiplier` where it is not 1. Without `add_input`
    (pre-norm only), the sublayer's output alone, which a parallel layer sums itself; without
    `normalize`, the sublayer reads x as it is (a norm another block shares)."""

    config: TransformerConfig
    add_input: bool = True
    normalize: bool = True

    @nn.compact
    def __call__(self, x, sublayer):
        c = self.config
        norm = make_norm(c, "norm") if self.normalize else (lambda h: h)
        dropout = nn.Dropout(c.dropout)
        deterministic = not self.has_rng("dropout")

        def scaled(out):
            out = dropout(out, deterministic=deterministic)
            return out if c.residual_multiplier == 1.0 else out * c.residual_multiplier

        if c.norm == "pre":
            out, extra = sublayer(norm(x))
            if c.sandwich_norms:
                out = make_norm(c, "post_norm")(out)
            return (x + scaled(out) if self.add_input else scaled(out)), extra
        out, extra = sublayer(x)
        if c.norm == "output":
            return x + scaled(norm(out)), extra
        return norm(x + scaled(out)), extra


class EncoderLayer(nn.Module):
    """Bidirectional self-attention over the (padded) source, then the FFN."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, carry, layer: dict[str, Any], inputs: LayerInputs):
        x_BSD, _ = carry
        attention = SelfAttention(self.config, name="self_attention")
        x, _ = Residual(self.config, name="attention_block")(
            x_BSD, lambda h: attention(h, inputs.positions, inputs.self_mask,
                                       key_lengths_B=inputs.key_lengths, causal=False,
                                       bias_table=inputs.bias_table))
        ffn = FeedForward(self.config, name="ffn")
        x, _ = Residual(self.config, name="ffn_block")(x, lambda h: (ffn(h), None))
        return (x, None), None


class DecoderLayer(nn.Module):
    """Masked self-attention (reading/writing the layer cache), cross-attention, FFN; or,
    with `parallel_residual`, self-attention and FFN side by side.

    The carry is `(x [B, T, D], cache_kv)`: `cache_kv` is `(k, v)`, the self-attention cache
    stacks [L, B, K, S, H] that hold this layer at `layer["index"]`, carried whole so that
    each layer writes its new slots in place (None without a cache). For an encoder-decoder
    `layer` also holds this layer's `cross_k` and `cross_v`: [B, S_src, K, H], or the cache's
    [B, K, S_src, H] with a cache (and, from an int8 cache, `cross_k_scale` and
    `cross_v_scale` [B, K, S_src]).
    `number`, where set (unrolled layers), is the layer's number known while tracing, in
    place of `layer["number"]`, which a rematerialized layer receives traced: a layer's kind
    (dense or a mixture of experts) is decided then.
    """

    config: TransformerConfig
    number: int | None = None

    @nn.compact
    def __call__(self, carry, layer: dict[str, Any], inputs: LayerInputs):
        c = self.config
        x_BTD, cache_kv = carry
        number = layer["number"] if self.number is None else self.number
        mask_BTS, local = _attention_kind(c, number, inputs)
        # Scanned layers share one stack; unrolled, layer i is stack i (`config.layer_stacks`).
        in_ring = ring_stacks(c)[0 if self.number is None else self.number]
        attention = SelfAttention(c, name="self_attention")
        parallel = c.parallel_residual
        normed = {}  # the attention's input, which the FFN reads too under a shared norm

        def attend(h_BTD):
            normed["h"] = h_BTD
            return attention(h_BTD, inputs.positions, mask_BTS, cache_kv, layer["index"],
                             inputs.starts, inputs.fits, inputs.fresh, local,
                             inputs.key_lengths, pages=inputs.pages,
                             turned=_turned(c, number), bias_table=inputs.bias_table,
                             ring=(inputs.ring_mask, inputs.ring_writes) if in_ring
                             else (None, None))

        # Sequential: x_BTD + Attn(...); parallel: Attn(...) alone, summed with the FFN's below.
        x, cache_kv = Residual(c, name="attention_block", add_input=not parallel)(x_BTD, attend)
        if layer.get("cross_k") is not None:
            cross = CrossAttention(c, name="cross_attention")
            x, _ = Residual(c, name="cross_block")(
                x, lambda h: (cross(h, layer["cross_k"], layer["cross_v"], inputs.cross_mask,
                                    cached=cache_kv is not None,
                                    scales=_cross_scales(layer),
                                    source_lengths_B=inputs.source_lengths), None))
        ffn = _feed_forward(c, number)
        if parallel:  # the FFN reads the layer's input too
            ffn_out, _ = Residual(c, name="ffn_block", add_input=False,
                                  normalize=not c.shared_norm)(
                normed["h"] if c.shared_norm else x_BTD, lambda h: (ffn(h), None))
            return (x_BTD + x + ffn_out, cache_kv), None
        x, _ = Residual(c, name="ffn_block")(x, lambda h: (ffn(h), None))
        return (x, cache_kv), None


def _attention_kind(config: TransformerConfig, number, inputs: LayerInputs):
    """`(mask [B, T, S], local)` of decoder layer `number`: whether it attends over the
    sliding window, and the mask that says so. `number` is an int for unrolled layers (the
    choice is made while tracing) and traced for scanned ones (a select)."""
    if inputs.full_mask is None:
        return inputs.self_mask, config.sliding_window is not None
    local = _outside(config.full_attention_layers, number)  # global layers: a window is set
    if isinstance(number, int):
        return (inputs.self_mask if local else inputs.full_mask), local
    return jnp.where(local, inputs.self_mask, inputs.full_mask), local


def _turned(config: TransformerConfig, number):
    """Whether RoPE turns decoder layer `number`'s queries and keys."""
    return True if not config.unrotated_layers else _outside(config.unrotated_layers, number)


def _outside(layers: tuple[int, ...], number):
    """Whether decoder layer `number` is not among `layers`: a bool for an unrolled layer
    (`number` an int, decided while tracing), traced for scanned ones."""
    if isinstance(number, int):
        return number not in layers
    return ~jnp.isin(number, jnp.asarray(layers, jnp.int32))


def _cross_scales(layer: dict[str, Any]):
    """An int8 cache's (cross_k_scale, cross_v_scale) of this layer, else None."""
    if layer.get("cross_k_scale") is None:
        return None
    return layer["cross_k_scale"], layer["cross_v_scale"]


class Unrolled(nn.Module):
    """`num_layers` copies of `layer_cls` applied one after another, each with its own params
    (`<name>/0`, `<name>/1`, ...) and its own stack of one layer (`run_layers`)."""

    layer_cls: Any
    config: TransformerConfig
    num_layers: int

    @nn.compact
    def __call__(self, x, stacked, per_layer, shared):
        stacked, outputs = list(stacked) if stacked is not None else None, []
        # A layer that takes its number (`DecoderLayer`) gets it as an int: rematerialized,
        # its `inputs` arrive traced.
        fields = getattr(self.layer_cls, "__dataclass_fields__", {})
        for i in range(self.num_layers):
            inputs = {"index": 0, "number": i, **({} if per_layer is None else
                                                  jax.tree.map(lambda a: a[0], per_layer[i]))}
            own = None if stacked is None else stacked[i]
            numbered = {"number": i} if "number" in fields else {}
            (x, own), out = self.layer_cls(self.config, name=str(i), **numbered)(
                (x, own), inputs, shared)
            if stacked is not None:
                stacked[i] = own
            outputs.append(jax.tree.map(lambda a: a[None], out))
        return x, None if stacked is None else tuple(stacked), tuple(outputs)


_LAYER_PARAMS: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "layer_params", default=None)


@contextlib.contextmanager
def layer_params_from(unpack: Callable[[dict], dict]) -> Iterator[None]:
    """Models built inside hold each layer's params in another form, which `unpack` turns
    into the layer's own (a pure function of one layer's params tree, traced inside the
    layer). So a layer can read int8 kernels and low-rank adapters and make its float
    kernels where it uses them, rematerialized with it, rather than every layer's at once
    before the forward pass (`model/int8_base.py`)."""
    token = _LAYER_PARAMS.set(unpack)
    try:
        yield
    finally:
        _LAYER_PARAMS.reset(token)


def layer_stack(layer_cls, config: TransformerConfig, num_layers: int, name: str) -> nn.Module:
    """`num_layers` copies of `layer_cls`, held as `config.layer_stacks` says: stacked with
    `nn.scan` when `config.scan_layers` (params get a leading [L] axis and the program is
    traced once, so compile time does not grow with depth), else `Unrolled`. Call it with
    `run_layers`. With `config.remat` each layer is rematerialized: differentiating it keeps
    its input and recomputes the rest. Inside `layer_params_from(unpack)` each layer's
    params go through `unpack` first; in a model of `kernel_dtype="int8"`, through
    `int8_base.decoding_unpack_fn`."""
    unpack = _LAYER_PARAMS.get()
    if unpack is None and config.kernel_dtype == "int8":
        unpack = int8_base.decoding_unpack_fn(config)
    if unpack is not None:
        layer_cls = nn.map_variables(layer_cls, "params", trans_in_fn=unpack, mutable=False)
    if config.remat:
        # Inside a scan XLA cannot merge the recomputation into the forward pass, so the
        # guard against that (`prevent_cse`) would only cost time there.
        layer_cls = nn.remat(layer_cls, prevent_cse=not config.scan_layers)
    if not config.scan_layers:
        return Unrolled(layer_cls, config, num_layers, name=name)
    return nn.scan(
        layer_cls,
        variable_axes={"params": 0, "intermediates": 0, lora_rows.COLLECTION: 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=(0, nn.broadcast),
        length=num_layers,
    )(config, name=name)


def run_layers(config: TransformerConfig, layers: nn.Module, num_layers: int, x,
               stacked=None, per_layer=None, shared=None):
    """Applies a `layer_stack` to `x`; returns `(x, stacked, outputs)`.

    `stacked` (e.g. the cache's K/V) and `per_layer` (e.g. cross-attention K/V) are tuples
    over the stacks of `config.layer_stacks(num_layers)`, each item a pytree of arrays with
    a leading axis of that stack's layers; None for none. A layer gets the stack of
    `stacked` that holds it whole, with its index, and its own slice of `per_layer`. The
    layers' outputs come back held the same way.
    """
    if not config.scan_layers:
        return layers(x, stacked, per_layer, shared)
    numbers = jnp.arange(num_layers, dtype=jnp.int32)
    inputs = {"index": numbers, "number": numbers, **({} if per_layer is None else per_layer[0])}
    own = None if stacked is None else stacked[0]
    (x, own), outputs = layers((x, own), inputs, shared)
    return x, None if own is None else (own,), (outputs,)


def _layer_stack_names(config: TransformerConfig, params) -> dict[str, int]:
    """The params' layer stacks (names ending in `layers` or `cross_kv`) -> layers in each."""
    return {name: config.num_encoder_layers if name == "encoder_layers" else
            config.num_decoder_layers
            for name in params if name.endswith(("layers", "cross_kv"))}


def unstack_layer_params(config: TransformerConfig, params):
    """A scanned model's params ([L, ...] stacks per layer stack) as the same model's with
    `scan_layers=False` (`<stack>/0`, `<stack>/1`, ...): the same weights, unrolled."""
    stacks = _layer_stack_names(config, params)

    def unstack(name: str, tree):
        if name not in stacks:
            return tree
        return {str(i): jax.tree.map(lambda a, i=i: a[i], tree) for i in range(stacks[name])}

    return {name: unstack(name, tree) for name, tree in params.items()}


def stack_layer_params(config: TransformerConfig, params):
    """The inverse of `unstack_layer_params`: an unrolled model's params as the same model's
    with `scan_layers=True`."""
    stacks = _layer_stack_names(config, params)

    def stack(name: str, tree):
        if name not in stacks:
            return tree
        layers = [tree[str(i)] for i in range(stacks[name])]
        return jax.tree.map(lambda *a: jnp.stack(a), *layers)

    return {name: stack(name, tree) for name, tree in params.items()}


def with_layer_layout(config: TransformerConfig, params, scan_layers: bool):
    """`(config, params)` of the same model held scanned (`scan_layers=True`) or unrolled:
    unchanged when they are held so already, else converted."""
    if scan_layers == config.scan_layers:
        return config, params
    convert = unstack_layer_params if config.scan_layers else stack_layer_params
    return config.replace(scan_layers=scan_layers), convert(config, params)
