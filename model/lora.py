"""Low-rank adapters (LoRA, Hu et al. 2021): a frozen kernel W plus a trained update
(alpha / r) · A B, with A [in, r] and B [r, out] for a rank r much smaller than in and out.

The adapters are a pytree of their own, beside the params: for every layer, one
`{"lora_a", "lora_b"}` pair per target under the layer's path and the target's name, e.g.
`adapters["layers"]["0"]["q"]`. `merge` returns the params with every
target's kernel replaced by W + (alpha / r) · A B, so one forward serves training (the
gradient flows to A and B only), sampling and serving, and `kvjax merge-lora` writes the sum.
B starts at zero, so the merged params start equal to the base, bit for bit.

Targets, by the names of `kvjax.model` (Hugging Face's in brackets):
  q, k, v (q_proj, k_proj, v_proj): the query, key and value heads of self-attention, slices
      of its fused `qkv` kernel [D, N + 2K, H];
  o (o_proj): self-attention's output kernel [N, H, D];
  wi, wi_gate, wo (gate_proj, up_proj, down_proj; GPT-2's c_fc and c_proj): the
      feed-forward kernels; in a mixture of experts, every expert's own (Mixtral's w1, w3
      and w2): each expert gets its own pair, A [experts, in, r] and B [experts, r, out], over
      its slice of `experts/wi` [D, experts, F] and the like. Not over an int8 base, whose
      experts' kernels are dequantised outside the layers' adapters;
  router (a mixture's router, PEFT's `mlp.gate`): its kernel [D, experts], which scores the
      experts for each token;
  shared_wi, shared_wi_gate, shared_wo (a mixture's shared expert: Qwen2-MoE's
      shared_expert.gate_proj, up_proj, down_proj; DeepSeek's shared_experts.*): the kernels of
      the FFN every token of a mixture's layer goes through beside its experts, and
      shared_expert_gate (Qwen2-MoE's) the kernel [D, 1] of the sigmoid that scales it.
Both variants' self-attention and feed-forward layers take them (an encoder-decoder's
encoder and decoder alike); cross-attention is left as it is. Latent attention
(`model/latent_attention.py`) has no fused qkv kernel: there q adapts the kernel that makes
the heads' queries (`q` [D, N, rotary + nope], or `q_up` [latent_q_rank, N, rotary + nope]
after a query latent: DeepSeek's q_proj or q_b_proj), k and v the key and value halves of
`kv_up` [latent_kv_rank, N, nope + value] (kv_b_proj) (`kernel_path`). With scanned layers every
array gains the leading layer axis L. Shape letters (docs/shapes.md): D model width, N query
heads, K kv heads, H head width, L layers; the rank r and a kernel's input and output widths
have no letters and are written out ([in, r], [r, out]).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .config import TransformerConfig

TARGETS = ("q", "k", "v", "o", "wi", "wi_gate", "wo", "router", "shared_wi", "shared_wi_gate",
           "shared_wo", "shared_expert_gate")
DEFAULT_TARGETS = ("q", "v")  # PEFT's default for Llama's and GPT-2's attention
# "int8": the layers' kernels int8 with scales, the rest bfloat16 (`model/int8_base.py`).
BASE_DTYPES = ("float32", "bfloat16", "float16", "int8")
QUANTIZED_SCALE = "kernel_scale"  # beside an int8 `kernel` (`model/int8_base.py`)
# target: (module holding it, its kernel's name, input axes of the kernel)
KERNELS = {"q": ("self_attention", "qkv", 1), "k": ("self_attention", "qkv", 1),
           "v": ("self_attention", "qkv", 1), "o": ("self_attention", "out", 2),
           "wi": ("ffn", "wi", 1), "wi_gate": ("ffn", "wi_gate", 1), "wo": ("ffn", "wo", 1)}
# A mixture's shared expert's targets: target -> the path, within a layer, of the module whose
# kernel it adapts (which is also where a served pair is read, under the path's last name).
SHARED_EXPERT_TARGETS = {"shared_wi": ("ffn", "shared_expert", "wi"),
                         "shared_wi_gate": ("ffn", "shared_expert", "wi_gate"),
                         "shared_wo": ("ffn", "shared_expert", "wo"),
                         "shared_expert_gate": ("ffn", "shared_expert_gate")}
# Every target of a mixture's own kernels beside its experts, with its path as above.
MIXTURE_TARGETS = {"router": ("ffn", "router"), **SHARED_EXPERT_TARGETS}


@dataclasses.dataclass(frozen=True)
class LoRA:
    """rank: r; alpha: the update is scaled by alpha / r (None: alpha = r, a scale of 1, as
    PEFT's defaults r = 8, alpha = 8 give); targets: which kernels get adapters (`TARGETS`);
    base_dtype: the dtype training holds the frozen base in (None: as stored; "bfloat16"
    halves its memory; "int8" holds the layers' kernels as int8 with scales, as QLoRA
    does, and the rest in bfloat16, and computes them in float32 inside each layer)."""

    rank: int
    alpha: float | None = None
    targets: tuple[str, ...] = DEFAULT_TARGETS
    base_dtype: str | None = None

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int | np.integer) \
                or self.rank < 1:
            raise ValueError(f"LoRA rank={self.rank!r} must be an int >= 1")
        if self.alpha is not None and not (isinstance(self.alpha, int | float)
                                           and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoRA alpha={self.alpha!r} must be a number > 0")
        targets = tuple(self.targets)
        unknown = [t for t in targets if t not in TARGETS]
        if unknown or not targets or len(set(targets)) != len(targets):
            raise ValueError(f"LoRA targets {list(targets)} must be distinct names among "
                             f"{list(TARGETS)}" + (f"; {unknown[0]!r} is not" if unknown else ""))
        if self.base_dtype not in (None, *BASE_DTYPES):
            raise ValueError(f"LoRA base_dtype={self.base_dtype!r} must be one of "
                             f"{list(BASE_DTYPES)} or None")
        object.__setattr__(self, "rank", int(self.rank))
        object.__setattr__(self, "targets", tuple(t for t in TARGETS if t in targets))

    @property
    def scale(self) -> float:
        return (self.rank if self.alpha is None else self.alpha) / self.rank

    @property
    def int8_base(self) -> bool:
        """Whether the base's layer kernels are held as int8 (`model/int8_base.py`)."""
        return self.base_dtype == "int8"

    def update(self, a: jax.Array, b: jax.Array) -> jax.Array:
        """What one adapter pair adds to its kernel, in float32: (alpha / r) · A B
        [..., in, out]."""
        return self.scale * jnp.matmul(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets),
                "base_dtype": self.base_dtype}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoRA:
        return cls(d["rank"], d.get("alpha"), tuple(d.get("targets", DEFAULT_TARGETS)),
                   d.get("base_dtype"))


def init_adapters(config: TransformerConfig, params, lora: LoRA, rng: jax.Array):
    """Fresh adapters for `params`: A drawn uniformly from ±1/sqrt(in) (PEFT's Kaiming
    initialisation), B zero, both float32. A ValueError names a target the model lacks."""
    adapters: dict = {}
    found = list(sites(config, params, lora))
    for i, (path, target, kernel) in enumerate(found):
        in_width, out_width, lead = site_widths(config, params, path, target, kernel)
        if in_experts(params, path, target) and lora.int8_base:
            raise ValueError(f"LoRA on a mixture's experts ({target!r}) needs a float "
                             "base, not an int8 one (--lora-base-dtype bfloat16 halves "
                             "its memory)")
        live_inputs = _live_inputs(config, target)
        bound = 1 / math.sqrt(in_width if live_inputs is None else int(live_inputs.sum()))
        a = jax.random.uniform(jax.random.fold_in(rng, i), (*lead, in_width, lora.rank),
                               jnp.float32, -bound, bound)
        if live_inputs is not None:
            a = a * live_inputs[:, None]
        b = jnp.zeros((*lead, lora.rank, out_width), jnp.float32)
        _set(adapters, (*path, target), {"lora_a": a, "lora_b": b})
    return adapters


def _live_inputs(config: TransformerConfig, target: str) -> np.ndarray | None:
    """Which of a target's inputs can be nonzero, where some never are (None: all can):
    latent attention's heads hold their values padded with zeros to head_dim, so rows of o's
    A over the padding would change the merged kernel where no input reaches, and never
    train; they start, and stay, zero."""
    value = config.latent_value_dim
    if target != "o" or not config.latent_kv_rank or value == config.head_dim:
        return None
    return np.tile(np.arange(config.head_dim) < value, config.num_heads).astype(np.float32)


def merge(config: TransformerConfig, params, adapters, lora: LoRA, keep_dtype: bool = True):
    """`params` with each target's kernel W replaced by W + scale · A B, summed in float32
    and held in W's dtype (`keep_dtype`) or in float32, which keeps a small update whole
    over a low-precision base (how training runs it). Everything else is the same array.
    Traceable: training differentiates through it to the adapters."""
    merged = jax.tree.map(lambda x: x, params)  # new containers, the same arrays
    for path, target, _ in sites(config, params, lora):
        pair = get(adapters, (*path, target))
        delta = lora.update(pair["lora_a"], pair["lora_b"])
        if in_experts(params, path, target):  # [..., experts, in, out]
            where = (*path, "ffn", "experts", target)
            current = get(merged, where)
            if target != "wo":  # the kernel is [..., D, experts, F]
                delta = jnp.moveaxis(delta, -3, -2)
            updated = current.astype(jnp.float32) + delta
            _set(merged, where, updated.astype(current.dtype) if keep_dtype else updated)
            continue
        where = (*path, *kernel_path(config, target), "kernel")
        current = get(merged, where)
        updated = add_update(config, target, current.astype(jnp.float32), delta)
        _set(merged, where,
             updated.astype(current.dtype) if keep_dtype else updated)
    return merged


def add_update(config: TransformerConfig, target: str, kernel: jax.Array,
               delta: jax.Array) -> jax.Array:
    """`kernel` (a float32 kernel of the module `target` names) plus a target's update
    A B [..., in, out]: into its heads' slice of a fused qkv kernel, or of latent attention's
    kv_up (its key dimensions, then its value dimensions), else the whole kernel."""
    if is_latent_target(config, target) and target != "q":
        nope = config.latent_nope_dim
        delta = delta.reshape(*delta.shape[:-1], config.num_heads, -1)
        part = slice(None, nope) if target == "k" else slice(nope, None)
        return kernel.at[..., part].add(delta)
    if kernel_path(config, target)[-1] == "qkv" and not is_latent_target(config, target):
        start, width = qkv_heads(config, target)
        delta = delta.reshape(*delta.shape[:-1], width, config.head_dim)
        return kernel.at[..., start:start + width, :].add(delta)
    return kernel + delta.reshape(kernel.shape)


def adapter_shapes(config: TransformerConfig, params, lora: LoRA):
    """The adapters `init_adapters` makes, as `jax.ShapeDtypeStruct`s (nothing computed)."""
    return jax.eval_shape(lambda: init_adapters(config, params, lora, jax.random.key(0)))


def count(adapters) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(adapters))


def sites(config: TransformerConfig, params, lora: LoRA
          ) -> Iterator[tuple[tuple[str, ...], str, Any]]:
    """(path of a layer, target, its kernel) for every layer holding a target's module."""
    found = set()
    for path, layer in layer_subtrees(params):
        for target in lora.targets:
            held = layer
            for key in kernel_path(config, target):
                held = held.get(key, {})
            kernel = held.get("kernel")
            experts = layer.get("ffn", {}).get("experts", {})
            if target in EXPERT_TARGETS and target in experts:
                kernel, held = experts[target], {}
                if not jnp.issubdtype(kernel.dtype, jnp.floating):
                    raise ValueError(f"LoRA on a mixture's experts ({target!r}) needs a float "
                                     f"base; {'/'.join(path)}/ffn/experts/{target} holds "
                                     f"{kernel.dtype} (--lora-base-dtype bfloat16 halves its "
                                     "memory)")
            if kernel is None:
                continue
            if not jnp.issubdtype(kernel.dtype, jnp.floating) and QUANTIZED_SCALE not in held:
                raise ValueError(f"LoRA needs floating-point kernels; {'/'.join(path)}/"
                                 f"{'/'.join(kernel_path(config, target))} holds "
                                 f"{kernel.dtype}")
            found.add(target)
            yield path, target, kernel
    missing = [t for t in lora.targets if t not in found]
    if missing:
        raise ValueError(f"LoRA target {missing[0]!r} is not in this model (its layers have "
                         f"no {'/'.join(kernel_path(config, missing[0]))} kernel)")


EXPERT_TARGETS = ("wi", "wi_gate", "wo")  # a mixture's experts' kernels, where it has them


def in_experts(params, path: Sequence[str], target: str) -> bool:
    """Whether `target` of the layer at `path` is its mixture's experts' kernel."""
    return target in EXPERT_TARGETS and target in get(params, path).get("ffn", {}).get(
        "experts", {})


def layer_subtrees(tree, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], dict]]:
    """Every subtree holding a layer's self-attention or feed-forward module."""
    if not isinstance(tree, dict):
        return
    if "self_attention" in tree or "ffn" in tree:
        yield path, tree
        return
    for key in sorted(tree):
        yield from layer_subtrees(tree[key], (*path, key))


def kernel_ndim(name: str) -> int:
    """Axes of one layer's kernel `name`: attention's qkv [D, N + 2K, H] and out [N, H, D]
    (and latent attention's q, q_up and kv_up) have 3, the feed-forward kernels 2 (scanned
    layers put L before them)."""
    return 3 if name in ("qkv", "out", "q", "q_up", "kv_up") else 2


def is_latent_target(config: TransformerConfig, target: str) -> bool:
    """Whether `target` adapts one of latent attention's kernels (module docstring)."""
    return bool(config.latent_kv_rank) and target in ("q", "k", "v")


def kernel_path(config: TransformerConfig, target: str) -> tuple[str, ...]:
    """The path, within a layer's params, of the module whose `kernel` `target` adapts."""
    if is_latent_target(config, target):
        name = ("q_up" if config.latent_q_rank else "q") if target == "q" else "kv_up"
        return ("self_attention", "latent", name)
    return MIXTURE_TARGETS.get(target) or KERNELS[target][:2]


def site_widths(config: TransformerConfig, params, path: Sequence[str], target: str,
                kernel) -> tuple[int, int, tuple]:
    """(in, out, leading axes) of the A [..., in, r] and B [..., r, out] of a target's `kernel` in
    the layer at `path` (as `sites` yields them): the leading axes those of scanned layers,
    and a mixture's experts' after them."""
    if in_experts(params, path, target):  # [..., D, experts, F] or [..., experts, F, D]
        return (*widths(config, target), (*kernel.shape[:-3], config.num_experts))
    lead = tuple(kernel.shape[:kernel.ndim - kernel_ndim(kernel_path(config, target)[-1])])
    if target in EXPERT_TARGETS:
        # A dense FFN's own width: a mixture's dense layers (`dense_ffn_layers`) hold
        # `dense_d_ff`, where `widths` gives its experts' d_ff.
        return (*kernel.shape[-2:], lead)
    return (*widths(config, target), lead)


def widths(config: TransformerConfig, target: str) -> tuple[int, int]:
    """(in, out): the input and output width of a target's update A B [in, out]."""
    if is_latent_target(config, target):
        per_head = {"q": config.rotary_dims + config.latent_nope_dim,
                    "k": config.latent_nope_dim, "v": config.latent_value_dim}[target]
        inputs = (config.latent_q_rank or config.d_model) if target == "q" else \
            config.latent_kv_rank
        return inputs, config.num_heads * per_head
    if target == "router":
        return config.d_model, config.num_experts
    if target in SHARED_EXPERT_TARGETS:
        width = 1 if target == "shared_expert_gate" else config.shared_expert_d_ff
        return (width, config.d_model) if target == "shared_wo" else (config.d_model, width)
    inputs = {"o": config.num_heads * config.head_dim, "wo": config.d_ff}.get(
        target, config.d_model)
    if KERNELS[target][1] == "qkv":
        return inputs, qkv_heads(config, target)[1] * config.head_dim
    return inputs, config.d_model if target in ("o", "wo") else config.d_ff


def qkv_heads(config: TransformerConfig, target: str) -> tuple[int, int]:
    """(first head, number of heads) of q, k or v within the fused qkv kernel."""
    n, k = config.num_heads, config.kv_heads
    return {"q": (0, n), "k": (n, k), "v": (n + k, k)}[target]


def get(tree, path: Sequence[str]):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: Sequence[str], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value
