"""Kernels held as int8 with scales: a frozen base for LoRA (QLoRA-style), and weights for
decoding in about half the memory of bfloat16 (`config.kernel_dtype="int8"`, which holds the
embedding table so too: `quantize_for_decoding`).

Every kernel a LoRA target names (`qkv`, `out` of self-attention; `wi`, `wi_gate`, `wo` of
the feed-forward network; `model/lora.py`) is held as int8 values and one float32 scale per
output feature, symmetric: `scale = max|W| / 127` over the kernel's input axes, so the
values lie in [-127, 127] without clipping and `values * scale` is W to within `scale / 2`
per element. The scale keeps the input axes with size 1, so it multiplies the values as
they are, stacked over scanned layers or not. A mixture's shared expert is held as a
feed-forward network is, and its experts' kernels alike, with `<name>_scale` beside each
(`EXPERT_KERNELS`): one scale per expert and output feature. Latent attention's
projections are held as the other kernels are (`LATENT_KERNELS`).
Everything else (embeddings, norms, biases, routers, cross-attention) stays floating point.

A layer never computes with int8. A model whose config has `kernel_dtype="int8"` holds its
layers' kernels this way, and each layer makes its kernels in `param_dtype` where it runs
(`decoding_unpack_fn`, which `model.layers.layer_stack` applies): the params are int8 in
memory and between calls, the float kernels exist one layer at a time, inside the program.
For training, inside `model.layers.layer_params_from(unpack_fn(...))`
each layer turns its own int8 kernels into float32 and adds its adapters' update
(alpha / r) · A B where it runs (`attach` puts the adapters beside the kernels they adapt),
so with rematerialized layers only one layer's float kernels exist at a time and the
backward pass makes them again from the int8 values. Merging the whole model before the
forward pass, as `model.lora.merge` does, would hold every layer's float kernels at once.

Shape letters as in `model/lora.py`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from . import lora as L
from .config import TransformerConfig
from .float32_params import cast_floats, is_scale

INT8_MAX = 127
SCALE = L.QUANTIZED_SCALE  # beside `kernel`, in the same module's params
# (module, kernel, input axes) of every kernel a LoRA target names
_KERNELS = sorted(set(L.KERNELS.values()))


# Beside an int8 embedding table [V, D] (`model.embedder.Embedder`): a scale per row [V, 1],
# which serves both its uses, a token's row and the logits' product with every row.
EMBEDDING_SCALE = "embedding_scale"
# A mixture of experts' kernels (`model/experts.py`), each beside its scale `<name>_scale`:
# name -> the input axis of one layer's [D, experts, d_ff] or [experts, d_ff, D].
EXPERT_KERNELS = {"wi": 0, "wi_gate": 0, "wo": 1}
# Latent attention's projections (`model/latent_attention.py`), each a `kernel` whose first
# axis is its input (axes as `lora.kernel_ndim` counts them). Held as the other kernels are.
LATENT_KERNELS = ("q", "q_down", "q_up", "kv_down", "kv_up")
# (the path of its module's owner in a layer, its name, its input axes) of every kernel held
# as int8 values and a scale: a LoRA target's, in a mixture's shared expert (a feed-forward
# network of its own) too, and latent attention's.
_HELD_KERNELS = (*[(owner, name, input_axes) for module, name, input_axes in _KERNELS
                   for owner in ((module,), (module, "shared_expert"))],
                 *[(("self_attention", "latent"), name, 1) for name in LATENT_KERNELS])


def quantize_kernel(kernel: jax.Array, ndim: int, input_axes: int
                    ) -> tuple[jax.Array, jax.Array]:
    """`(values int8, scale float32)` with `values * scale ≈ kernel`, for a kernel of `ndim`
    axes (after any stacked-layer axes) whose first `input_axes` are its inputs. An output
    feature of all zeros gets scale 0 and values 0."""
    lead = kernel.ndim - ndim
    return _quantized(kernel, tuple(range(lead, lead + input_axes)))


def _quantized(kernel: jax.Array, input_axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    x = kernel.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=input_axes, keepdims=True) / INT8_MAX
    values = jnp.round(x / jnp.where(scale > 0, scale, 1.0)).astype(jnp.int8)
    return values, scale


def quantize_layers(params, float_dtype=None):
    """`params` with the layers' LoRA-targetable kernels (a mixture's shared expert's too) and
    latent attention's projections (`LATENT_KERNELS`) as int8 values and scales (`SCALE`
    beside each `kernel`), and a mixture's experts' kernels likewise (`EXPERT_KERNELS`);
    every other floating-point array in `float_dtype` (None: as it is)."""
    out = jax.tree.map(lambda x: x, params) if float_dtype is None else \
        cast_floats(params, float_dtype)
    for path, layer in L.layer_subtrees(out):
        for owner_path, name, input_axes in _HELD_KERNELS:
            owner = _find(layer, owner_path)
            held = owner.get(name) if isinstance(owner, dict) else None
            if not isinstance(held, dict) or "kernel" not in held or SCALE in held:
                continue
            kernel = L.get(params, (*path, *owner_path, name, "kernel"))  # before the cast
            values, scale = quantize_kernel(kernel, L.kernel_ndim(name), input_axes)
            owner[name] = {**held, "kernel": values, SCALE: scale}
        experts = layer.get("ffn", {}).get("experts")
        for name, axis in EXPERT_KERNELS.items():
            if experts is None or name not in experts or f"{name}_scale" in experts:
                continue
            kernel = L.get(params, (*path, "ffn", "experts", name))  # before the cast
            values, scale = _quantized(kernel, (kernel.ndim - 3 + axis,))
            experts[name], experts[f"{name}_scale"] = values, scale
    return out


def quantize_for_decoding(params):
    """`params` with the layers' kernels int8 (`quantize_layers`), and the embedding table and
    a separate output layer's kernel too: what a model of `kernel_dtype="int8"` holds."""
    out = quantize_layers(params)
    embedder = out.get("embedder")
    if embedder is None:
        return out
    table = embedder.get("embedding", {})
    if "embedding" in table and EMBEDDING_SCALE not in table:
        values, scale = _quantized(table["embedding"], (table["embedding"].ndim - 1,))
        embedder["embedding"] = {**table, "embedding": values, EMBEDDING_SCALE: scale}
    unembed = embedder.get("unembed")
    if isinstance(unembed, dict) and "kernel" in unembed and SCALE not in unembed:
        values, scale = quantize_kernel(unembed["kernel"], 2, 1)
        embedder["unembed"] = {**unembed, "kernel": values, SCALE: scale}
    return out


def _find(tree, path):
    """The subtree of `tree` at `path`, or None where it has none."""
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def dequantize_layers(params):
    """`params` with every int8 kernel and its scale as one float32 kernel."""
    return _map_kernel_dicts(params, _dequantized)


def _product(values: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """int8 `values` times their `scale`, computed in float32, as `dtype`."""
    return (values.astype(jnp.float32) * scale).astype(dtype)


def _dequantized_experts(held: dict, dtype) -> dict:
    out = {k: v for k, v in held.items() if not is_scale(k)}
    for name in EXPERT_KERNELS:
        if f"{name}_scale" in held:
            out[name] = _product(held[name], held[f"{name}_scale"], dtype)
    return out


def attach(config: TransformerConfig, params, adapters, lora: L.LoRA):
    """`params` with each adapter pair put beside the kernel it adapts, as `lora_<target>_a`
    and `lora_<target>_b` (what `unpack_fn` reads inside the layer)."""
    out = jax.tree.map(lambda x: x, params)  # new containers, the same arrays
    for path, target, _ in L.sites(config, params, lora):
        pair = L.get(adapters, (*path, target))
        held = L.get(out, (*path, *L.kernel_path(config, target)))
        held[f"lora_{target}_a"] = pair["lora_a"]
        held[f"lora_{target}_b"] = pair["lora_b"]
    return out


def unpack_fn(config: TransformerConfig, lora: L.LoRA | None) -> Callable[[dict], dict]:
    """The function a layer's params go through inside `layers.layer_params_from`: int8
    kernels become float32, and attached adapters are added (`attach`)."""

    def unpack(variables):
        return _map_kernel_dicts(variables, lambda held: _unpacked(config, lora, held))

    return unpack


def decoding_unpack_fn(config: TransformerConfig) -> Callable[[dict], dict]:
    """What each layer's params (and the embedder's) go through in a model of
    `kernel_dtype="int8"`: every int8 kernel, expert bank and embedding table becomes the
    float32 product of its values and scale, in `config.param_dtype`."""
    dtype = config.weights_dtype

    def unpack(variables):
        return _map_kernel_dicts(variables, lambda held: _dequantized(held, dtype), dtype)

    return unpack


def _dequantized(held: dict, dtype=jnp.float32) -> dict:
    if SCALE not in held:
        return held
    rest = {k: v for k, v in held.items() if k != SCALE}
    return {**rest, "kernel": _product(held["kernel"], held[SCALE], dtype)}


def _unpacked(config: TransformerConfig, lora: L.LoRA | None, held: dict) -> dict:
    held = _dequantized(held)
    targets = [t for t in L.TARGETS if f"lora_{t}_a" in held]
    if not targets:
        return held
    kernel = held["kernel"].astype(jnp.float32)
    for target in targets:
        kernel = L.add_update(config, target, kernel,
                              lora.update(held[f"lora_{target}_a"], held[f"lora_{target}_b"]))
    rest = {k: v for k, v in held.items() if not k.startswith("lora_")}
    return {**rest, "kernel": kernel}


def _map_kernel_dicts(tree, fn, dtype=jnp.float32):
    """`tree` with `fn` applied to every dict that holds a `kernel`, and a mixture's int8
    experts and an int8 embedding table as arrays of `dtype`."""
    if not isinstance(tree, dict):
        return tree
    if "kernel" in tree:
        return fn(tree)
    if any(f"{name}_scale" in tree for name in EXPERT_KERNELS):
        return _dequantized_experts(tree, dtype)
    if EMBEDDING_SCALE in tree:
        rest = {k: v for k, v in tree.items() if k != EMBEDDING_SCALE}
        return {**rest, "embedding": _product(tree["embedding"], tree[EMBEDDING_SCALE], dtype)}
    return {key: _map_kernel_dicts(value, fn, dtype) for key, value in tree.items()}
