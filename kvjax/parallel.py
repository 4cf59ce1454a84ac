"""Many devices: one `jax.sharding.Mesh` with axes `data` and `model`, and where arrays go.

`make_mesh("data=4,model=2")` lays the devices out as a 4 x 2 grid. Batches (training
batches, prompts, the KV cache's rows) are split over `data`; parameters are split over
`model` Megatron-style: the query, key/value and output projections by head, the
feed-forward network by its hidden axis, everything else (embeddings, LayerNorms, output
biases) replicated. The rules go by parameter name (`param_spec`), so they apply unchanged
to the optimizer state, whose moments are trees of the same names, and to the stacked
[L, ...] params of scanned layers. XLA (GSPMD) inserts the collectives; nothing here
writes one by hand.

On a single device the mesh is 1 x 1 and every sharding is a no-op. Tests emulate 8
devices on a CPU with `XLA_FLAGS=--xla_force_host_platform_device_count=8`, set before
JAX starts.

With several processes (`kvjax.distributed.initialize`) the mesh spans every process's
devices, each process's devices side by side on `data`, so that a process holds a
contiguous block of a batch's rows (`local_rows`) and builds only those (`shard_batch`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvjax import model as M

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)

# Param name -> spec of its per-layer dims (trailing dims; scanned layers add a leading L).
# Kernels of the fused projections are [D, heads, H]; the output projection is [N, H, D].
_RULES: dict[tuple[str, str], tuple[str | None, ...]] = {
    ("qkv", "kernel"): (None, MODEL, None),  # [D, N + 2K, H]
    ("qkv", "bias"): (MODEL, None),  # [N + 2K, H]
    ("query", "kernel"): (None, MODEL, None),  # [D, N, H] cross-attention queries
    ("query", "bias"): (MODEL, None),
    ("kv", "kernel"): (None, MODEL, None),  # [D, 2K, H] cross-attention keys and values
    ("kv", "bias"): (MODEL, None),
    ("out", "kernel"): (MODEL, None, None),  # [N, H, D]; its bias [D] is added after the sum
    # Latent attention's projections to every head (`model/latent_attention.py`): [X, N, ...];
    # the latents themselves (q_down, kv_down) are replicated.
    ("q", "kernel"): (None, MODEL, None),
    ("q_up", "kernel"): (None, MODEL, None),
    ("kv_up", "kernel"): (None, MODEL, None),
    ("wi", "kernel"): (None, MODEL),  # [D, F]
    ("wi", "bias"): (MODEL,),  # [F]
    ("wi_gate", "kernel"): (None, MODEL),
    ("wi_gate", "bias"): (MODEL,),
    ("wo", "kernel"): (MODEL, None),  # [F, D]; its bias [D] is added after the sum
    # A mixture of experts' [D, experts, F] and [experts, F, D]: every device holds every
    # expert, a slice of each one's hidden units (the router [D, experts] replicated).
    ("experts", "wi"): (None, None, MODEL),
    ("experts", "wi_gate"): (None, None, MODEL),
    ("experts", "wo"): (None, MODEL, None),
    ("experts", "bi"): (None, MODEL),  # [experts, F]; their output biases [experts, D]
    ("experts", "bi_gate"): (None, MODEL),  # are added after the sum
}


def parse_mesh(text: str) -> dict[str, int]:
    """`"data=4,model=2"` -> `{"data": 4, "model": 2}`; either axis may be left out."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in AXES:
            raise ValueError(f"mesh axis {name!r} in {text!r} is not one of {AXES}")
        if name in sizes:
            raise ValueError(f"mesh axis {name!r} is given twice in {text!r}")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ValueError(f"mesh axis {name!r} needs an integer size, got {value.strip()!r} "
                             f"in {text!r}") from None
        if sizes[name] < 1:
            raise ValueError(f"mesh axis {name}={sizes[name]} must be >= 1")
    if not sizes:
        raise ValueError(f"mesh {text!r} names no axis; write e.g. 'data=4,model=2'")
    return sizes


def make_mesh(spec: str | dict[str, int] | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `data` x `model` mesh over `devices` (default: all of them, every process's).

    `spec` is `"data=N,model=M"` or a dict; a left-out axis takes the devices the other
    leaves (`None`: every device on `data`). Raises a ValueError naming the numbers if the
    mesh asks for more devices than there are or its sizes do not multiply to the count.
    """
    if devices is None:  # each process's devices together, in the order of the processes
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    devices = list(devices)
    sizes = parse_mesh(spec) if isinstance(spec, str) else dict(spec or {})
    count = len(devices)
    for name, size in sizes.items():
        if name not in AXES or size < 1:
            raise ValueError(f"mesh axis {name}={size}: axes are {AXES}, sizes >= 1")
    asked = math.prod(sizes.values())
    if asked > count:
        raise ValueError(f"mesh {_describe(sizes)} needs {asked} devices, but only {count} "
                         f"exist")
    for name, other in ((DATA, MODEL), (MODEL, DATA)):
        if name not in sizes:
            if count % sizes.get(other, 1):
                raise ValueError(f"mesh {other}={sizes[other]} does not divide the {count} "
                                 f"devices")
            sizes[name] = count // sizes.get(other, 1)
    if sizes[DATA] * sizes[MODEL] != count:
        raise ValueError(f"mesh {_describe(sizes)} has {sizes[DATA] * sizes[MODEL]} devices, "
                         f"but there are {count}: the axis sizes must multiply to the count")
    grid = np.array(devices, dtype=object).reshape(sizes[DATA], sizes[MODEL])
    return Mesh(grid, AXES)


def _describe(sizes: dict[str, int]) -> str:
    return ",".join(f"{name}={size}" for name, size in sizes.items())


def check_model_axis(config: M.TransformerConfig, mesh: Mesh) -> None:
    """Raises a ValueError unless `model` divides the heads, kv heads and d_ff."""
    model = mesh.shape[MODEL]
    for name, value in (("num_heads", config.num_heads), ("kv heads", config.kv_heads),
                        ("d_ff", config.d_ff)):
        if value % model:
            raise ValueError(f"mesh axis model={model} does not divide {name}={value}")


def check_batch(batch_size: int, mesh: Mesh) -> None:
    """Raises a ValueError unless `data` divides a training batch of `batch_size` rows."""
    if batch_size % mesh.shape[DATA]:
        raise ValueError(f"batch size {batch_size} is not divisible by the mesh's "
                         f"data={mesh.shape[DATA]} devices")


# Where arrays go ---------------------------------------------------------------------------


def _names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def param_spec(path, shape: Sequence[int]) -> PartitionSpec:
    """The spec of a param (or of an optimizer moment of it) named by its tree `path`."""
    rule = _RULES.get(_names(path)[-2:])
    if rule is None or len(shape) < len(rule):
        return PartitionSpec()
    return PartitionSpec(*(None,) * (len(shape) - len(rule)), *rule)


def state_shardings(tree: Any, mesh: Mesh) -> Any:
    """NamedShardings for a tree of params, optimizer state or a whole training state
    (arrays or `jax.ShapeDtypeStruct`s): named params by `param_spec`, the rest replicated."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, param_spec(path, np.shape(leaf))), tree)


def shard_params(tree: Any, mesh: Mesh) -> Any:
    """`tree` (params, optimizer state, ...) placed on `mesh` by `state_shardings`."""
    return jax.device_put(tree, state_shardings(tree, mesh))


def abstract_on(abstract: Any, mesh: Mesh) -> Any:
    """`jax.ShapeDtypeStruct`s of `abstract` with their `state_shardings` on `mesh`: what a
    checkpoint restore reads to place every array straight onto the mesh."""
    return jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(
        leaf.shape, leaf.dtype, sharding=sharding), abstract, state_shardings(abstract, mesh))


def rows(mesh: Mesh, ndim: int = 1) -> NamedSharding:
    """Arrays whose first axis is the batch: rows split over `data`."""
    return NamedSharding(mesh, PartitionSpec(DATA, *(None,) * (ndim - 1)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def local_rows(batch_size: int, mesh: Mesh) -> slice:
    """The rows of a batch of `batch_size` that this process's devices hold when it is split
    over `data`: all of them with one process. Raises a ValueError if they are not one block
    (a mesh whose `data` axis interleaves processes' devices)."""
    check_batch(batch_size, mesh)
    held = rows(mesh).addressable_devices_indices_map((batch_size,)).values()
    starts = {index[0].indices(batch_size)[:2] for index in held}
    start, stop = min(s for s, _ in starts), max(e for _, e in starts)
    if sum(e - s for s, e in starts) != stop - start:
        raise ValueError(f"process {jax.process_index()}'s devices hold rows {sorted(starts)} "
                         "of a batch, not one block: lay the mesh out with each process's "
                         "devices side by side on data (make_mesh does)")
    return slice(start, stop)


def shard_batch(batch: dict[str, Any], mesh: Mesh) -> dict[str, jax.Array]:
    """A training batch (a dict of [B, ...] arrays) with its rows split over `data`. With
    several processes each passes only its own rows (`local_rows`), the batch is theirs
    together."""
    return {key: jax.make_array_from_process_local_data(rows(mesh, np.ndim(value)), value)
            for key, value in batch.items()}


def constrain_rows(tree: Any, mesh: Mesh | None) -> Any:
    """`tree` (a decode loop's state, its cache inside) held with its rows split over `data`
    and each KV-cache stack's kv heads over `model`; unchanged without a mesh.

    Inside a compiled program this pins the layout of what the decode loop carries from one
    step to the next, so XLA never moves a row to another device between steps. Every array
    with an axis has the batch first, except the K/V stacks [L, B, K, S, H] of a `KVCache`
    and an int8 cache's scales [L, B, K, S]. A paged cache's pools [L, pages, K, U, H] are
    every row's, so only their kv heads are split (over `model`), and its page tables (and
    the rings of its windowed layers) go with their rows. A latent attention cache's one row
    per token (K = 1, every head reads it) is held whole by each device of `model`. A
    dataclass naming `SHARED_BY_ROWS` (the token automata's tables, which every row reads)
    holds those fields whole on every device and its other arrays with their rows.
    """
    if mesh is None:
        return tree

    def stack_spec(a, rows):  # [L, B, K, S, H] (rows DATA) or a pool (rows None), scales
        heads = MODEL if a.shape[2] % mesh.shape[MODEL] == 0 else None
        return PartitionSpec(None, rows, heads)

    def place(leaf):
        if isinstance(leaf, M.KVCache):
            # Per stack: a pool's pages are every row's; a ring (`model/ring.py`) is its rows'.
            rings = leaf.rings or (False,) * len(leaf.k)
            own_rows = tuple(DATA if ring or not leaf.paged else None for ring in rings)
            kv = {name: tuple(jax.tree.map(lambda a, r=r: _constrain(a, mesh, stack_spec(a, r)),
                                           stack)
                              for stack, r in zip(getattr(leaf, name), rows, strict=True))
                  for names, rows in ((("k", "v", "k_scale", "v_scale"), own_rows),
                                      (("cross_k", "cross_v", "cross_k_scale",
                                        "cross_v_scale"), (DATA,) * len(leaf.k)))
                  for name in names if getattr(leaf, name) is not None}
            counters = {name: jax.tree.map(lambda a: _constrain(a, mesh, PartitionSpec(DATA)),
                                           getattr(leaf, name))
                        for name in ("lengths", "overflow", "source_lengths", "pages")}
            return leaf.replace(**kv, **counters)
        if hasattr(leaf, "SHARED_BY_ROWS"):
            return leaf.replace(**{
                name: _constrain(getattr(leaf, name), mesh, PartitionSpec() if name in
                                 leaf.SHARED_BY_ROWS else PartitionSpec(DATA))
                for name in leaf.__dataclass_fields__
                if isinstance(getattr(leaf, name), jax.Array)})
        return _constrain(leaf, mesh, PartitionSpec(DATA) if leaf.ndim else PartitionSpec())

    return jax.tree.map(place, tree, is_leaf=lambda x: isinstance(x, M.KVCache)
                        or hasattr(x, "SHARED_BY_ROWS"))


def keep_rows(tokens_to_logits, mesh: Mesh | None):
    """A decode loop's `tokens_to_logits(tokens, cache) -> (logits, cache)` whose returned
    cache keeps its layout (`constrain_rows`), so a loop's carry stays where it started."""
    if mesh is None:
        return tokens_to_logits

    def step(tokens_BT, cache):
        logits_BTV, cache = tokens_to_logits(tokens_BT, cache)
        return logits_BTV, constrain_rows(cache, mesh)

    return step


def _constrain(x: jax.Array, mesh: Mesh, spec: PartitionSpec) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def mesh_of(tree: Any) -> Mesh | None:
    """The mesh the arrays of `tree` are sharded over, if any is a `NamedSharding`."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None
