"""PEFT's LoRA adapters of DeepSeek's multi-head latent attention (`deepseek_v2`,
`deepseek_v3`, `glm4_moe_lite`): merged into kvjax's `LatentQKV` kernels, read as kvjax's
adapters, and written from them.

The file's modules and what they hold of kvjax's (`model/latent_attention.py`,
`latent_weights.py`):
  q_proj or q_b_proj -> target q: the kernel making the heads' queries, each head's rows
      [unturned, turned by pairs] in the file, [turned by halves, unturned] in kvjax;
  kv_b_proj -> targets k and v: each head's unturned key rows, then its value rows, in the
      file; kvjax's k is every head's key rows and v every head's value rows;
  o_proj -> target o: its inputs are each head's values, which kvjax's heads pad with zeros
      to head_dim;
  q_a_proj, kv_a_proj_with_mqa: the query and key-value latents' down projections (the
      latter's rows past the latent the shared turned key part, by pairs in the file), which
      are none of kvjax's targets: merged, never trained or served beside others;
  mlp.gate_proj, mlp.up_proj, mlp.down_proj -> wi, wi_gate, wo of the dense first layers'
      FFN (the experts' are `peft_experts.py`'s); mlp.shared_experts.gate_proj, up_proj and
      down_proj -> shared_wi, shared_wi_gate, shared_wo beside the experts; mlp.gate -> router.

Shape letters (docs/shapes.md): N query heads, D model width; a row's span (its inputs, or
the rank), the rank r and an update's input and output widths are written out.
"""

from __future__ import annotations

import numpy as np

from kvjax.model import TransformerConfig
from kvjax.model import lora as L

from .latent_weights import pairs_to_halves
from .peft_experts import is_experts_pair
from .peft_modules import MODULES, add_to_kernel, fused_pair, layer_config

LAYOUT = "deepseek_latent"  # `weights.LAYOUTS`' name of the files these modules are in
# The down projections' kernels, which no target adapts.
DOWN_PROJECTIONS = {"self_attn.q_a_proj": ("latent", "q_down"),
                    "self_attn.kv_a_proj_with_mqa": ("latent", "kv_down")}


def modules(config: TransformerConfig) -> dict[str, tuple[str, ...]]:
    """The modules a PEFT adapter of this model may adapt, each with its targets: queries
    from q_a_proj and q_b_proj with a query latent, else from q_proj."""
    dropped = ("self_attn.q_proj",) if config.latent_q_rank else ("self_attn.q_a_proj",
                                                                  "self_attn.q_b_proj")
    return {module: targets for module, targets in MODULES[LAYOUT].items()
            if module not in dropped}


def _query_order(config: TransformerConfig) -> np.ndarray:
    """The file's index of each of kvjax's query rows."""
    unturned, turned = config.latent_nope_dim, config.rotary_dims
    head = np.concatenate([unturned + pairs_to_halves(turned), np.arange(unturned)])
    width = unturned + turned
    return (np.arange(config.num_heads)[:, None] * width + head).reshape(-1)


def _key_value_order(config: TransformerConfig) -> np.ndarray:
    """The file's index of each row of kvjax's k, then v, from kv_b_proj."""
    unturned, value = config.latent_nope_dim, config.latent_value_dim
    heads = np.arange(config.num_heads)[:, None] * (unturned + value)
    return np.concatenate([(heads + np.arange(unturned)).reshape(-1),
                           (heads + unturned + np.arange(value)).reshape(-1)])


def _down_order(config: TransformerConfig) -> np.ndarray:
    """The file's index of each of kvjax's kv_down columns: the latent, then the shared
    turned key part by halves."""
    rank = config.latent_kv_rank
    return np.concatenate([np.arange(rank), rank + pairs_to_halves(config.rotary_dims)])


def _output_order(config: TransformerConfig, module: str) -> np.ndarray | None:
    """The file's index of each of kvjax's output rows of `module` (None: the same order)."""
    if module in ("self_attn.q_proj", "self_attn.q_b_proj"):
        return _query_order(config)
    if module == "self_attn.kv_b_proj":
        return _key_value_order(config)
    if module == "self_attn.kv_a_proj_with_mqa":
        return _down_order(config)
    return None


def _padded_values(config: TransformerConfig, rows: np.ndarray) -> np.ndarray:
    """Rows over every head's values [N · value, span] as kvjax's heads hold them, each padded
    with zero rows to head_dim [N · head_dim, span]."""
    n, value = config.num_heads, config.latent_value_dim
    rows = rows.reshape(n, value, -1)
    return np.pad(rows, ((0, 0), (0, config.head_dim - value), (0, 0))).reshape(
        n * config.head_dim, -1)


def _check_rows(config: TransformerConfig, module: str, peft_a: np.ndarray, peft_b: np.ndarray,
                name: str) -> None:
    inputs, outputs = _file_widths(config, module)
    if (peft_a.shape[1], peft_b.shape[0]) != (inputs, outputs):
        raise ValueError(f"tensor {name} makes an update of {[peft_a.shape[1], peft_b.shape[0]]}; "
                         f"the model's {module} takes {inputs} inputs to {outputs} outputs")


def _file_widths(config: TransformerConfig, module: str) -> tuple[int, int]:
    """(in, out) of `module`'s torch weight [out, in]."""
    c = config
    targets = MODULES[LAYOUT][module]
    if targets and targets[0] in L.MIXTURE_TARGETS:
        return L.widths(c, targets[0])
    if module in ("mlp.gate_proj", "mlp.up_proj"):
        return c.d_model, c.d_ff
    if module == "mlp.down_proj":
        return c.d_ff, c.d_model
    if module == "self_attn.q_a_proj":
        return c.d_model, c.latent_q_rank
    if module == "self_attn.kv_a_proj_with_mqa":
        return c.d_model, c.latent_kv_rank + c.rotary_dims
    if module == "self_attn.o_proj":
        return c.num_heads * c.latent_value_dim, c.d_model
    if module == "self_attn.kv_b_proj":
        return c.latent_kv_rank, c.num_heads * (c.latent_nope_dim + c.latent_value_dim)
    return (c.latent_q_rank or c.d_model), c.num_heads * (c.latent_nope_dim + c.rotary_dims)


def kvjax_pair(config: TransformerConfig, module: str, peft_a: np.ndarray, peft_b: np.ndarray,
               name: str) -> tuple[np.ndarray, np.ndarray]:
    """A module's A [r, in] and B [out, r] (B scaled), checked, as kvjax's A [in, r] and
    B [r, out]: B's rows in kvjax's order, o's A padded to kvjax's heads."""
    _check_rows(config, module, peft_a, peft_b, name)
    order = _output_order(config, module)
    lora_a = peft_a.astype(np.float32).T
    peft_b = peft_b.astype(np.float32)
    if order is not None:
        peft_b = peft_b[order]
    if module == "self_attn.o_proj":
        lora_a = _padded_values(config, lora_a)
    return lora_a, peft_b.T


def merge(config: TransformerConfig, layer: dict, module: str, peft_a: np.ndarray,
          peft_b: np.ndarray, scale: float, name: str) -> None:
    """Adds a module's update scale · Aᵀ Bᵀ to its kernels in `layer` (new arrays; the loaded
    ones are not changed), summed in float32 and kept in each kernel's dtype."""
    lora_a, lora_b = kvjax_pair(config, module, peft_a, scale * peft_b.astype(np.float32), name)
    update = lora_a @ lora_b
    targets = modules(config)[module]
    if not targets:
        add_to_kernel(layer, ("self_attention", *DOWN_PROJECTIONS[module], "kernel"), update)
        return
    widths = [L.widths(config, target)[1] for target in targets]
    nope = config.latent_nope_dim
    # k and v: each head's key dimensions of kv_up, then its value dimensions.
    parts = {"k": (..., slice(None, nope)), "v": (..., slice(nope, None))}
    for target, piece in zip(targets, np.split(update, np.cumsum(widths)[:-1], axis=1),
                             strict=True):
        add_to_kernel(layer, (*L.kernel_path(config, target), "kernel"), piece,
                      parts.get(target, ...))


def peft_tensors(config: TransformerConfig, layers: dict, settings: L.LoRA, prefix: str
                 ) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """kvjax's adapters of latent attention's layers (q, k, v, o) as a PEFT file's tensors,
    with the rank of each module path that has them: k and v in kv_b_proj, their A's stacked
    and their B's along the diagonal (B scaled so that lora_alpha / r stays the run's scale
    at the fused rank); o's A without the rows of kvjax's zero padding."""
    tensors: dict[str, np.ndarray] = {}
    ranks: dict[str, int] = {}
    for module, targets in modules(config).items():
        trained = [t for t in targets if t in settings.targets]
        if not trained or targets == ("router",):  # a parameter of the router: `peft.py`'s
            continue
        for index, layer in sorted(layers.items(), key=lambda item: int(item[0])):
            # Not a mixture's experts (`peft_experts.py`'s), nor a shared expert's in a layer
            # without one.
            here = [t for t in trained if t in layer and not is_experts_pair(layer[t])]
            if not here:
                continue
            peft_a, peft_b = fused_pair(layer_config(config, int(index)), layer, targets, here,
                                    settings.rank)
            if module == "self_attn.o_proj":
                n, value = config.num_heads, config.latent_value_dim
                peft_a = peft_a.reshape(-1, n, config.head_dim)[..., :value].reshape(-1, n * value)
            order = _output_order(config, module)
            if order is not None:
                peft_b = peft_b[np.argsort(order)]
            name = f"base_model.model.{prefix}.{index}.{module}"
            tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(peft_a)
            tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(peft_b)
            ranks[module] = peft_a.shape[0]
    return tensors, ranks
