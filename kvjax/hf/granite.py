"""The `config.json` readers of the families of Granite's multipliers (µP) beyond Granite 3 and its
MoE (`llama_like.py`): HyperCLOVA X SEED (`hyperclovax`), and the Granite models whose FFN is a
`shared_mlp` every token goes through: `granitemoeshared` (GraniteMoE with a shared FFN beside
the experts) and `granitemoehybrid` (Granite 4.0) where every layer is attention: the shared FFN
alone (the dense models: 4.0 micro, 1B, 350M) or beside a mixture of experts, with RoPE or with
no position encoding at all. Granite 4.0's Mamba-2 layers (the `-h` models) are refused by name.
`READERS` maps each model type to its reader."""

from __future__ import annotations

from typing import Any

from .errors import UnsupportedModelError
from .llama_like import _granite, _granitemoe, experts_fields, read_llama
from .reader import Reader

# transformers' older names of the layer types (`remap_legacy_layer_types`).
_LEGACY_LAYER_TYPES = {"attention": "full_attention", "mamba": "linear_attention"}
# The Mamba-2 layers' settings: they change nothing where no layer is one.
_MAMBA_KEYS = ("mamba_n_heads", "mamba_n_groups", "mamba_d_state", "mamba_d_head",
               "mamba_d_conv", "mamba_expand", "mamba_chunk_size", "mamba_conv_bias",
               "mamba_proj_bias", "time_step_limit")


def _hyperclovax(c: Reader) -> dict[str, Any]:
    """HyperCLOVA X SEED (NAVER): Llama's layer with Granite's multipliers on the embeddings
    and each sublayer's output, the attention scaled by `attention_multiplier` (1/√head_dim
    where null), the logits multiplied by `logits_scaling` (Granite divides by it), and with
    `use_post_norm` (on where absent) a norm on each sublayer's output too (Peri-LN)."""
    scale = c.get("attention_multiplier")
    return {**read_llama(c),
            "embedding_multiplier": float(c.get("embedding_multiplier", 1.0)),
            "residual_multiplier": float(c.get("residual_multiplier", 1.0)),
            "attention_scale": None if scale is None else float(scale),
            "logits_scaling": 1.0 / float(c.get("logits_scaling", 1.0)),
            "sandwich_norms": bool(c.get("use_post_norm", True))}


def _granitemoeshared(c: Reader) -> dict[str, Any]:
    """GraniteMoE with a shared FFN of `shared_intermediate_size` hidden units (none where
    0) beside each token's chosen experts, its output added as it is."""
    return {**_granitemoe(c), "shared_expert_d_ff": int(c.get("shared_intermediate_size", 0))}


def _granitemoehybrid(c: Reader) -> dict[str, Any]:
    """Granite 4.0 whose `layer_types` are all attention: Granite's multipliers, RoPE where
    `position_embedding_type` is "rope" and no position encoding where it is null; the shared
    FFN of `shared_intermediate_size` hidden units is the layer's FFN where
    `num_local_experts` is 0, else beside a mixture of experts as GraniteMoE's."""
    layers = c.require("num_hidden_layers")
    kinds = c.get("layer_types") or c.get("layers_block_type") or ["linear_attention"] * layers
    kinds = [_LEGACY_LAYER_TYPES.get(kind, kind) for kind in kinds]
    if len(kinds) != layers:
        raise UnsupportedModelError(f"{c.source}: layer_types names {len(kinds)} layers of "
                                    f"{layers}")
    others = [i for i, kind in enumerate(kinds) if kind != "full_attention"]
    if others:
        raise UnsupportedModelError(
            f"{c.source}: layers {others} are Mamba-2 layers ({kinds[others[0]]!r}); kvjax "
            "runs the Granite 4.0 models whose layers are all attention (micro, 1B, 350M), "
            "not the hybrid -h models")
    for key in _MAMBA_KEYS:
        c.get(key)
    position = c.get("position_embedding_type")
    if position not in ("rope", None):
        raise UnsupportedModelError(f"{c.source}: position_embedding_type={position!r} is not "
                                    "supported (rope, or null: none)")
    shared = int(c.require("shared_intermediate_size"))
    if c.get("num_local_experts", 0):
        fields = {**_granite(c), **experts_fields(c, normalize=True),
                  "shared_expert_d_ff": shared}
    else:
        for key in ("num_experts_per_tok", "output_router_logits", "router_aux_loss_coef"):
            c.get(key)  # the experts' settings, of a model without them
        fields = {**_granite(c), "d_ff": shared}
    if position is None:
        fields["unrotated_layers"] = tuple(range(layers))
    return fields


READERS = {"hyperclovax": _hyperclovax, "granitemoeshared": _granitemoeshared,
           "granitemoehybrid": _granitemoehybrid}
