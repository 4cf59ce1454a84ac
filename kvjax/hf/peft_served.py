"""PEFT's LoRA adapters read unmerged, as kvjax's own adapters of the model, to be served
side by side with others over one base (`model/lora_rows.py`), each adding to its rows what
`merge_peft_adapter` (`peft.py`) merges.

Every module the file adapts gives its targets their pairs, A [in, r] and B [r, out] (a mixture's
experts' A [experts, in, r] and B [experts, r, out]), the module's scale folded into B; a module
the file fuses gives each target its A and its slice of B; every layer gets every target the
file has, at its largest rank, zeros where the file has none. What only merges is refused by
name: an encoder-decoder's adapters and latent attention's down projections.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from kvjax.model import TransformerConfig
from kvjax.model import lora as L

from . import peft_experts, peft_latent, peft_seq2seq
from .errors import UnsupportedModelError
from .peft import output_widths, read_pairs
from .peft_modules import (
    adapts_layer,
    layer_config,
    module_key,
    reorders,
    rows_in_kvjax_order,
)
from .weights import LAYOUTS


def peft_adapters(config: TransformerConfig, model_type: str, directory: str | os.PathLike
                  ) -> tuple[dict, L.LoRA]:
    """The PEFT LoRA adapter in `directory` as kvjax's own adapters of the model's unrolled
    layers (`model.lora`'s tree, A [in, r] and B [r, out] per target), unmerged, with the
    `LoRA` they are read with: each module's scale is folded into its B (the LoRA's scale
    is 1), a module the file fuses gives each of kvjax's targets its A and its slice of B,
    and every layer gets every target, at the largest rank, zeros where the file has none.
    Served so (`model.lora_rows`), it adds what `merge_peft_adapter` merges."""
    directory = Path(directory)
    if LAYOUTS.get(model_type) in peft_seq2seq.LAYOUTS:
        raise UnsupportedModelError(f"{directory}: adapters of a {model_type} model (an "
                                    "encoder-decoder) are merged, not served beside others "
                                    "(--lora DIR merges one)")
    scale_of, modules, pairs = read_pairs(config, model_type, directory)
    layout = LAYOUTS[model_type]
    found: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
    by_expert: dict[tuple[int, str], dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    for layer, module, a, b, name in pairs:
        scale = scale_of(a.shape[0], module_key(name))
        if module in peft_experts.wrappers(layout):  # [experts, in, r] and [experts, r, out]
            found.update({(layer, target): pair for target, pair in peft_experts.kvjax_pairs(
                config, layout, a, b, scale_of, module_key(name), name).items()})
            continue
        one_expert = peft_experts.per_expert(layout, module, config.num_experts)
        if one_expert:
            expert, target = one_expert
            by_expert.setdefault((layer, target), {})[expert] = peft_experts.expert_pair(
                config, target, a, b, scale, name)
            continue
        targets, widths_of = modules[module], layer_config(config, layer)
        if layout == peft_latent.LAYOUT:
            if not targets:
                raise UnsupportedModelError(f"{directory}: adapters of latent attention's "
                                            f"{module} are merged, not served beside others "
                                            "(--lora DIR merges one)")
            lora_a, lora_b = peft_latent.kvjax_pair(widths_of, module, a,
                                                scale * b.astype(np.float32), name)
            widths = [L.widths(widths_of, target)[1] for target in targets]
            for target, piece in zip(targets, np.split(lora_b, np.cumsum(widths)[:-1], axis=1),
                                     strict=True):
                found[layer, target] = (lora_a, piece)
            continue
        rows = scale * b.astype(np.float32)
        if reorders(config, model_type, module):
            rows = rows_in_kvjax_order(config, model_type, module, rows, name)
        widths = output_widths(widths_of, targets, (a.shape[1], rows.shape[0]), name)
        pieces = np.split(rows, np.cumsum(widths)[:-1], axis=0)
        for target, piece in zip(targets, pieces, strict=True):
            found[layer, target] = (a.astype(np.float32).T, piece.T)
    for (layer, target), held in by_expert.items():  # each expert's own pair, stacked
        found[layer, target] = _stacked(config, target, held)
    rank = max(a.shape[-1] for a, _ in found.values())
    targets = tuple(t for t in L.TARGETS if any(target == t for _, target in found))
    adapters: dict = {}
    for layer in range(config.num_decoder_layers):
        for target in targets:
            if target in L.MIXTURE_TARGETS and not adapts_layer(config, (target,), layer):
                continue  # a layer without a router or shared expert (a dense one)
            a, b = found.get((layer, target)) or _no_pair(config, layer, target)
            L._set(adapters, ("layers", str(layer), target),
                   {"lora_a": _pad_axis(a, -1, rank), "lora_b": _pad_axis(b, -2, rank)})
    return adapters, L.LoRA(rank, float(rank), targets)


def _no_pair(config: TransformerConfig, layer: int, target: str):
    """A pair of rank 0 for a target the file leaves out of a layer."""
    in_width, out_width = L.widths(layer_config(config, layer), target)
    # A target that is no module of the layer's own is its experts' kernel.
    lead = () if adapts_layer(config, (target,), layer) else (config.num_experts,)
    return (np.zeros((*lead, in_width, 0), np.float32),
            np.zeros((*lead, 0, out_width), np.float32))


def _stacked(config: TransformerConfig, target: str, held: dict[int, tuple]):
    """Each expert's pair (A [in, r], B [r, out]) of `held` as the experts' A [experts, in, r]
    and B [experts, r, out] at the largest rank, zeros for the experts it lacks."""
    rank = max(a.shape[1] for a, _ in held.values())
    in_width, out_width = L.widths(config, target)
    experts_a = np.zeros((config.num_experts, in_width, rank), np.float32)
    experts_b = np.zeros((config.num_experts, rank, out_width), np.float32)
    for expert, (a, b) in held.items():
        experts_a[expert, :, :a.shape[1]], experts_b[expert, :b.shape[0]] = a, b
    return experts_a, experts_b


def _pad_axis(x: np.ndarray, axis: int, size: int) -> np.ndarray:
    """`x` padded with zeros at the end of `axis` to `size` (a rank: zeros add nothing)."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return np.pad(x, pad)
