"""Pretrained models from local Hugging Face directories: GPT-2, Llama, Mistral, Phi-2, Phi-3
(and Phi-4 mini), Qwen2, Qwen3, SmolLM3, Granite, Gemma (1, 2 and 3), OLMo 2, OLMo 3,
GPT-NeoX (Pythia), StableLM, StarCoder2, OPT, Marian and the mixtures of experts Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE, Granite 3 MoE, Phi-3.5-MoE and gpt-oss (`SUPPORTED_MODEL_TYPES`),
with a PEFT LoRA adapter merged in where one is given.

    config, tokenizer, params = kvjax.hf.load_pretrained("path/to/gpt2")

A directory in the Hugging Face layout holds `config.json`, `model.safetensors` (or shards
named by `model.safetensors.index.json`) and the tokenizer's files. Nothing is downloaded:
fetch a model yourself (e.g. `huggingface-cli download gpt2 --local-dir gpt2`). The loaded
model runs through the same interface, cache and decode loop as kvjax's own.

One module per part: `config.py` (config.json to `TransformerConfig`, refusing what is not
implemented: `reader.py` accounts for every key, `families.py`, `llama_like.py`,
`llama_aliases.py`, `output_norms.py`, `plain_ffn.py`, `weightless_norms.py` and `cohere.py`
read each model type's, `rope.py` RoPE's settings, `errors.py` the refusal), `weights.py`
(safetensors to params), `peft.py` (a PEFT adapter merged into them), `convert.py` (the
model written as a kvjax checkpoint).
The tokenizers of these directories are tokenizers like kvjax's own and live beside it:
`kvjax.tokenizer.huggingface` (tokenizer.json, tokenizer.model, or vocab.json and merges.txt,
as transformers reads them) and `kvjax.tokenizer.marian` (Marian's pair of sentencepiece
models).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from kvjax import model as M

from . import text_of_multimodal
from .config import SUPPORTED_MODEL_TYPES, UnsupportedModelError, read_hf_config, to_kvjax_config
from .peft import is_peft_directory, merge_peft_adapter
from .peft_served import peft_adapters
from .tensors import INDEX_FILE, SINGLE_FILE, WeightFiles
from .weights import load_params, ties_embeddings

__all__ = ["SUPPORTED_MODEL_TYPES", "UnsupportedModelError", "is_hf_directory",
           "is_peft_directory", "load_config", "load_model", "load_peft_adapters",
           "load_pretrained", "read_hf_config", "to_kvjax_config"]


def is_hf_directory(directory: str | os.PathLike) -> bool:
    """Whether `directory` looks like a Hugging Face model (config.json and safetensors) rather
    than a kvjax checkpoint."""
    path = Path(directory)
    return (path / "config.json").is_file() and (
        (path / SINGLE_FILE).is_file() or (path / INDEX_FILE).is_file()
        or (path / "pytorch_model.bin").is_file())


def load_config(directory: str | os.PathLike) -> M.TransformerConfig:
    """The float32 `TransformerConfig` of the model in `directory`, as `load_pretrained`
    reads it, without reading its weights."""
    return _config_and_files(directory, None)[0]


def load_pretrained(directory: str | os.PathLike, *, dtype: str | None = None, mesh=None,
                    scan_layers: bool | None = None, max_len: int | None = None,
                    lora: str | os.PathLike | None = None, kernel_dtype: str | None = None
                    ) -> tuple[M.TransformerConfig, Any, Any]:
    """`(config, tokenizer, params)` of the model in a local Hugging Face directory.

    `dtype` is the params' and the computation's ("float32", the default, or "bfloat16");
    with a `mesh` (`kvjax.parallel.make_mesh`) the params are placed in its layout, else on
    the default device. Layers come back held as `scan_layers` says (None: unrolled).
    `max_len` sets a RoPE model's longest sequence, up to its max_position_embeddings (None:
    that, or a LongRoPE model's original length, past which it turns with its long factors).
    `lora`, a PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors)
    trained on this model, is merged into the params (`peft.py`). `kernel_dtype="int8"`
    quantizes what `model.with_precision` quantizes (the layers' kernels and the embedding
    table) a kernel at a time, so the device never holds them in `dtype`.
    Raises `UnsupportedModelError` (a ValueError) for a model or setting kvjax does not
    implement, and ValueError/FileNotFoundError naming a missing or misshapen file or tensor;
    a tokenizer with more ids than the model's vocabulary is refused.
    """
    from kvjax.tokenizer.huggingface import load_tokenizer

    config, model_type, files = _config_and_files(directory, dtype, max_len)
    tokenizer = load_tokenizer(directory)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"{directory}: the tokenizer has {tokenizer.vocab_size} ids but the "
                         f"model's vocab_size is {config.vocab_size}")
    config, params = _params(config, model_type, files, mesh, scan_layers, lora, kernel_dtype)
    return config, tokenizer, params


def load_model(directory: str | os.PathLike, *, dtype: str | None = None, mesh=None,
               scan_layers: bool | None = None, max_len: int | None = None,
               lora: str | os.PathLike | None = None, kernel_dtype: str | None = None
               ) -> tuple[M.TransformerConfig, Any]:
    """`(config, params)` as `load_pretrained` reads them, without the tokenizer (a
    directory may then have none)."""
    config, model_type, files = _config_and_files(directory, dtype, max_len)
    return _params(config, model_type, files, mesh, scan_layers, lora, kernel_dtype)


def load_peft_adapters(directory: str | os.PathLike, adapter_directory: str | os.PathLike,
                       scan_layers: bool | None = None) -> tuple[Any, M.LoRA]:
    """`(adapters, lora)` of the PEFT LoRA adapter in `adapter_directory`, trained on the
    model in `directory`, unmerged, to serve beside others (`model.lora_rows`); its layers
    held as `scan_layers` says (None: unrolled), as `load_pretrained`'s params are."""
    config, model_type, _ = _config_and_files(directory, None)
    adapters, lora = peft_adapters(config, model_type, adapter_directory)
    if scan_layers:
        adapters = M.stack_layer_params(config, adapters)
    return jax.tree.map(jnp.asarray, adapters), lora


def _config_and_files(directory, dtype: str | None, max_len: int | None = None):
    hf = read_hf_config(directory)
    source = str(Path(directory) / "config.json")
    multimodal = text_of_multimodal.is_text_of_multimodal(hf)
    if multimodal:  # the language model alone (`text_of_multimodal.py`)
        hf = text_of_multimodal.text_config(hf, source)
    if hf.get("model_type") not in SUPPORTED_MODEL_TYPES:  # before reading any weights
        to_kvjax_config(hf, tied=True, source=source)
    files = WeightFiles(directory)
    if multimodal:
        files = text_of_multimodal.TextModelFiles(files)
    config = to_kvjax_config(hf, tied=ties_embeddings(hf["model_type"], files),
                             dtype=dtype or "float32", source=source, max_len=max_len)
    return config, hf["model_type"], files


def _params(config: M.TransformerConfig, model_type: str, files: WeightFiles, mesh,
            scan_layers: bool | None, lora: str | os.PathLike | None,
            kernel_dtype: str | None = None):
    params = load_params(config, model_type, files, jnp.dtype(config.param_dtype))
    if lora is not None:
        params = merge_peft_adapter(config, model_type, params, lora)
    if scan_layers:
        config, params = M.with_layer_layout(config, params, True)
    if kernel_dtype is not None:  # a kernel at a time; the rest stays on the host till below
        config, params = M.with_precision(config, params, kernel_dtype=kernel_dtype)
    if mesh is None:
        return config, jax.device_put(params)
    from kvjax import parallel

    parallel.check_model_axis(config, mesh)
    return config, parallel.shard_params(params, mesh)
