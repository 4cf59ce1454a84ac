"""PEFT's adapters of a mixture's experts: merged as they load, and written from kvjax's.

transformers holds a layer's experts as two stacked parameters, which PEFT adapts through
`target_parameters`: `mlp.experts.gate_up_proj` [experts, 2F, D], the gates' rows then the
ups', and `mlp.experts.down_proj` [experts, D, F] (Granite's under `block_sparse_moe`);
gpt-oss's transposed, [experts, D, 2F] with a gate column then an up column in turn, and
[experts, F, D]. PEFT gives each a pair per expert, held as A [experts · r, in] (expert e's
rows e·r to e·r + r) and B [out, r · experts] (expert e's columns e, e + experts, ...), the
update to expert e's [in, out] being scale · Aₑᵀ Bₑᵀ, whichever way the parameter is held.
The experts' module is wrapped once for each adapted parameter, so its tensors are named
`mlp.experts` and `mlp.experts.base_layer`; which parameter a pair adapts, its shapes tell.

kvjax holds a pair per expert for each of wi (the gates), wi_gate (the ups) and wo
(`model/lora.py`). Written, gate_up_proj takes wi's and wi_gate's A stacked and their B on
the gate and up outputs; both parameters get one rank, PEFT's `r` (its `rank_pattern`
names modules, the attention's), padded with zeros, and B is scaled so that lora_alpha over
that rank stays the run's scale.
"""

from __future__ import annotations

import re

import numpy as np

from kvjax.model import TransformerConfig
from kvjax.model import lora as L

from .peft_modules import add_to_kernel

PARAMS = ("experts.gate_up_proj", "experts.down_proj")
PARAM_NAMES = tuple(param.split(".")[-1] for param in PARAMS)  # as target_parameters may
# The layouts (`weights.LAYOUTS`) whose experts' module transformers names otherwise than
# `mlp.experts`, and those whose gate_up_proj interleaves the gates' and ups' outputs.
_EXPERTS_MODULE = {"granitemoe": "block_sparse_moe.experts",
                   "granite_shared": "block_sparse_moe.experts"}
_INTERLEAVED = ("gpt_oss",)
# transformers before 5.0 held each expert as Linears of its own, and an adapter trained then
# adapts them one by one: where they are, and their names for wi, wi_gate and wo. gpt-oss's
# and Granite's experts were stacked then too.
_PER_EXPERT = {"mixtral": ("block_sparse_moe.experts", ("w1", "w3", "w2"))}
_PER_EXPERT_DEFAULT = ("mlp.experts", ("gate_proj", "up_proj", "down_proj"))
_STACKED_BEFORE_5 = ("gpt_oss", "granitemoe", "granite_shared")


def module(layout: str) -> str:
    """Where transformers holds a layer's experts, after the layer's prefix."""
    return _EXPERTS_MODULE.get(layout, "mlp.experts")


def wrappers(layout: str) -> dict[str, tuple[str, ...]]:
    """The module names PEFT gives the experts' pairs (no kvjax target of their own)."""
    return {module(layout): (), f"{module(layout)}.base_layer": ()}


def per_expert(layout: str, module: str, experts: int) -> tuple[int, str] | None:
    """(expert, kvjax target) of a module of one expert (`mlp.experts.3.gate_proj`), as an
    adapter trained before transformers 5.0 names it; None for any other module."""
    if layout in _STACKED_BEFORE_5:
        return None
    under, names = _PER_EXPERT.get(layout, _PER_EXPERT_DEFAULT)
    match = re.fullmatch(rf"{re.escape(under)}\.(\d+)\.(\w+)", module)
    if match is None or match[2] not in names or int(match[1]) >= experts:
        return None
    return int(match[1]), L.EXPERT_TARGETS[names.index(match[2])]


def expert_pair(config: TransformerConfig, target: str, peft_a: np.ndarray, peft_b: np.ndarray,
                scale: float, name: str) -> tuple[np.ndarray, np.ndarray]:
    """One expert's module's A [r, in] and B [out, r] as kvjax's A [in, r] and B [r, out], the
    scale folded into B, its widths checked against an expert's `target`."""
    d, f = config.d_model, config.d_ff
    want = (f, d) if target == "wo" else (d, f)
    if (peft_a.shape[1], peft_b.shape[0]) != want:
        raise ValueError(f"tensor {name} makes an update of {[peft_a.shape[1], peft_b.shape[0]]}; "
                         f"an expert's {target} takes {want[0]} inputs to {want[1]} outputs")
    return peft_a.astype(np.float32).T, scale * peft_b.astype(np.float32).T


def add_to_expert(config: TransformerConfig, layer: dict, expert: int, target: str,
                  lora_a: np.ndarray, lora_b: np.ndarray, name: str) -> None:
    """One expert's pair (`expert_pair`) added to its slice of `layer`'s experts' kernel (new
    arrays): wi and wi_gate [D, experts, F], wo [experts, F, D]."""
    if "experts" not in layer.get("ffn", {}):
        raise ValueError(f"tensor {name} adapts an expert of a layer that has none (a dense "
                         "FFN)")
    add_to_kernel(layer, ("ffn", "experts", target), lora_a @ lora_b,
                  expert if target == "wo" else (slice(None), expert))


def _gate_and_up(layout: str, f: int) -> tuple[slice, slice]:
    """The gate_up_proj outputs of the gates (wi) and of the ups (wi_gate)."""
    if layout in _INTERLEAVED:
        return slice(0, None, 2), slice(1, None, 2)
    return slice(0, f), slice(f, 2 * f)


def kvjax_pairs(config: TransformerConfig, layout: str, peft_a: np.ndarray, peft_b: np.ndarray,
                scale_of, key: str, name: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A PEFT pair over the stacked experts' parameters, A [experts · r, in] and B [out,
    r · experts], as kvjax's adapters of the targets it adapts, target -> (A [experts, in, r],
    B [experts, r, out], the scale folded into B): gate_up_proj's wi (its gate outputs) and
    wi_gate (its up outputs), sharing A; down_proj's wo. `key` names the wrapped experts'
    module (PEFT's key, `base_layer`s included); which parameter the pair adapts, and so its
    scale `scale_of(rank, key)`, its shapes tell."""
    experts, d, f = config.num_experts, config.d_model, config.d_ff
    if peft_a.ndim != 2 or peft_b.ndim != 2 or peft_a.shape[0] != peft_b.shape[1] \
            or peft_a.shape[0] % experts:
        raise ValueError(f"tensor {name} and its lora_A are not the [out, r · {experts}] and "
                         f"[{experts} · r, in] of one rank over {experts} experts")
    rank = peft_a.shape[0] // experts
    experts_a = peft_a.astype(np.float32).reshape(experts, rank, -1).transpose(0, 2, 1)
    experts_b = peft_b.astype(np.float32).reshape(peft_b.shape[0], rank, experts).transpose(2, 1, 0)
    gates, ups = _gate_and_up(layout, f)
    shape = (experts_a.shape[1], experts_b.shape[2])
    if shape == (d, 2 * f):
        param, pairs = PARAMS[0], {"wi": experts_b[..., gates], "wi_gate": experts_b[..., ups]}
    elif shape == (f, d):
        param, pairs = PARAMS[1], {"wo": experts_b}
    else:
        raise ValueError(f"tensor {name} makes an update of {[experts, *shape]}; the experts "
                         f"take [{experts}, {d}, {2 * f}] (gate_up_proj) or [{experts}, {f}, "
                         f"{d}] (down_proj)")
    while key.endswith(".base_layer"):
        key = key.removesuffix(".base_layer")
    scale = scale_of(rank, f"{key}.{param.split('.')[-1]}")
    return {target: (experts_a, scale * b) for target, b in pairs.items()}


def add_to_experts(config: TransformerConfig, layout: str, layer: dict, a, b, scale_of,
                   key: str, name: str) -> None:
    """A pair's update (`kvjax_pairs`) added to `layer`'s experts (new arrays)."""
    if "experts" not in layer.get("ffn", {}):
        raise ValueError(f"tensor {name} adapts experts of a layer that has none (a dense "
                         "FFN)")
    for target, (experts_a, experts_b) in kvjax_pairs(config, layout, a, b, scale_of, key,
                                                      name).items():
        delta = experts_a @ experts_b  # [experts, in, out]; wi and wi_gate are [D, experts, F]
        add_to_kernel(layer, ("ffn", "experts", target),
                      delta if target == "wo" else delta.transpose(1, 0, 2))


def peft_tensors(config: TransformerConfig, layout: str, layers: dict, settings: L.LoRA,
                 prefix: str) -> tuple[dict[str, np.ndarray], list[str], int]:
    """(PEFT's tensors of the experts' adapters in `layers` (unrolled), the parameters they
    adapt, their rank); nothing when the experts have none. Layers without experts (a dense
    FFN's adapters) are left to the modules of their FFN."""
    gate_up = [t for t in ("wi", "wi_gate") if t in settings.targets]
    params = [f"{module(layout)}.{p.split('.')[-1]}" for p, on in zip(
        PARAMS, (gate_up, "wo" in settings.targets), strict=True) if on]
    if not params or not config.num_experts:
        return {}, [], 0
    rank = settings.rank * max(len(gate_up), 1)
    # PEFT wraps the parameters in the order of their names, the first one outermost.
    modules = {param: module(layout) + ".base_layer" * i
               for i, param in enumerate(sorted(params))}
    gates, ups = _gate_and_up(layout, config.d_ff)
    tensors = {}
    for index, layer in sorted(layers.items(), key=lambda item: int(item[0])):
        if not any(is_experts_pair(layer.get(t)) for t in L.EXPERT_TARGETS):
            continue
        for param in params:
            pairs = [(layer[t], part) for t, part in (("wi", gates), ("wi_gate", ups))
                     if t in gate_up] if param.endswith(PARAMS[0]) else \
                [(layer["wo"], slice(None))]
            outputs = 2 * config.d_ff if param.endswith(PARAMS[0]) else config.d_model
            peft_a, peft_b = _pair(pairs, rank, settings, outputs)
            name = f"base_model.model.{prefix}.{index}.{modules[param]}"
            tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"] = peft_a, peft_b
    return tensors, params, rank


def _pair(pairs, rank: int, settings: L.LoRA, outputs: int) -> tuple[np.ndarray, np.ndarray]:
    """One parameter's A [experts · rank, in] and B [`outputs`, rank · experts] from kvjax's
    pairs (A [experts, in, r], B [experts, r, out]), each with the output columns it adapts."""
    experts, inputs, r = np.shape(pairs[0][0]["lora_a"])
    a_by_expert = np.zeros((experts, rank, inputs), np.float32)
    b_by_expert = np.zeros((experts, outputs, rank), np.float32)
    for j, (pair, columns) in enumerate(pairs):
        a_by_expert[:, j * r:(j + 1) * r] = np.asarray(pair["lora_a"],
                                                       np.float32).transpose(0, 2, 1)
        b_by_expert[:, columns, j * r:(j + 1) * r] = np.asarray(pair["lora_b"],
                                                           np.float32).transpose(0, 2, 1)
    b_by_expert *= rank / settings.rank  # lora_alpha / rank keeps the run's scale, alpha / r
    return (np.ascontiguousarray(a_by_expert.reshape(experts * rank, inputs)),
            np.ascontiguousarray(b_by_expert.transpose(1, 2, 0).reshape(outputs, rank * experts)))


def is_experts_pair(pair: dict | None) -> bool:
    """Whether a layer's adapters of an FFN target are its experts' (A [experts, in, r]), not
    a dense FFN's (A [in, r])."""
    return pair is not None and np.ndim(pair["lora_a"]) == 3
