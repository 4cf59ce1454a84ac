"""PEFT's adapters of an encoder-decoder (Marian, T5, mT5): merged as they load.

PEFT names the modules of Marian's layers under `model.encoder.layers.<i>` and
`model.decoder.layers.<i>` (self_attn.{q,k,v,out}_proj, fc1 and fc2, and in the decoder's
layers encoder_attn.{q,k,v,out}_proj, the cross-attention: PEFT's default targets, q_proj
and v_proj, adapt both attentions), and T5's under `encoder.block.<i>.layer` and
`decoder.block.<i>.layer` (0.SelfAttention.{q,k,v,o}, the decoder's 1.EncDecAttention.{q,k,v,o},
and the last layer's DenseReluDense.{wi,wo}, or wi_0 (activated) and wi_1 (the linear half)
of a gated FFN: PEFT's default targets, q and v, adapt both attentions too). Each pair's
update, scale · Aᵀ Bᵀ [in, out], is added to the kernel kvjax holds that module in: the
self-attention's and FFN's of `encoder_layers` and `decoder_layers`, the cross-attention's
query and output under `decoder_layers/<i>/cross_attention`, and its keys and values, which
kvjax computes once from the encoder's output, in `cross_kv/<i>/kv` (every key head, then
every value head).

kvjax's own LoRA adapters leave cross-attention as it is (`model/lora.py`), so these are
merged into the model, not served beside other adapters. The other way, `peft_tensors`
writes kvjax's adapters (of both stacks' self-attention and FFN) under these names.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from kvjax.model import TransformerConfig
from kvjax.model.config_checks import GATED_ACTIVATIONS

from .peft_modules import add_to_kernel, module_key


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where an encoder-decoder's adapted modules are: `tensor` matches an adapter's tensor
    name as (encoder or decoder, layer, module, A or B); `modules[part]` maps a module to
    (where its kernel is in a layer, which block of heads it is, or None: all of it)."""

    tensor: re.Pattern
    modules: dict[str, dict[str, tuple[str, int | None]]]


_MARIAN_SELF = {"self_attn.q_proj": ("self_attention/qkv", 0),
                "self_attn.k_proj": ("self_attention/qkv", 1),
                "self_attn.v_proj": ("self_attention/qkv", 2),
                "self_attn.out_proj": ("self_attention/out", None),
                "fc1": ("ffn/wi", None), "fc2": ("ffn/wo", None)}
_MARIAN_CROSS = {"encoder_attn.q_proj": ("cross_attention/query", None),
                 "encoder_attn.k_proj": ("kv", 0), "encoder_attn.v_proj": ("kv", 1),
                 "encoder_attn.out_proj": ("cross_attention/out", None)}


def _t5_ffn(layer: int) -> dict[str, tuple[str, int | None]]:
    return {f"{layer}.DenseReluDense.wi": ("ffn/wi", None),
            f"{layer}.DenseReluDense.wi_0": ("ffn/wi", None),
            f"{layer}.DenseReluDense.wi_1": ("ffn/wi_gate", None),
            f"{layer}.DenseReluDense.wo": ("ffn/wo", None)}


_T5_SELF = {"0.SelfAttention.q": ("self_attention/qkv", 0),
            "0.SelfAttention.k": ("self_attention/qkv", 1),
            "0.SelfAttention.v": ("self_attention/qkv", 2),
            "0.SelfAttention.o": ("self_attention/out", None)}
_T5_CROSS = {"1.EncDecAttention.q": ("cross_attention/query", None),
             "1.EncDecAttention.k": ("kv", 0), "1.EncDecAttention.v": ("kv", 1),
             "1.EncDecAttention.o": ("cross_attention/out", None)}

# Per layout of the weight files (`weights.LAYOUTS`).
LAYOUTS = {
    "marian": Layout(re.compile(r"^(?:base_model\.model\.)?model\.(encoder|decoder)\.layers\."
                                r"(\d+)\.(.+)\.lora_([AB])\.weight$"),
                     {"encoder": _MARIAN_SELF, "decoder": {**_MARIAN_SELF, **_MARIAN_CROSS}}),
    "t5": Layout(re.compile(r"^(?:base_model\.model\.)?(encoder|decoder)\.block\.(\d+)\.layer\."
                            r"(.+)\.lora_([AB])\.weight$"),
                 {"encoder": {**_T5_SELF, **_t5_ffn(1)},
                  "decoder": {**_T5_SELF, **_T5_CROSS, **_t5_ffn(2)}}),
}


def locate(layout: str, model_type: str, config: TransformerConfig, directory, name: str
           ) -> tuple[tuple[str, int], str, str]:
    """((part, layer), module, "A" or "B") of an adapter's tensor `name`, or ValueError
    naming it when it adapts nothing kvjax merges."""
    modules = LAYOUTS[layout].modules
    match = LAYOUTS[layout].tensor.match(name)
    layers = {"encoder": config.num_encoder_layers, "decoder": config.num_decoder_layers}
    if match is None or match[3] not in modules[match[1]] or int(match[2]) >= layers[match[1]]:
        cross = sorted(set(modules["decoder"]) - set(modules["encoder"]))
        raise ValueError(f"{directory}: tensor {name} adapts no module kvjax merges into a "
                         f"{model_type} model (its encoder's and decoder's "
                         f"{', '.join(modules['encoder'])}, the decoder's {', '.join(cross)})")
    return (match[1], int(match[2])), match[3], match[4]


def merged(layout: str, config: TransformerConfig, params: dict, pairs, scale_of) -> dict:
    """`params` (unrolled layers, NumPy arrays) with each pair of `pairs` ((part, layer),
    module, A [r, in], B [out, r], the name of B) merged into its kernel, kept in its dtype;
    new arrays, the loaded ones left as they are."""
    merged = {**params, **{stack: {i: dict(layer) for i, layer in params[stack].items()}
                           for stack in ("encoder_layers", "decoder_layers", "cross_kv")}}
    n, h, d, f = config.num_heads, config.head_dim, config.d_model, config.d_ff
    for (part, layer), module, a, b, name in pairs:
        place, block = LAYOUTS[layout].modules[part][module]
        update = scale_of(a.shape[0], module_key(name)) * (a.astype(np.float32).T @
                                                              b.astype(np.float32).T)
        want = {"ffn/wi": (d, f), "ffn/wi_gate": (d, f), "ffn/wo": (f, d)}.get(
            place, (n * h, d) if place.endswith("/out") else (d, n * h))
        if update.shape != want:
            raise ValueError(f"tensor {name} makes an update of {list(update.shape)}; the "
                             f"model's {part} {module} takes {want[0]} inputs to {want[1]} "
                             "outputs")
        stack = "cross_kv" if place == "kv" else f"{part}_layers"
        node = merged[stack][str(layer)]
        for key in place.split("/"):  # an ungated FFN has no wi_1 to adapt
            if key not in node:
                raise ValueError(f"tensor {name} adapts {module}, which the model has not")
            node = node[key]
        add_to_kernel(merged[stack][str(layer)], (*place.split("/"), "kernel"), update,
                      ... if block is None else (slice(None), slice(block * n, (block + 1) * n)))
    return merged


# Where PEFT names a layer of each layout, and where kvjax holds each LoRA target's kernel.
_LAYER_NAMES = {"marian": "model.{part}.layers.{layer}", "t5": "{part}.block.{layer}.layer"}
_TARGET_PLACES = {"q": ("self_attention/qkv", 0), "k": ("self_attention/qkv", 1),
                  "v": ("self_attention/qkv", 2), "o": ("self_attention/out", None),
                  "wi": ("ffn/wi", None), "wi_gate": ("ffn/wi_gate", None),
                  "wo": ("ffn/wo", None)}


def peft_tensors(layout: str, config: TransformerConfig, adapters: dict, targets: tuple[str, ...]
                 ) -> tuple[dict[str, np.ndarray], list[str]]:
    """(a PEFT file's tensors, its target modules) of kvjax's LoRA adapters of an
    encoder-decoder (`encoder_layers` and `decoder_layers`, unrolled): each target's A [in, r]
    and B [r, out] as the module's lora_A [r, in] and lora_B [out, r], its heads in the
    file's order already. Target modules are named by their ends (`self_attn.q_proj`,
    `SelfAttention.q`), which the cross-attention's names do not share."""
    tensors: dict[str, np.ndarray] = {}
    modules = set()
    for part in ("encoder", "decoder"):
        for target in targets:
            module = _module_of(layout, part, target, config.activation in GATED_ACTIVATIONS)
            for layer, pair in sorted(adapters[f"{part}_layers"].items(),
                                      key=lambda item: int(item[0])):
                name = (f"base_model.model.{_LAYER_NAMES[layout].format(part=part, layer=layer)}"
                        f".{module}")
                for matrix, key in (("A", "lora_a"), ("B", "lora_b")):
                    tensors[f"{name}.lora_{matrix}.weight"] = np.ascontiguousarray(
                        np.asarray(pair[target][key], np.float32).T)
            modules.add(module.split(".", 1)[1] if module[0].isdigit() else module)
    return tensors, sorted(modules)


def _module_of(layout: str, part: str, target: str, gated: bool) -> str:
    """The module of `part`'s layers that holds `target`: T5's gated FFN has wi_0 (activated)
    where an ungated one has wi."""
    named = [module for module, place in LAYOUTS[layout].modules[part].items()
             if place == _TARGET_PLACES[target]]
    if len(named) > 1:
        named = [module for module in named if module.endswith("wi_0") == gated]
    return named[0]
