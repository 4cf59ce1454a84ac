"""PEFT's adapters of gpt-oss's experts: merged as they load, and written from kvjax's.

PEFT adapts a parameter of stacked experts (`target_parameters`: gpt-oss's
`mlp.experts.gate_up_proj` [experts, D, 2F], a gate column then an up column in turn, and
`mlp.experts.down_proj` [experts, F, D]) with one pair per expert, held as A [experts · r,
in] (expert e's rows e·r to e·r + r) and B [out, r · experts] (expert e's columns e, e +
experts, ...), the update to expert e's [in, out] being scale · Aₑᵀ Bₑᵀ. The experts' module
is wrapped once for each adapted parameter, so its tensors are named `mlp.experts` and
`mlp.experts.base_layer`; which parameter a pair adapts, its shapes tell.

kvjax holds a pair per expert for each of wi (the gates), wi_gate (the ups) and wo
(`model/lora.py`). Written, gate_up_proj takes wi's and wi_gate's A stacked and their B on
the gate and up columns; both parameters get one rank, PEFT's `r` (its `rank_pattern`
names modules, the attention's), padded with zeros, and B is scaled so that lora_alpha over
that rank stays the run's scale.
"""

from __future__ import annotations

import numpy as np

from kvjax.model import TransformerConfig
from kvjax.model import lora as L

PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
WRAPPERS = {"mlp.experts": (), "mlp.experts.base_layer": ()}


def update(a_XI: np.ndarray, b_OX: np.ndarray, experts: int, scale_of, name: str) -> np.ndarray:
    """The update [experts, in, out] of a PEFT pair over a parameter of `experts` experts:
    A [experts · r, in] and B [out, r · experts]."""
    if a_XI.ndim != 2 or b_OX.ndim != 2 or a_XI.shape[0] != b_OX.shape[1] \
            or a_XI.shape[0] % experts:
        raise ValueError(f"tensor {name} and its lora_A are not the [out, r · {experts}] and "
                         f"[{experts} · r, in] of one rank over {experts} experts")
    rank = a_XI.shape[0] // experts
    a_ERI = a_XI.astype(np.float32).reshape(experts, rank, -1)
    b_ORE = b_OX.astype(np.float32).reshape(b_OX.shape[0], rank, experts)
    return scale_of(rank) * np.einsum("ORE,ERI->EIO", b_ORE, a_ERI)


def add_to_experts(config: TransformerConfig, layer: dict, a, b, scale_of, name: str) -> None:
    """A pair's update added to `layer`'s experts (new arrays): gate_up_proj's to wi (its
    gate columns) and wi_gate (its up columns), down_proj's to wo."""
    delta = update(a, b, config.num_experts, scale_of, name)
    d, f = config.d_model, config.d_ff
    ffn = layer["ffn"] = dict(layer["ffn"])
    experts = ffn["experts"] = dict(ffn["experts"])
    parts = {(d, 2 * f): {"wi": delta[..., 0::2].transpose(1, 0, 2),
                          "wi_gate": delta[..., 1::2].transpose(1, 0, 2)},
             (f, d): {"wo": delta}}.get(delta.shape[1:])
    if parts is None:
        raise ValueError(f"tensor {name} makes an update of {list(delta.shape)}; gpt-oss's "
                         f"experts take [{config.num_experts}, {d}, {2 * f}] (gate_up_proj) or "
                         f"[{config.num_experts}, {f}, {d}] (down_proj)")
    for target, piece in parts.items():
        old = experts[target]
        experts[target] = (old.astype(np.float32) + piece).astype(old.dtype)


def peft_tensors(config: TransformerConfig, layers: dict, settings: L.LoRA, prefix: str
                 ) -> tuple[dict[str, np.ndarray], list[str], int]:
    """(PEFT's tensors of the experts' adapters in `layers` (unrolled), the parameters they
    adapt, their rank); nothing when the experts have none."""
    gate_up = [t for t in ("wi", "wi_gate") if t in settings.targets]
    params = [p for p, on in zip(PARAMS, (gate_up, "wo" in settings.targets), strict=True)
              if on]
    if not params:
        return {}, [], 0
    rank = settings.rank * max(len(gate_up), 1)
    # PEFT wraps the parameters in the order of their names, the first one outermost.
    modules = {param: "mlp.experts" + ".base_layer" * i
               for i, param in enumerate(sorted(params))}
    tensors = {}
    for index, layer in sorted(layers.items(), key=lambda item: int(item[0])):
        for param in params:
            pairs = [(layer[t], slice(j, None, 2)) for j, t in enumerate(("wi", "wi_gate"))
                     if t in gate_up] if param == PARAMS[0] else [(layer["wo"], slice(None))]
            outputs = 2 * config.d_ff if param == PARAMS[0] else config.d_model
            a_XI, b_OX = _pair(pairs, rank, settings, outputs)
            name = f"base_model.model.{prefix}.{index}.{modules[param]}"
            tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"] = a_XI, b_OX
    return tensors, params, rank


def _pair(pairs, rank: int, settings: L.LoRA, outputs: int) -> tuple[np.ndarray, np.ndarray]:
    """One parameter's A [experts · rank, in] and B [`outputs`, rank · experts] from kvjax's
    pairs (A [experts, in, r], B [experts, r, out]), each with the output columns it adapts."""
    experts, inputs, r = np.shape(pairs[0][0]["lora_a"])
    a_ERI = np.zeros((experts, rank, inputs), np.float32)
    b_EOR = np.zeros((experts, outputs, rank), np.float32)
    for j, (pair, columns) in enumerate(pairs):
        a_ERI[:, j * r:(j + 1) * r] = np.asarray(pair["lora_a"], np.float32).transpose(0, 2, 1)
        b_EOR[:, columns, j * r:(j + 1) * r] = np.asarray(pair["lora_b"],
                                                           np.float32).transpose(0, 2, 1)
    b_EOR *= rank / settings.rank  # lora_alpha / rank keeps the run's scale, alpha / r
    return (np.ascontiguousarray(a_ERI.reshape(experts * rank, inputs)),
            np.ascontiguousarray(b_EOR.transpose(1, 2, 0).reshape(outputs, rank * experts)))
