"""The `config.json` reader of ERNIE 4.5's mixtures of experts (`ernie4_5_moe`: 21B-A3B,
300B-A47B): ERNIE 4.5's layer whose FFN is a mixture in the layers its `moe_layer_*` keys
name and one dense FFN in the others. `READERS` maps the model type to its reader."""

from __future__ import annotations

from typing import Any

from .errors import UnsupportedModelError
from .llama_like import _ernie4_5
from .reader import Reader


def mixture_layers(c: Reader, layers: int) -> list[int]:
    """The layers whose FFN is a mixture: every `moe_layer_interval`-th from
    `moe_layer_start_index` to `moe_layer_end_index` (the last where -1), as transformers
    counts them."""
    start, end = c.get("moe_layer_start_index", 1), c.get("moe_layer_end_index", -1)
    interval = c.get("moe_layer_interval", 1)
    end = layers - 1 if end == -1 else end
    return [i for i in range(layers) if (i + 1) % interval == 0 and start <= i <= end]


def _ernie4_5_moe(c: Reader) -> dict[str, Any]:
    """ERNIE 4.5's layer (its RoPE turning pairs of dimensions) with, in the `mixture_layers`,
    `moe_num_experts` experts of `moe_intermediate_size` hidden units, `moe_k` of them for
    each token chosen by the router's softmax plus each expert's `e_score_correction_bias`
    and weighed by the softmax, renormalised (over a sum clamped at `moe_norm_min`, far
    below any sum of k probabilities), beside a shared FFN of `moe_num_shared_experts` times
    their hidden units; the other layers one dense FFN of `intermediate_size`. The
    multi-token-prediction layers of the releases (`num_nextn_predict_layers`) are left
    unread, as transformers leaves them."""
    c.expect("use_bias", False, False, "ERNIE 4.5's mixtures have no biases")
    layers = c.require("num_hidden_layers")
    mixtures = mixture_layers(c, layers)
    if not mixtures:
        raise UnsupportedModelError(f"{c.source}: no layer is a mixture of experts "
                                    "(moe_layer_start_index, moe_layer_end_index, "
                                    "moe_layer_interval)")
    for key in ("moe_norm_min", "output_router_logits", "router_aux_loss_coef",
                "num_nextn_predict_layers", "num_mtp_layers"):
        c.get(key)
    units = c.require("moe_intermediate_size")
    dense = tuple(i for i in range(layers) if i not in mixtures)
    fields = _ernie4_5(c)
    return {**fields, "d_ff": units, "num_experts": c.require("moe_num_experts"),
            "experts_per_token": c.require("moe_k"), "normalize_expert_weights": True,
            "shared_expert_d_ff": units * c.get("moe_num_shared_experts", 0),
            "router_selection_bias": True, "dense_ffn_layers": dense,
            "dense_d_ff": fields["d_ff"] if dense else 0}


READERS = {"ernie4_5_moe": _ernie4_5_moe}
