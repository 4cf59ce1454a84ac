"""Several LoRA adapters in one batch: each row adds its own adapter's update, unmerged.

A server that keeps one base model and many adapters (one per customer or task) cannot merge
them into its kernels, since every row of a decode step may ask for another. Each layer
instead computes x W as it would, plus x A_b B_b for row b's pair of each target (an adapter
that lacks the target, or row index 0, "no adapter", adds zeros).

`stack` puts n adapters side by side (`AdapterStack`): for each target, A [..., in, n·r] and
B [..., n·r, out], the j-th adapter's pair (from 0) in columns (rows) j·r to (j + 1)·r, its
scale (alpha / r) folded into its B, ranks padded with zeros to the largest (which adds
exact zeros), zeros where an adapter lacks the target. A stack may hold empty slots, which
`put` fills (or empties again) while it is served: its shapes never change, so neither do
the programs that read it. `for_rows(stack, adapter_B)` is the
variable collection `COLLECTION` that `model.interface` hands the layers beside their
params: under each layer's `self_attention` or `ffn` scope, per target, the stack's pair and
`rows` [..., B, n·r], 1 over the columns of row b's adapter (none for 0, "no adapter"), 0
elsewhere. A layer then adds ((x A) · rows) B: two products whose inner width is n·r, each
reading the stack once whatever the batch (a gather of each row's pair would read it once
per row). Layers without the collection compute what they always have; a row without an
adapter adds exact zeros.

Targets are those of `model/lora.py`. A mixture's experts' pairs, A [..., experts, in, n·r] and
B [..., experts, n·r, out], sit under its `experts` scope: each token adds, for each expert it
goes through, that expert's pair of its row's adapter (`expert_pairs`, `model/experts.py`).
A shared expert's FFN reads its pairs under its own scope as any FFN does (shared_wi as
`wi`, ...), and the mixture its router's and the shared expert's gate's (router,
shared_expert_gate) under `ffn`.
Latent attention's (`model/latent_attention.py`) sit under its `latent` scope: q adds to the
queries; k and v, which adapt `kv_up`, add to the keys and values a prefill expands from the
latent rows, and in a decode step, which reads the latent rows themselves, to what the
queries take from the key half (`absorbed_update`) and the values from the value half
(`headwise_update`).
Shape letters (docs/shapes.md): B rows, T tokens, N heads; the rank r and a kernel's input
and output widths (per head beside N) are written out, as in `model/lora.py`.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from . import lora as L
from .config import TransformerConfig

COLLECTION = "adapters"


@flax.struct.dataclass
class AdapterStack:
    """n adapters side by side. `pairs` maps (layer path..., module, target) to
    {"a": [..., in, n·r], "b": [..., n·r, out]}, nested as the params are."""

    pairs: dict
    count: int = flax.struct.field(pytree_node=False)
    rank: int = flax.struct.field(pytree_node=False)


@flax.struct.dataclass
class RowAdapters:
    """A batch's adapters: the stack, and each prompt's index in it [B] (0: none). A
    prompt's rows (its samples, or its beams) follow one another and share its adapter."""

    stack: AdapterStack
    adapter_B: jax.Array

    def collection(self, rows: int) -> dict:
        """`for_rows` for `rows` rows, `rows // B` of each prompt in turn."""
        prompts = self.adapter_B.shape[0]
        return for_rows(self.stack, jnp.repeat(self.adapter_B, rows // prompts,
                                               total_repeat_length=rows))


def collection_of(row_adapters: RowAdapters | None, rows: int) -> dict | None:
    return None if row_adapters is None else row_adapters.collection(rows)


def for_prompts(adapter_stack: AdapterStack | None, adapter, prompts: int) -> RowAdapters | None:
    """`adapter` (one index, or one per prompt; 0: none) of `adapter_stack` for a batch of
    `prompts`, checked: a ValueError names an index the stack does not hold."""
    if adapter_stack is None:
        if not (isinstance(adapter, (int, np.integer)) and adapter == 0):
            raise ValueError(f"adapter={adapter!r} needs adapters (a lora_rows.AdapterStack)")
        return None
    if not isinstance(adapter_stack, AdapterStack):
        raise ValueError(f"adapters must be a lora_rows.AdapterStack, got "
                         f"{type(adapter_stack).__name__}")
    indices = ([adapter] * prompts if isinstance(adapter, (int, np.integer))
               else list(adapter))
    if len(indices) != prompts:
        raise ValueError(f"adapter has {len(indices)} entries for {prompts} prompts")
    for i, index in enumerate(indices):
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not (
                0 <= index <= adapter_stack.count):
            raise ValueError(f"adapter {index!r} (prompt {i}) is not among the "
                             f"{adapter_stack.count} adapters of the stack (0: none)")
    return RowAdapters(adapter_stack, jnp.asarray(indices, jnp.int32))


def stack(config: TransformerConfig, params, adapters: Sequence[tuple[dict, L.LoRA]], *,
          capacity: int | None = None, rank: int | None = None,
          targets: Sequence[str] | None = None) -> AdapterStack:
    """The adapters (each `(adapters, lora)`, trained on `params`) side by side, float32, in
    slots 1, 2, ... of a stack of `capacity` slots (default: one per adapter). Slots past
    them add nothing until `put` fills them; `rank` (default: the largest given) and
    `targets` (default: what the adapters given adapt) bound what `put` can place later."""
    given = list(adapters)
    if not given and capacity is None:
        raise ValueError("stack takes at least one adapter, or a capacity of empty slots")
    capacity = len(given) if capacity is None else capacity
    if not isinstance(capacity, int) or capacity < max(1, len(given)):
        raise ValueError(f"capacity={capacity!r} must be an int >= 1 and hold the "
                         f"{len(given)} adapters given")
    rank = max((lora.rank for _, lora in given), default=0) if rank is None else rank
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank={rank!r} must be an int >= 1 (or adapters given to take it from)")
    if targets is None:
        targets = [t for t in L.TARGETS if any(t in lora.targets for _, lora in given)]
    pairs: dict = {}
    for path, target, kernel in L.sites(config, params, L.LoRA(rank, targets=tuple(targets))):
        in_width, out_width, lead = L.site_widths(config, params, path, target, kernel)
        L._set(pairs, (*path, *_served_at(config, params, path, target)),
               {"a": jnp.zeros((*lead, in_width, capacity * rank), jnp.float32),
                "b": jnp.zeros((*lead, capacity * rank, out_width), jnp.float32)})
    adapter_stack = AdapterStack(pairs, capacity, rank)
    for index, adapter in enumerate(given, 1):
        adapter_stack = put(config, params, adapter_stack, index, adapter)
    return adapter_stack


def servable_targets(config: TransformerConfig, params, experts: bool = True
                     ) -> tuple[str, ...]:
    """The targets a stack can hold for this model: the float kernels its layers have; a
    mixture's experts' only with `experts` (a stack for adapters not yet known leaves them
    out: a pair per expert for every slot costs the experts' count times a dense FFN's)."""
    found = []
    for target in L.TARGETS:
        try:
            sites = list(L.sites(config, params, L.LoRA(1, targets=(target,))))
        except ValueError:  # the model has no such kernel (or no float one)
            continue
        if experts or not any(L.in_experts(params, path, name) for path, name, _ in sites):
            found.append(target)
    return tuple(found)


def put(config: TransformerConfig, params, adapter_stack: AdapterStack, index: int,
        adapter: tuple[dict, L.LoRA] | None) -> AdapterStack:
    """`adapter_stack` with slot `index` (1 for the first) holding `adapter` (`(adapters,
    lora)` trained on `params`), or adding nothing for None. The stack keeps its shapes, so
    programs that take it compile nothing new. A ValueError names an adapter the stack
    cannot hold: a larger rank, a target it lacks."""
    count, rank = adapter_stack.count, adapter_stack.rank
    if not isinstance(index, int) or not 1 <= index <= count:
        raise ValueError(f"index={index!r} must be an int from 1 to the stack's {count} slots")
    held = dict(_entries(adapter_stack.pairs))
    chosen: dict[tuple, tuple] = {}
    if adapter is not None:
        tree, lora = adapter
        if lora.rank > rank:
            raise ValueError(f"adapter {index} has rank {lora.rank}, more than the stack's "
                             f"{rank}")
        for path, target, _ in L.sites(config, params, lora):
            where = (*path, *_served_at(config, params, path, target))
            if where not in held:
                have = sorted({_target_at(w) for w in held}, key=L.TARGETS.index)
                raise ValueError(f"adapter {index} adapts {target!r}, which the stack does not "
                                 f"hold (its targets: {', '.join(have) or 'none'})")
            pair = L.get(tree, (*path, target))
            a = jnp.asarray(pair["lora_a"], jnp.float32)
            b = jnp.asarray(pair["lora_b"], jnp.float32) * lora.scale  # scale folded in
            pad = rank - lora.rank  # zero columns of A and rows of B add exact zeros
            chosen[where] = (jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)]),
                             jnp.pad(b, [(0, 0)] * (b.ndim - 2) + [(0, pad), (0, 0)]))
    columns = slice((index - 1) * rank, index * rank)
    pairs: dict = {}
    for where, pair in held.items():
        a, b = chosen.get(where, (0.0, 0.0))
        L._set(pairs, where, {"a": pair["a"].at[..., columns].set(a),
                              "b": pair["b"].at[..., columns, :].set(b)})
    return AdapterStack(pairs, count, rank)


def _served_at(config: TransformerConfig, params, path: tuple[str, ...], target: str
               ) -> tuple[str, ...]:
    """Where, within the layer at `path`, `target`'s pair is read: the scope of the module that
    reads it (latent attention's `latent` within `self_attention`, a mixture's `experts`
    within `ffn`, its shared expert's FFN), then the name it reads it under (the target's;
    within a shared expert, the kernel's, as an FFN reads its own)."""
    if L.in_experts(params, path, target):
        return ("ffn", "experts", target)
    if target in L.MIXTURE_TARGETS:
        return L.MIXTURE_TARGETS[target]
    kernel = L.kernel_path(config, target)
    return (*kernel[:-1], target) if L.is_latent_target(config, target) else \
        (kernel[0], target)


def _target_at(where: tuple[str, ...]) -> str:
    """The target whose pair a stack holds at `where` (the inverse of `_served_at`)."""
    for target, served in L.MIXTURE_TARGETS.items():
        if where[-len(served):] == served:
            return target
    return where[-1]


def _entries(pairs: dict, path: tuple[str, ...] = ()):
    """(path, {"a", "b"}) of each target the stack holds."""
    for key, value in pairs.items():
        if "a" in value:
            yield (*path, key), value
        else:
            yield from _entries(value, (*path, key))


def for_rows(adapter_stack: AdapterStack | None, adapter_B) -> dict | None:
    """The collection that gives row b adapter `adapter_B[b]` (1 for the stack's first, 0:
    none; an index past the stack adds nothing either); None for no stack."""
    if adapter_stack is None:
        return None
    adapter_B = jnp.asarray(adapter_B, jnp.int32)
    chosen = adapter_B[:, None] == jnp.arange(1, adapter_stack.count + 1)[None]
    rows = jnp.repeat(chosen.astype(jnp.float32), adapter_stack.rank, axis=1)

    def with_rows(path, pair):  # `rows` broadcast over a scanned stack's leading layer axis
        experts = any(getattr(key, "key", None) == "experts" for key in path)
        lead = pair["a"].shape[:-3 if experts else -2]  # not over a mixture's experts axis
        return {**pair, "rows": jnp.broadcast_to(rows, (*lead, *rows.shape))}

    return jax.tree_util.tree_map_with_path(with_rows, adapter_stack.pairs,
                                            is_leaf=lambda x: isinstance(x, dict) and "a" in x)


def placed(adapter_stack: AdapterStack | None, mesh=None) -> AdapterStack | None:
    """The stack whole on every device of `mesh` (as it is without one), where programs
    beside params split over that mesh read it."""
    if adapter_stack is None or mesh is None:
        return adapter_stack
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.device_put(adapter_stack, whole)


def update(module, target: str, inputs):
    """Row b's x A_b B_b [B, T, out] of `target` in `module`'s scope, or None without it."""
    if not module.has_variable(COLLECTION, target):
        return None
    pair = module.get_variable(COLLECTION, target)
    dtype = inputs.dtype
    low = (inputs @ pair["a"].astype(dtype)) * pair["rows"].astype(dtype)[:, None]
    return low @ pair["b"].astype(dtype)


def expert_pairs(module, tokens_per_row: int) -> dict | None:
    """target -> (A [experts, in, n·r], B [experts, n·r, out], the columns of each token's row's
    adapter [B · T, n·r]) of the stack's pairs in a mixture's `experts` scope, for a call whose
    B rows of `tokens_per_row` (T) tokens each lie side by side; None without any."""
    found = {}
    for target in L.EXPERT_TARGETS:
        if module.has_variable(COLLECTION, target):
            pair = module.get_variable(COLLECTION, target)
            found[target] = (pair["a"], pair["b"],
                             jnp.repeat(pair["rows"], tokens_per_row, axis=0))
    return found or None


def headwise_update(module, target: str, inputs):
    """Row b's update of `target` [B, T, N, out] where each head n reads its own inputs
    x[:, :, n] through the A B [in, N · out] (a head's slice of B), or None without it."""
    if not module.has_variable(COLLECTION, target):
        return None
    pair = module.get_variable(COLLECTION, target)
    dtype, heads = inputs.dtype, inputs.shape[2]
    low = (inputs @ pair["a"].astype(dtype)) * pair["rows"].astype(dtype)[:, None, None]
    b_heads = pair["b"].astype(dtype).reshape(pair["b"].shape[0], heads, -1)
    return jnp.einsum("btnr,rno->btno", low, b_heads)


def absorbed_update(module, target: str, inputs):
    """Row b's x (A_b B_b)ᵀ per head [B, T, N, in] of `target`, whose update [in, N · out] gives
    each head `out` outputs: what the update adds to x's product with the kernel's transpose,
    head by head (a query taken through kv_up's key half), or None without it."""
    if not module.has_variable(COLLECTION, target):
        return None
    pair = module.get_variable(COLLECTION, target)
    dtype, heads = inputs.dtype, inputs.shape[2]
    b_heads = pair["b"].astype(dtype).reshape(pair["b"].shape[0], heads, -1)
    low = jnp.einsum("btno,rno->btnr", inputs, b_heads) * pair["rows"].astype(dtype)[:, None,
                                                                                  None]
    return low @ pair["a"].astype(dtype).T


def add_qkv_updates(module, config: TransformerConfig, x_BTD, qkv_BTFH):
    """The fused qkv projection [B, T, N + 2K, H] plus each row's q, k and v updates."""
    for target in ("q", "k", "v"):
        delta = update(module, target, x_BTD)
        if delta is not None:
            start, width = L.qkv_heads(config, target)
            delta = delta.reshape(*delta.shape[:2], width, config.head_dim)
            qkv_BTFH = qkv_BTFH.at[:, :, start:start + width].add(delta.astype(qkv_BTFH.dtype))
    return qkv_BTFH


def add_update(module, target: str, inputs, outputs):
    """y [B, T, out] (or [B, T, N, out/N]) plus each row's update of `target` from x [B, T, in]
    (or y as it is)."""
    delta = update(module, target, inputs.reshape(*inputs.shape[:2], -1))
    if delta is None:
        return outputs
    return outputs + delta.reshape(outputs.shape).astype(outputs.dtype)
