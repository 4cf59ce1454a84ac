"""LoRA against full fine-tuning: training tokens per second and peak memory of one step.

Both run `kvjax.train.update.train_step` on the same model, batch and AdamW: full
fine-tuning updates every param (the optimizer holds two moments of each); LoRA
(`TrainConfig.lora`) trains adapters on the chosen kernels of frozen base params. The peak
memory of a step is what XLA's compiled program needs at once (`memory_analysis`):
its arguments (params, base, optimizer state, batch) and outputs, less those the step
writes in place of its donated inputs, plus its temporaries (gradients, activations);
the same count on every backend, and on a GPU what the device must hold for the step.
Timing is as in `benchmarks/train.py`: warmed up, then the best of `repeats` runs of
`steps` steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from kvjax import model as M
from kvjax.model.cache_size import format_bytes

from .decode import _machine
from .train import _best_step_seconds, kvjax_step, model_config


@dataclasses.dataclass(frozen=True)
class LoraRow:
    name: str
    step_seconds: float
    tokens_per_step: int
    peak_bytes: int
    trained_params: int

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_seconds


def lora_benchmark(preset: str = "gpt2-small", batch_size: int = 4, seq_len: int = 256,
                   rank: int = 8, targets: tuple[str, ...] = M.lora.DEFAULT_TARGETS,
                   steps: int = 3, repeats: int = 2, dtype: str = "float32",
                   base_dtypes: tuple[str | None, ...] = (None, "bfloat16"),
                   remat_modes: tuple[bool, ...] = (False,),
                   log: Callable[[str], None] = print) -> tuple[list[LoraRow], str]:
    """Full fine-tuning, then LoRA of `rank` on `targets` over a base held in each of
    `base_dtypes` (None: as the params are, float32), each without and/or with the layers
    rematerialized (`remat_modes`); returns the rows and a line naming the setting and
    machine. The first row, full fine-tuning without remat if asked, is what the others are
    compared with."""
    config = model_config(preset).replace(dtype=dtype, scan_layers=True)
    if seq_len > config.max_len:
        raise ValueError(f"seq_len {seq_len} exceeds the {preset} max_len {config.max_len}")
    tokens = np.random.default_rng(0).integers(3, config.vocab_size, (batch_size, seq_len + 1))
    batch = {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}
    rows = []
    contenders = [("full fine-tuning", None)] + [
        (f"LoRA r={rank} on {', '.join(targets)}, {base or 'float32'} base",
         M.LoRA(rank, None, targets, base)) for base in base_dtypes]
    runs = []
    for name, lora in contenders:
        # An int8 base always runs its layers rematerialized (`model/int8_base.py`): one row.
        int8 = lora is not None and lora.int8_base
        for remat in (max(remat_modes),) if int8 else remat_modes:
            runs.append((name + (", remat" if remat else ", layers remat" if int8 else ""),
                         lora, remat))
    for name, lora, remat in runs:
        log(f"{name} ...")
        step = kvjax_step(config, batch, lora=lora, remat=remat)
        rows.append(LoraRow(name, _best_step_seconds(step.run, steps, repeats),
                            batch_size * seq_len, step.peak_bytes, step.trained_params))
        del step  # the state's buffers go before the next contender's
    setting = (f"Fine-tuning, `{preset}` sizes in {dtype} (float32 params), batch "
               f"{batch_size} x {seq_len} tokens, AdamW with clipping; best of {repeats} x "
               f"{steps} steps. Machine: {_machine()}.")
    return rows, setting


def format_lora_table(rows: list[LoraRow], setting: str) -> str:
    full = rows[0]
    lines = [setting, "", "| contender | trained params | tokens/s | peak memory of a step "
             "| vs full: speed | vs full: memory |", "|:---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.name} | {r.trained_params:,} | {r.tokens_per_second:,.0f} | "
                     f"{format_bytes(r.peak_bytes)} | "
                     f"{r.tokens_per_second / full.tokens_per_second:.2f}x | "
                     f"{r.peak_bytes / full.peak_bytes:.0%} |")
    return "\n".join(lines)
