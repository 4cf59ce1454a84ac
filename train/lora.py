"""Training LoRA adapters on a frozen base checkpoint (`TrainConfig.lora`).

The training state's params are the adapters only (`model.lora`): the optimizer keeps its
moments for them alone and a checkpoint holds only them. The base params are read from the
checkpoint the run starts from and never change; every step differentiates the loss of the
merged params (base + scale · A B) with respect to the adapters. `config.json` of the run
records the LoRA settings and the base: its path, step and the SHA-256 over its params'
checksums (`checkpoint.params_digest`), so a resumed run, `kvjax sample --lora` and
`kvjax merge-lora` check that they hold the same base.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from kvjax import checkpoint
from kvjax import model as M
from kvjax.model import int8_base
from kvjax.model import lora as L

from .config import TrainConfig


def base_checkpoint(source: str | Path | None) -> str | Path:
    """The checkpoint a LoRA run adapts; a ValueError says to give one."""
    if source is None:
        raise ValueError("LoRA trains adapters on a base model: give the checkpoint to adapt "
                         "(init_from, --init-from)")
    return source


def as_base(params, lora: M.LoRA):
    """`params` held as the frozen base of a LoRA run: floating-point arrays in
    `lora.base_dtype` where it names one; for "int8", the layers' kernels as int8 with
    scales and the rest in bfloat16 (`model/int8_base.py`)."""
    if lora.base_dtype is None:
        return params
    if lora.int8_base:
        return int8_base.quantize_layers(params, jnp.bfloat16)
    return M.cast_floats(params, jnp.dtype(lora.base_dtype))


def record(train_config: TrainConfig, base: dict[str, Any]) -> dict[str, Any]:
    """The `lora` entry of a run's config.json: the settings and the base."""
    return {**train_config.lora.to_dict(), "base": base}


def check_same_base(out_dir: Path, base: dict[str, Any]) -> None:
    """Refuses to resume adapters on another base than they were trained on."""
    saved = (checkpoint.read_lora(out_dir) or {}).get("base") or {}
    if saved.get("params_sha256") != base["params_sha256"]:
        raise checkpoint.CheckpointError(
            f"cannot resume {out_dir}: its adapters were trained on the params of "
            f"{saved.get('checkpoint')} (step {saved.get('step')}), and {base['checkpoint']} "
            "now holds other params")


def init_adapters(model_config: M.TransformerConfig, train_config: TrainConfig, base) -> Any:
    """Fresh adapters for the run's seed."""
    key = jax.random.fold_in(jax.random.key(train_config.seed), 1)
    return L.init_adapters(model_config, base, train_config.lora, key)


@functools.partial(jax.jit, static_argnums=(0, 3))
def merged(model_config: M.TransformerConfig, base, adapters, lora: M.LoRA) -> Any:
    """The params the model runs with: the base with the adapters merged in."""
    return L.merge(model_config, int8_base.dequantize_layers(base), adapters, lora)


def model_params(model_config: M.TransformerConfig, train_config: TrainConfig, params,
                 base) -> Any:
    """The params a run's state stands for: its params, or the base with its adapters, in
    the dtypes the model declares. A base held in bfloat16 or int8 merges into bfloat16
    arrays, which decoding (a translation run's evaluation) refuses for a float32 model;
    widened, their values are the same."""
    if train_config.lora is None:
        return params
    return jax.tree.map(lambda x, declared: x.astype(declared.dtype),
                        merged(model_config, base, params, train_config.lora),
                        M.param_shapes(model_config))


def merge_into_checkpoint(base: str | Path, adapters: str | Path, out: str | Path) -> Path:
    """Writes the base checkpoint with the adapters merged in as a whole model into the new
    directory `out` (what `kvjax merge-lora` does): its config.json, tokenizer and task are
    the base's, its layers unrolled (the default layout)."""
    config, tokenizer, params = checkpoint.load_for_sampling(base, lora=adapters)
    _, task, _ = checkpoint.read_metadata(base)
    return checkpoint.write_model(out, config.to_dict(), task, tokenizer.to_bytes(), params)

