"""Where PEFT's tensors of each layout's files sit, and the order of their rows: which
module (after the layer's prefix) holds which of kvjax's LoRA targets (`MODULES`), where the
layers are in the tensors' names (`layer_prefixes`), and the modules whose output rows kvjax
holds in another order (`reorders`, `rows_in_kvjax_order`, `rows_in_file_order`); a module
holding several targets written from their adapters (`fused_pair`).

A module's output rows and what each row spans (its inputs, or the rank) have no shape letters
(docs/shapes.md): written out, [out, span].
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvjax.model import TransformerConfig
from kvjax.model import lora as L

from .gpt_weights import groups_apart, groups_together
from .weights import LAYOUTS, ROPE_ORDERS, rope_rows_in_kvjax_order

# Per layout of the weight files (`weights.LAYOUTS`): the file's module -> the kvjax targets
# it covers, in the order its output rows hold them.
_ATTENTION = {"self_attn.q_proj": ("q",), "self_attn.k_proj": ("k",),
              "self_attn.v_proj": ("v",), "self_attn.o_proj": ("o",)}
_GATED = {**_ATTENTION, "mlp.gate_proj": ("wi",), "mlp.up_proj": ("wi_gate",),
          "mlp.down_proj": ("wo",)}
_UNGATED = {**_ATTENTION, "mlp.up_proj": ("wi",), "mlp.down_proj": ("wo",)}
_C_ATTN = {"attn.c_attn": ("q", "k", "v"), "attn.c_proj": ("o",), "mlp.c_fc": ("wi",),
           "mlp.c_proj": ("wo",)}


def _shared(under: str) -> dict[str, tuple[str, ...]]:
    """A mixture's shared expert, a gated FFN of Llama's names `under` the layer."""
    return {f"{under}.gate_proj": ("shared_wi",), f"{under}.up_proj": ("shared_wi_gate",),
            f"{under}.down_proj": ("shared_wo",)}


# Qwen2-MoE's shared expert and the kernel of the sigmoid gate that scales it.
_QWEN_SHARED = {**_shared("mlp.shared_expert"), "mlp.shared_expert_gate": ("shared_expert_gate",)}
# A mixture's router: transformers' `mlp.gate` (a router module whose weight PEFT adapts
# through `target_parameters`, `gate.weight`: what PEFT's all-linear adapts in these mixtures).
_ROUTER = {"mlp.gate": ("router",)}
MODULES = {
    "llama": {**_GATED, **_ROUTER, **_QWEN_SHARED}, "hunyuan": _GATED, "cohere": _GATED,
    "vaultgemma": _GATED, "hyperclovax": _GATED,
    # Arcee, Nemotron and Apertus: an FFN of up_proj and down_proj alone.
    "up_down_mlp": _UNGATED, "nemotron": _UNGATED, "apertus": _UNGATED,
    "fused": {"self_attn.qkv_proj": ("q", "k", "v"), "self_attn.o_proj": ("o",),
              "mlp.gate_up_proj": ("wi", "wi_gate"), "mlp.down_proj": ("wo",)},
    # GPT-2's (Conv1D) and GPTBigCode's (Linear) c_attn: every q head, then the k and v heads;
    # GPTBigCode's with a kv head per query head, each head's q, k and v in turn.
    "gpt2": _C_ATTN, "gpt_bigcode": _C_ATTN,
    "gpt_neo": {"attn.attention.q_proj": ("q",), "attn.attention.k_proj": ("k",),
                "attn.attention.v_proj": ("v",), "attn.attention.out_proj": ("o",),
                "mlp.c_fc": ("wi",), "mlp.c_proj": ("wo",)},
    "gptj": {"attn.q_proj": ("q",), "attn.k_proj": ("k",), "attn.v_proj": ("v",),
             "attn.out_proj": ("o",), "mlp.fc_in": ("wi",), "mlp.fc_out": ("wo",)},
    "phi": {"self_attn.q_proj": ("q",), "self_attn.k_proj": ("k",), "self_attn.v_proj": ("v",),
            "self_attn.dense": ("o",), "mlp.fc1": ("wi",), "mlp.fc2": ("wo",)},
    "opt": {"self_attn.q_proj": ("q",), "self_attn.k_proj": ("k",), "self_attn.v_proj": ("v",),
            "self_attn.out_proj": ("o",), "fc1": ("wi",), "fc2": ("wo",)},
    "glm": {**_ATTENTION, "mlp.gate_up_proj": ("wi", "wi_gate"), "mlp.down_proj": ("wo",)},
    "llama_pairs": _GATED,
    # Mixtral, GraniteMoE and gpt-oss: attention (their experts' stacked parameters are
    # `peft_experts.py`'s).
    "mixtral": {**_ATTENTION, **_ROUTER}, "granitemoe": _ATTENTION, "gpt_oss": _ATTENTION,
    # ERNIE 4.5's, GLM-4.5's and dots.llm1's mixtures: attention, the dense FFNs of their
    # first layers (in a mixture, an FFN module adapts only a layer without experts) and the
    # shared experts beside the experts; HunYuan MoE's attention and shared FFN.
    "ernie_moe": {**_GATED, **_ROUTER, **_shared("mlp.shared_experts")},
    "deepseek_moe": {**_GATED, **_ROUTER, **_shared("mlp.shared_experts")},
    # HunYuan's router a Linear `wg` in its gate module.
    "hunyuan_moe": {**_ATTENTION, "mlp.gate.wg": ("router",), **_shared("mlp.shared_mlp")},
    # Granite 4.0's and GraniteMoeShared's shared_mlp, its gate and up projections in one
    # input_linear: the layer's FFN where there are no experts, the shared expert beside
    # experts (`module_table`).
    "granite_shared": {**_ATTENTION, "shared_mlp.input_linear": ("wi", "wi_gate"),
                       "shared_mlp.output_linear": ("wo",)},
    "plain_mlp": {**_ATTENTION, "mlp.c_fc": ("wi",), "mlp.c_proj": ("wo",)},
    "nanochat": {**_ATTENTION, "mlp.fc1": ("wi",), "mlp.fc2": ("wo",)},
    "gpt_neox": {"attention.query_key_value": ("q", "k", "v"), "attention.dense": ("o",),
                 "mlp.dense_h_to_4h": ("wi",), "mlp.dense_4h_to_h": ("wo",)},
    # BLOOM's query_key_value, each head's q, k and v in turn, under self_attention.
    "bloom": {"self_attention.query_key_value": ("q", "k", "v"),
              "self_attention.dense": ("o",), "mlp.dense_h_to_4h": ("wi",),
              "mlp.dense_4h_to_h": ("wo",)},
    # MPT's Wqkv: every q head, then every k, then every v, as kvjax holds them.
    "mpt": {"attn.Wqkv": ("q", "k", "v"), "attn.out_proj": ("o",), "ffn.up_proj": ("wi",),
            "ffn.down_proj": ("wo",)},
    # Falcon's query_key_value by kv-head group (`weights.groups_apart`).
    "falcon": {"self_attention.query_key_value": ("q", "k", "v"),
               "self_attention.dense": ("o",), "mlp.dense_h_to_4h": ("wi",),
               "mlp.dense_4h_to_h": ("wo",)},
    # DeepSeek's latent attention (`peft_latent.py`): the query and key-value latents' down
    # projections hold none of kvjax's targets, and only merge.
    "deepseek_latent": {"self_attn.q_proj": ("q",), "self_attn.q_a_proj": (),
                        "self_attn.q_b_proj": ("q",), "self_attn.kv_a_proj_with_mqa": (),
                        "self_attn.kv_b_proj": ("k", "v"), "self_attn.o_proj": ("o",),
                        "mlp.gate_proj": ("wi",), "mlp.up_proj": ("wi_gate",),
                        "mlp.down_proj": ("wo",), **_ROUTER, **_shared("mlp.shared_experts")},
}
# GraniteMoeShared's shared_mlp beside its experts.
_GRANITE_BESIDE_EXPERTS = {**_ATTENTION,
                           "shared_mlp.input_linear": ("shared_wi", "shared_wi_gate"),
                           "shared_mlp.output_linear": ("shared_wo",)}


def module_table(config: TransformerConfig, layout: str) -> dict[str, tuple[str, ...]]:
    """`MODULES[layout]` as it applies to a model of `config`: Granite's shared_mlp is the
    shared expert of a model with experts."""
    if layout == "granite_shared" and config.num_experts:
        return _GRANITE_BESIDE_EXPERTS
    return MODULES[layout]


# Where each layout's layers are in the names PEFT gives its tensors (written with the
# first); "model.layers" where not listed.
_LAYER_PREFIXES = {"gpt2": ("transformer.h", "h"), "opt": ("model.decoder.layers",),
                   "gpt_neox": ("gpt_neox.layers",), "bloom": ("transformer.h", "h"),
                   "mpt": ("transformer.blocks",),
                   **dict.fromkeys(("gpt_bigcode", "gpt_neo", "gptj", "falcon"),
                                   ("transformer.h",))}
# Where a vision-language model's language model keeps its layers (`text_of_multimodal.py`),
# as transformers names them (the first, where kvjax writes an adapter of one) and as older
# versions did: an adapter trained on it adapts them.
LANGUAGE_MODEL_LAYERS = ("model.language_model.layers", "language_model.model.layers")


def layer_prefixes(model_type: str) -> tuple[str, ...]:
    """Where the layers are in an adapter's tensor names, the first as kvjax writes them."""
    prefixes = _LAYER_PREFIXES.get(LAYOUTS[model_type], ("model.layers",))
    return prefixes + LANGUAGE_MODEL_LAYERS if prefixes == ("model.layers",) else prefixes


def reorders(config: TransformerConfig, model_type: str, module: str) -> bool:
    """Whether kvjax holds `module`'s output rows in another order than the file: a fused q,
    k and v whose heads each hold their q, k and v in turn (GPT-NeoX's query_key_value,
    BLOOM's, GPTBigCode's c_attn with a kv head per query head) or whose kv heads each hold their
    query heads, key and value (Falcon's query_key_value), where kvjax's targets hold every
    q head, then every k, then every v; the queries and keys of layouts whose RoPE turns pairs
    of a head's dimensions, or turns the other way, where kvjax turns halves
    (`weights.ROPE_ORDERS`)."""
    layout = LAYOUTS[model_type]
    targets = MODULES[layout].get(module)
    if targets == ("q", "k", "v"):
        return layout in ("gpt_neox", "bloom", "falcon") or (
            layout == "gpt_bigcode" and config.kv_heads == config.num_heads)
    return layout in ROPE_ORDERS and targets in (("q",), ("k",))


def rows_in_kvjax_order(config: TransformerConfig, model_type: str, module: str,
                        rows: np.ndarray, name: str) -> np.ndarray:
    """A module's output rows [out, span] that `reorders` in kvjax's order, the rows' count
    checked first: `gpt_weights.groups_apart`, or `weights.rope_rows_in_kvjax_order`."""
    n, h = config.num_heads, config.head_dim
    targets = MODULES[LAYOUTS[model_type]][module]
    heads = sum(n if target == "q" else config.kv_heads for target in targets)
    if rows.shape[0] != heads * h:
        raise ValueError(f"tensor {name} has {rows.shape[0]} output rows; the model's "
                         f"{module} has {heads * h}")
    if len(targets) == 3:
        return groups_apart(rows, config.kv_heads, h)
    return rope_rows_in_kvjax_order(rows, heads, h, config.rotary_dims, LAYOUTS[model_type])


def rows_in_file_order(config: TransformerConfig, model_type: str, module: str,
                       rows: np.ndarray) -> np.ndarray:
    """The inverse of `rows_in_kvjax_order`."""
    n, h = config.num_heads, config.head_dim
    targets = MODULES[LAYOUTS[model_type]][module]
    if len(targets) == 3:
        return groups_together(rows, config.kv_heads, n, h)
    heads = n if targets == ("q",) else config.kv_heads
    return rope_rows_in_kvjax_order(rows, heads, h, config.rotary_dims, LAYOUTS[model_type],
                                    inverse=True)


def add_to_kernel(tree: dict, path: Sequence[str], delta: np.ndarray, where=...) -> None:
    """`delta` added to the part `where` of the array at `path` in `tree` (reshaped to that
    part's shape), summed in float32 and kept in the array's dtype. The dicts along `path`
    are copied and a new array takes the old one's place: nothing the loaded params share
    changes."""
    for key in path[:-1]:
        tree[key] = dict(tree[key])
        tree = tree[key]
    old = tree[path[-1]]
    new = old.astype(np.float32)
    new[where] += delta.reshape(new[where].shape)
    tree[path[-1]] = new.astype(old.dtype)


def module_key(name: str) -> str:
    """The model's name of the module a tensor `name` of the file adapts: what PEFT matches
    `rank_pattern`'s and `alpha_pattern`'s keys against."""
    return name.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]


def layer_config(config: TransformerConfig, layer: int) -> TransformerConfig:
    """`config` with layer `layer`'s FFN width: a mixture's dense layers (`dense_ffn_layers`)
    hold `dense_d_ff`."""
    return config.replace(d_ff=config.dense_d_ff) if layer in config.dense_ffn_layers else \
        config


def adapts_layer(config: TransformerConfig, targets: tuple[str, ...], layer: int) -> bool:
    """Whether a module holding `targets` is one of layer `layer`'s kernels: in a mixture
    an FFN's only in its dense layers (elsewhere its experts hold the FFN), a router's only
    beside experts, a shared expert's (and its gate's) there too, where the model has one."""
    beside_experts = bool(config.num_experts) and layer not in config.dense_ffn_layers
    if "router" in targets:
        return beside_experts
    if set(targets) & set(L.SHARED_EXPERT_TARGETS):
        return beside_experts and bool(config.shared_expert_d_ff) and (
            "shared_expert_gate" not in targets or config.shared_expert_gate)
    return not (beside_experts and set(targets) & set(L.EXPERT_TARGETS))


def fused_pair(config: TransformerConfig, layer: dict, targets: tuple[str, ...],
               trained: list[str], run_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """A [r, in] and B [out, r] of one module of the file that holds `targets` (B's rows in
    kvjax's order), from the adapters in `layer` of the `trained` ones: their A's stacked,
    their B's along the diagonal, zero rows for the others, B scaled so that PEFT's
    lora_alpha / r at the fused rank r stays the run's scale (a rank k times the run's takes
    k times B)."""
    pairs = [layer[target] for target in trained]
    peft_a = np.concatenate([np.asarray(p["lora_a"], np.float32).T for p in pairs])
    rank = peft_a.shape[0]
    peft_b = np.zeros((sum(L.widths(config, t)[1] for t in targets), rank), np.float32)
    row, column = 0, 0
    for target in targets:
        width = L.widths(config, target)[1]
        if target in trained:
            b = np.asarray(layer[target]["lora_b"], np.float32).T
            peft_b[row:row + width, column:column + b.shape[1]] = b
            column += b.shape[1]
        row += width
    return peft_a, peft_b * (rank / run_rank)
