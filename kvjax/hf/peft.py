"""PEFT's LoRA adapters of a Hugging Face model: merged into its kvjax params as it loads, and
written from adapters kvjax trained on it (`export_peft_adapter`).

A PEFT adapter directory holds `adapter_config.json` and `adapter_model.safetensors`, whose
tensors are named by the module they adapt (`base_model.model.model.layers.3.self_attn.
q_proj.lora_A.weight`): A [r, in] and B [out, r], the update to the module's torch weight
[out, in] being scale · B A, with scale = lora_alpha / r (lora_alpha / √r with `use_rslora`;
a module's own lora_alpha where a key of `alpha_pattern` ends its name). Merged here,
kvjax's kernel [in, out] gains scale · Aᵀ Bᵀ, summed in float32: what
`PeftModel.merge_and_unload` computes, and what the unmerged model computes up to rounding.
A module that kvjax fuses (q, k and v) takes its update into its heads' slice; a module the
file fuses (Phi-3's qkv_proj and gate_up_proj, GPT-2's c_attn) spreads its update over
kvjax's targets. A mixture's experts, adapted through `target_parameters`, hold a pair per
expert, read and written by `peft_experts.py`; DeepSeek's latent attention's modules by
`peft_latent.py`; an encoder-decoder's (Marian's, T5's), by `peft_seq2seq.py`. Which module
of each layout holds which of kvjax's targets, and in which order its rows are, is
`peft_modules.py`'s.

As with config.json (`reader.py`), every key of adapter_config.json is read, known to change
nothing once trained, or refused by name; every tensor must adapt a module of the model.
Written, the modules a file fuses take kvjax's targets' A matrices stacked and their B
matrices along the diagonal, which adds each target's update and no other.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from kvjax.model import TransformerConfig
from kvjax.model import lora as L

from . import peft_experts, peft_latent, peft_seq2seq, text_of_multimodal
from .errors import UnsupportedModelError
from .peft_modules import (
    LANGUAGE_MODEL_LAYERS,
    MODULES,
    adapts_layer,
    add_to_kernel,
    fused_pair,
    layer_config,
    layer_prefixes,
    module_key,
    module_table,
    reorders,
    rows_in_file_order,
    rows_in_kvjax_order,
)
from .reader import Reader, read_json_object
from .tensors import WeightFiles
from .weights import LAYOUTS, ties_embeddings

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# Keys that shape only how adapters were made or trained, or that the tensors already say
# (which modules and layers have adapters, at which rank), or bookkeeping.
_TRAINED_NEUTRAL = frozenset({
    "peft_version", "auto_mapping", "base_model_name_or_path", "revision", "task_type",
    "inference_mode", "lora_dropout", "loftq_config", "eva_config",
    "corda_config", "lora_ga_config", "target_modules", "exclude_modules",
    "layers_to_transform", "layers_pattern", "rank_pattern", "megatron_core",
    "qalora_group_size", "ensure_weight_tying", "fan_in_fan_out"})

# A mixture's router's weight, as `target_parameters` names it (PEFT's all-linear adapts it),
# and the router module it belongs to.
ROUTER_PARAM = "gate.weight"
ROUTER_MODULE = "mlp.gate"

# The layouts whose shared expert's modules PEFT, for transformers 5, reads as the experts'
# (any gate_proj, up_proj or down_proj of these mixtures): adapters trained before transformers
# 5.0 hold them, and merge; kvjax does not write them.
_SHARED_READ_AS_EXPERTS = ("ernie_moe", "deepseek_moe", "deepseek_latent", "hunyuan_moe")

# Initialisations that change the base weights as they make A and B: an adapter trained from
# one adds to those weights, not to the ones the model's directory holds.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")

# A vision-language model's vision encoder and projector, which text never runs through: an
# adapter's tensors of them are left unread, as the directory's own tensors of them are.
_VISION_MODULES = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?"
                             r"(?:vision_tower|multi_modal_projector)\.")


def _tensor_pattern(model_type: str) -> re.Pattern:
    """Matches a tensor name of an adapter of `model_type`: (layer, module, "A" or "B")."""
    prefixes = "|".join(re.escape(prefix) for prefix in layer_prefixes(model_type))
    return re.compile(rf"^(?:base_model\.model\.)?(?:{prefixes})\.(\d+)\.(.+)\.lora_([AB])"
                      rf"\.weight$")


def _check_supported(model_type: str, refusal: str) -> None:
    """`UnsupportedModelError(refusal...)` where kvjax holds no module table of `model_type`'s
    files."""
    if LAYOUTS.get(model_type) not in MODULES:
        supported = sorted(t for t, layout in LAYOUTS.items() if layout in MODULES)
        raise UnsupportedModelError(f"{refusal}; kvjax's LoRA adapters are those of "
                                    f"{', '.join(supported)}")


def is_peft_directory(directory: str | os.PathLike) -> bool:
    return (Path(directory) / CONFIG_FILE).is_file()


def merge_peft_adapter(config: TransformerConfig, model_type: str, params: dict,
                       directory: str | os.PathLike) -> dict:
    """`params` (unrolled layers, NumPy arrays, as `weights.load_params` returns them) with
    the PEFT LoRA adapter in `directory` merged into their kernels, each kept in its dtype.
    Raises `UnsupportedModelError` for a setting kvjax does not merge and ValueError naming a
    tensor that adapts nothing kvjax holds."""
    scale_of, modules, pairs = read_pairs(config, model_type, Path(directory))
    if LAYOUTS[model_type] in peft_seq2seq.LAYOUTS:
        return peft_seq2seq.merged(LAYOUTS[model_type], config, params, pairs, scale_of)
    merged = {**params, "layers": {i: dict(layer) for i, layer in params["layers"].items()}}
    for layer, module, a, b, name in pairs:
        if module in peft_experts.wrappers(LAYOUTS[model_type]):
            peft_experts.add_to_experts(config, LAYOUTS[model_type], merged["layers"][str(layer)],
                                        a, b, scale_of, module_key(name), name)
            continue
        one_expert = peft_experts.per_expert(LAYOUTS[model_type], module, config.num_experts)
        if one_expert:
            expert, target = one_expert
            peft_experts.add_to_expert(config, merged["layers"][str(layer)], expert, target,
                                       *peft_experts.expert_pair(
                                           config, target, a, b,
                                           scale_of(a.shape[0], module_key(name)), name), name)
            continue
        if LAYOUTS[model_type] == peft_latent.LAYOUT:
            peft_latent.merge(layer_config(config, layer), merged["layers"][str(layer)], module,
                              a, b, scale_of(a.shape[0], module_key(name)), name)
            continue
        update = scale_of(a.shape[0], module_key(name)) * (a.astype(np.float32).T @
                                                          b.astype(np.float32).T)
        if reorders(config, model_type, module):
            update = rows_in_kvjax_order(config, model_type, module, update.T, name).T
        _add(layer_config(config, layer), merged["layers"][str(layer)], modules[module], update,
             name)
    return merged


def read_pairs(config: TransformerConfig, model_type: str, directory: Path):
    """(the scale of a rank, the module table, (layer, module, A [r, in], B [out, r], the
    name of B) of every module the adapter in `directory` adapts), every tensor and setting
    checked."""
    scale_of, expert_params = _scaling(directory)
    if expert_params and not config.num_experts:
        raise UnsupportedModelError(f"{directory}: target_parameters={json.dumps(expert_params)}"
                                    f" adapt experts, and this {model_type} model has none")
    layout = LAYOUTS.get(model_type)
    if layout in peft_seq2seq.LAYOUTS:  # an encoder's and a decoder's layers
        modules = peft_seq2seq.LAYOUTS[layout].modules
        locate = functools.partial(peft_seq2seq.locate, layout, model_type, config, directory)
    else:
        _check_supported(model_type, f"{directory}: PEFT adapters of {model_type!r} models "
                                     "are not supported")
        modules = module_table(config, layout)
        if layout == peft_latent.LAYOUT:
            modules = peft_latent.modules(config)
        pattern = _tensor_pattern(model_type)
        known = modules if not expert_params else {**modules, **peft_experts.wrappers(layout)}

        def locate(name):
            match = pattern.match(name)
            one_expert = match is not None and peft_experts.per_expert(
                layout, match[2], config.num_experts)
            if match is None or int(match[1]) >= config.num_decoder_layers or not one_expert and (
                    match[2] not in known or not adapts_layer(config, known[match[2]],
                                                              int(match[1]))):
                raise ValueError(f"{directory}: tensor {name} adapts no module kvjax merges "
                                 f"into a {model_type} model (its layers' {', '.join(modules)})")
            return int(match[1]), match[2], match[3]
    files = WeightFiles(directory, single_file=WEIGHTS_FILE)
    names: dict[tuple, dict[str, str]] = {}
    for name in sorted(files.names()):
        if not _VISION_MODULES.match(name):
            layer, module, half = locate(name)
            names.setdefault((layer, module), {})[half] = name
    pairs = []
    for (layer, module), held in sorted(names.items()):
        if set(held) != {"A", "B"}:
            (one,) = held
            raise ValueError(f"{directory}: {module} of layer {layer} has lora_{one} without "
                             f"its lora_{({'A', 'B'} - {one}).pop()}")
        a, b = files.read(held["A"]), files.read(held["B"])
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"{directory}: {held['A']} {list(a.shape)} and {held['B']} "
                             f"{list(b.shape)} are not the [r, in] and [out, r] of one rank")
        pairs.append((layer, module, a, b, held["B"]))
    return scale_of, modules, pairs


def _scaling(directory: Path):
    """What multiplies B A, as a function of the rank; the config's keys checked."""
    path = directory / CONFIG_FILE
    values = read_json_object(path, f"{directory} has no {CONFIG_FILE}: not a PEFT adapter")
    c = Reader(values, str(path), neutral=_TRAINED_NEUTRAL)
    c.expect("peft_type", "LORA", "LORA", "kvjax merges LoRA adapters")
    c.expect("bias", "none", "none", "adapters that train biases")
    alpha_pattern = c.get("alpha_pattern") or {}
    c.get("r")  # each module's rank is its tensors'
    init = c.get("init_lora_weights", True)
    if isinstance(init, str) and init.startswith(_BASE_CHANGING_INITS):
        raise UnsupportedModelError(
            f"{path}: init_lora_weights={json.dumps(init)} changed the base weights the adapter "
            "was trained over, so it does not add to the model's own; save it with PEFT's "
            "path_initial_model_for_weight_conversion, which writes it as a plain LoRA adapter")
    alpha = c.require("lora_alpha")
    rslora = bool(c.get("use_rslora", False))
    expert_params = c.get("target_parameters") or []
    if not isinstance(expert_params, list) or not all(
            isinstance(p, str) and (p.split(".")[-1] in peft_experts.PARAM_NAMES
                                    or p == ROUTER_PARAM or p.endswith(f".{ROUTER_PARAM}"))
            for p in expert_params):
        raise UnsupportedModelError(f"{path}: target_parameters={json.dumps(expert_params)} "
                                    "is not supported (kvjax merges adapters of a mixture's "
                                    "experts.gate_up_proj, experts.down_proj and its router's "
                                    f"{ROUTER_PARAM})")
    c.refuse_unread()  # DoRA, biases, whole modules saved, token adapters, ...
    for value in (alpha, *alpha_pattern.values()):
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"{path}: lora_alpha={value!r} must be a number > 0")

    def scale_of(rank: int, key: str) -> float:
        """The scale of the module or parameter `key` (its name in the model, as PEFT
        matches `alpha_pattern`'s keys against it: the first key that ends it)."""
        chosen = next((value for pattern, value in alpha_pattern.items()
                       if re.match(rf"(.*\.)?({pattern})$", key)), alpha)
        return chosen / (math.sqrt(rank) if rslora else rank)

    return scale_of, expert_params


def output_widths(config: TransformerConfig, targets: tuple[str, ...], update_shape: tuple,
                   name: str) -> list[int]:
    """Each target's output width, the update [in, out] of one module of the file checked to
    take the targets' inputs to all their outputs."""
    inputs = L.widths(config, targets[0])[0]
    widths = [L.widths(config, target)[1] for target in targets]
    if tuple(update_shape) != (inputs, sum(widths)):
        raise ValueError(f"tensor {name} makes an update of {list(update_shape)}; the model's "
                         f"{'+'.join(targets)} takes {inputs} inputs to {sum(widths)} outputs")
    return widths


def _add(config: TransformerConfig, layer: dict, targets: tuple[str, ...],
         update: np.ndarray, name: str) -> None:
    """The update [in, out] of one module of the file, split along its outputs over kvjax's
    `targets`, added to their kernels in `layer` (new arrays; the loaded ones are not changed)."""
    widths = output_widths(config, targets, update.shape, name)
    pieces = np.split(update, np.cumsum(widths)[:-1], axis=1)
    for target, piece in zip(targets, pieces, strict=True):
        kernel = L.kernel_path(config, target)
        where = ...
        if kernel[-1] == "qkv":  # its heads' slice
            start, heads = L.qkv_heads(config, target)
            where = (slice(None), slice(start, start + heads))
        add_to_kernel(layer, (*kernel, "kernel"), piece, where)


def export_peft_adapter(adapter_dir: str | os.PathLike, hf_directory: str | os.PathLike,
                        out: str | os.PathLike) -> Path:
    """Writes the LoRA adapters of a `kvjax train --lora-rank` run into `out` as a PEFT
    adapter of the Hugging Face model in `hf_directory`, which must be the model they were
    trained on (its params' digest is the one the run records of its base, as when the run
    started from `--init-from hf_directory`). Returns `out`.

    Each kvjax target becomes its file's module: q, k, v as q_proj, k_proj and v_proj (or
    the rows of Phi-3's qkv_proj and GPT-2's c_attn: their A's stacked, their B's along the
    diagonal, B scaled so that lora_alpha / r stays the run's scale at the fused rank, which
    `rank_pattern` gives), wi and wi_gate as gate_proj and up_proj (or gate_up_proj).
    `PeftModel.from_pretrained` then computes what kvjax computes with the adapters."""
    from kvjax import checkpoint
    from kvjax import model as M

    from .config import read_hf_config, to_kvjax_config
    from .weights import load_params

    out = Path(out)
    if (out / CONFIG_FILE).exists():
        raise FileExistsError(f"{out} already holds a PEFT adapter; write into a new directory")
    settings, trained, base, adapters = checkpoint.read_adapters(adapter_dir)
    hf = read_hf_config(hf_directory)
    source = str(Path(hf_directory) / "config.json")
    files = WeightFiles(hf_directory)
    # A vision-language release's language model: its own config and tensors, its layers
    # named as the wrapper holds them, where PEFT finds their modules.
    multimodal = text_of_multimodal.is_text_of_multimodal(hf)
    if multimodal:
        hf = text_of_multimodal.text_config(hf, source)
        files = text_of_multimodal.TextModelFiles(files)
    model_type = hf.get("model_type")
    if LAYOUTS.get(model_type) not in peft_seq2seq.LAYOUTS:
        _check_supported(model_type, f"{hf_directory}: PEFT adapters of {model_type!r} models "
                                     "are not written")
    config = to_kvjax_config(hf, tied=ties_embeddings(model_type, files), dtype=trained.param_dtype,
                             source=source)
    # How fast and in which layout and compute dtype it ran change nothing in the weights.
    same_running = {name: getattr(trained, name) for name in (
        *M.SPEED_ONLY_FIELDS, "max_len", "scan_layers", "dtype")}
    if config.replace(**same_running) != trained:
        raise ValueError(f"the LoRA adapters in {adapter_dir} were trained for another model "
                         f"config than the one of {hf_directory}")
    params = load_params(config, model_type, files, np.dtype(config.param_dtype))
    if checkpoint.params_digest_of(params) != base.get("params_sha256"):
        raise ValueError(f"the LoRA adapters in {adapter_dir} were trained on other params than "
                         f"those of {hf_directory} (their base was {base.get('checkpoint')})")
    if trained.scan_layers:
        adapters = M.unstack_layer_params(trained, adapters)
    return write_peft_adapter(config, model_type, adapters, settings, out, str(hf_directory),
                              layer_prefix=LANGUAGE_MODEL_LAYERS[0] if multimodal else None)


def write_peft_adapter(config: TransformerConfig, model_type: str, adapters: dict,
                       settings: L.LoRA, out: str | os.PathLike, base_name: str,
                       layer_prefix: str | None = None) -> Path:
    """Writes `adapters` (`model.lora`'s, unrolled layers) of a `model_type` model as a PEFT
    adapter into `out`, naming `base_name` as its base model; returns `out`. The layers'
    modules are named under `layer_prefix` (None: where `model_type`'s own files hold them;
    an encoder-decoder's as `peft_seq2seq.py` names them). Adapters of a mixture's experts
    adapt its stacked experts' parameters (`peft_experts.py`); those of the dense FFN of a
    mixture's first layers are refused: PEFT reads a mixture's gate_proj, up_proj and
    down_proj as its experts', and so are those of the shared experts PEFT reads so; a
    router's adapt its `mlp.gate.weight` parameter."""
    dense = [t for t in settings.targets if t in L.EXPERT_TARGETS]
    if config.num_experts and config.dense_ffn_layers and dense:
        raise ValueError(f"adapters of the dense FFN of the layers "
                         f"{list(config.dense_ffn_layers)} of a {model_type} model "
                         f"({', '.join(dense)}) are not written as a PEFT adapter (PEFT reads a "
                         "mixture's gate_proj, up_proj and down_proj as its experts'); `kvjax "
                         "merge-lora` writes the merged model")
    if "router" in settings.targets and not any(
            targets == ("router",) for targets in MODULES[LAYOUTS[model_type]].values()):
        raise ValueError(f"adapters of the router of a {model_type} model are not written as a "
                         "PEFT adapter; `kvjax merge-lora` writes the merged model")
    shared = [t for t in settings.targets if t in L.SHARED_EXPERT_TARGETS]
    if shared and LAYOUTS[model_type] in _SHARED_READ_AS_EXPERTS:
        raise ValueError(f"adapters of the shared expert of a {model_type} model "
                         f"({', '.join(shared)}) are not written as a PEFT adapter (PEFT reads "
                         "its gate_proj, up_proj and down_proj as its experts'); `kvjax "
                         "merge-lora` writes the merged model")
    seq2seq = LAYOUTS[model_type] in peft_seq2seq.LAYOUTS
    if seq2seq:
        tensors, modules = peft_seq2seq.peft_tensors(LAYOUTS[model_type], config, adapters,
                                                     settings.targets)
        ranks = dict.fromkeys(modules, settings.rank)
    else:
        prefix = layer_prefix or layer_prefixes(model_type)[0]
        if LAYOUTS[model_type] == peft_latent.LAYOUT:
            tensors, ranks = peft_latent.peft_tensors(config, adapters["layers"], settings,
                                                      prefix)
        else:
            tensors, ranks = _peft_tensors(config, model_type, adapters["layers"], settings,
                                           prefix)
    expert_tensors, expert_params, expert_rank = peft_experts.peft_tensors(
        config, LAYOUTS[model_type], adapters["layers"], settings, prefix) if not seq2seq \
        else ({}, [], 0)
    tensors.update(expert_tensors)
    # rank_pattern names modules, so the experts' parameters take the top rank.
    top_rank = expert_rank if expert_params else settings.rank
    if not seq2seq and "router" in settings.targets and ROUTER_MODULE in MODULES[
            LAYOUTS[model_type]]:
        tensors.update(_router_tensors(adapters["layers"], settings, prefix, top_rank))
        expert_params = [*expert_params, f"{ROUTER_MODULE}.weight"]
    peft_config = {
        "peft_type": "LORA", "base_model_name_or_path": base_name,
        "task_type": "SEQ_2_SEQ_LM" if seq2seq else "CAUSAL_LM",
        "r": top_rank, "lora_alpha": settings.rank * settings.scale,
        # Module paths' ends ("attn.c_proj", not "c_proj", which GPT-2's MLP has too).
        "target_modules": sorted(ranks),
        "rank_pattern": {name: rank for name, rank in sorted(ranks.items())
                         if rank != top_rank},
        "fan_in_fan_out": model_type == "gpt2", "bias": "none", "use_rslora": False,
        "use_dora": False, "lora_dropout": 0.0, "inference_mode": True}
    if expert_params:
        peft_config["target_parameters"] = expert_params
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE))
    (out / CONFIG_FILE).write_text(json.dumps(peft_config, indent=2) + "\n", encoding="utf-8")
    return out


def _router_tensors(layers: dict, settings: L.LoRA, prefix: str, rank: int
                   ) -> dict[str, np.ndarray]:
    """The routers' adapters as PEFT's pairs over `mlp.gate`'s weight (a parameter of the
    router module, which is no Linear), A [rank, D] and B [experts, rank] at the file's top
    rank: zeros past the run's rank, B scaled so that lora_alpha over that rank stays the
    run's scale."""
    tensors = {}
    for index, layer in sorted(layers.items(), key=lambda item: int(item[0])):
        if "router" not in layer:  # a dense layer
            continue
        lora_a = np.asarray(layer["router"]["lora_a"], np.float32)  # [D, r]
        lora_b = np.asarray(layer["router"]["lora_b"], np.float32)  # [r, experts]
        peft_a = np.zeros((rank, lora_a.shape[0]), np.float32)
        peft_b = np.zeros((lora_b.shape[1], rank), np.float32)
        peft_a[:settings.rank], peft_b[:, :settings.rank] = lora_a.T, lora_b.T
        name = f"base_model.model.{prefix}.{index}.{ROUTER_MODULE}"
        tensors[f"{name}.lora_A.weight"] = peft_a
        tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(peft_b * (rank / settings.rank))
    return tensors


def _peft_tensors(config: TransformerConfig, model_type: str, layers: dict, settings: L.LoRA,
                  prefix: str):
    """(the file's tensors, the rank of each module path that has them)."""
    tensors: dict[str, np.ndarray] = {}
    ranks: dict[str, int] = {}
    for module, targets in module_table(config, LAYOUTS[model_type]).items():
        trained = [t for t in targets if t in settings.targets]
        if not trained or module == ROUTER_MODULE:  # the router's: `_router_tensors`
            continue
        for index, layer in sorted(layers.items(), key=lambda item: int(item[0])):
            # Not a mixture's experts (`peft_experts.py`'s), nor a shared expert's in a layer
            # without one.
            here = [t for t in trained if t in layer
                    and not peft_experts.is_experts_pair(layer[t])]
            if not here:
                continue
            peft_a, peft_b = fused_pair(layer_config(config, int(index)), layer, targets, here,
                                    settings.rank)
            rank = peft_a.shape[0]
            if reorders(config, model_type, module):
                peft_b = np.ascontiguousarray(rows_in_file_order(config, model_type, module,
                                                                 peft_b))
            name = f"base_model.model.{prefix}.{index}.{module}"
            # C order: the file is written from the arrays' memory as it lies.
            tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(peft_a)
            tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(peft_b)
            ranks[module] = rank
    return tensors, ranks
