"""The training benchmark: training tokens per second, kvjax against PyTorch eager.

kvjax runs `kvjax.train.update.train_step` (AdamW, global-norm clipping, one compiled step) on
a decoder-only LM of a preset's sizes with random tokens, on one device and, with
`devices > 1`, with each batch split over that many devices (`data` of a mesh; on a CPU,
host devices). PyTorch runs Hugging Face's GPT-2 of the same sizes in eager mode with the
same batch, sequence length, AdamW and clipping (optional: `pip install -e ".[bench]"`).
Every contender is warmed up, then timed over `steps` steps; the best of `repeats` timings
counts, for every contender alike. Tokens per second count every input token of the batch.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable

import jax
import numpy as np

from kvjax import model as M
from kvjax import parallel

from .decode import _machine

LAYER_MODES = ("scanned", "unrolled")


@dataclasses.dataclass(frozen=True)
class TrainRow:
    """One contender: seconds per training step at the benchmark's batch and length."""

    name: str
    step_seconds: float
    tokens_per_step: int

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_seconds


def _best_step_seconds(step: Callable[[], object], steps: int, repeats: int) -> float:
    jax.block_until_ready(step())  # compiles (kvjax) or warms up (PyTorch)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            out = step()
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / steps)
    return best


def _kvjax_step(config: M.TransformerConfig, batch_np: dict, mesh,
                deterministic: bool = False) -> Callable[[], object]:
    from kvjax.train import update
    from kvjax.train.config import TrainConfig

    train_config = TrainConfig(steps=10_000, batch_size=len(batch_np["inputs"]), warmup_steps=10,
                               progress=False, deterministic=deterministic)
    step_config = update.compiled_fields(train_config)
    holder = {"state": update.init_state(config, train_config, mesh)}
    batch = batch_np if mesh is None else parallel.shard_batch(batch_np, mesh)

    def step():
        holder["state"], loss = update.train_step(config, step_config, holder["state"], batch,
                                                  mesh=mesh)
        return loss

    return step


def _torch_step(config: M.TransformerConfig, batch_np: dict) -> tuple[Callable | None, str]:
    try:
        import torch
        import transformers
    except ImportError:
        return None, "not installed (pip install -e '.[bench]')"
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.max_len, n_embd=config.d_model,
        n_layer=config.num_decoder_layers, n_head=config.num_heads, n_inner=config.d_ff,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        pad_token_id=0)).train()
    optimizer = torch.optim.AdamW(gpt2.parameters(), lr=1e-3, betas=(0.9, 0.98),
                                  weight_decay=0.01)
    inputs = torch.as_tensor(batch_np["inputs"], dtype=torch.long)
    labels = torch.as_tensor(batch_np["targets"], dtype=torch.long)

    def step():
        optimizer.zero_grad(set_to_none=True)
        logits = gpt2(inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(gpt2.parameters(), 1.0)
        optimizer.step()
        return None

    note = (f"transformers {transformers.__version__}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, eager")
    return step, note


def train_benchmark(preset: str = "gpt-mini", batch_size: int = 8, seq_len: int = 256,
                    steps: int = 5, repeats: int = 3, *, devices: int = 1,
                    layer_modes: tuple[str, ...] = LAYER_MODES, compare_torch: bool = True,
                    deterministic: tuple[bool, ...] = (False,),
                    log: Callable[[str], None] = print) -> tuple[list[TrainRow], str]:
    """Times every contender; returns the rows and a line naming the setting and machine.
    kvjax runs once for each setting of `TrainConfig.deterministic` in `deterministic`."""
    config = M.preset(preset)
    if seq_len > config.max_len:
        raise ValueError(f"seq_len {seq_len} exceeds the {preset} max_len {config.max_len}")
    if devices > jax.device_count():
        raise ValueError(f"devices={devices} but JAX sees {jax.device_count()}; on a CPU, "
                         f"start with XLA_FLAGS=--xla_force_host_platform_device_count="
                         f"{devices}")
    if batch_size % devices:
        raise ValueError(f"batch size {batch_size} is not divisible by devices={devices}")
    unknown = sorted(set(layer_modes) - set(LAYER_MODES))
    if unknown or not layer_modes:
        raise ValueError(f"layer modes {unknown or list(layer_modes)} not in {LAYER_MODES}")
    tokens = np.random.default_rng(0).integers(3, config.vocab_size, (batch_size, seq_len + 1))
    batch = {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}
    meshes = {1: None}
    if devices > 1:
        meshes[devices] = parallel.make_mesh(f"data={devices}", jax.devices()[:devices])
    rows = []
    for mode in layer_modes:
        mode_config = config.replace(scan_layers=mode == "scanned")
        for (count, mesh), exact in itertools.product(meshes.items(), deterministic):
            name = (f"kvjax, {mode} layers, {count} device{'s' if count > 1 else ''}"
                    f"{', deterministic' if exact else ''}")
            log(f"{name} ...")
            seconds = _best_step_seconds(_kvjax_step(mode_config, batch, mesh, exact), steps,
                                         repeats)
            rows.append(TrainRow(name, seconds, batch_size * seq_len))
    step, note = _torch_step(config, batch) if compare_torch else (None, "skipped")
    if step is not None:
        log("PyTorch eager, Hugging Face GPT-2 ...")
        rows.append(TrainRow("PyTorch eager (HF GPT-2)",
                             _best_step_seconds(step, steps, repeats), batch_size * seq_len))
    setting = (f"Training, `{preset}` sizes, batch {batch_size} x {seq_len} tokens, AdamW with "
               f"clipping; best of {repeats} x {steps} steps. Machine: {_machine()}. "
               f"PyTorch: {note}.")
    return rows, setting


def format_train_table(rows: list[TrainRow], setting: str) -> str:
    """A Markdown table: tokens/s and step time per contender, and the ratio to PyTorch."""
    torch_rows = [r for r in rows if r.name.startswith("PyTorch")]
    reference = torch_rows[0].tokens_per_second if torch_rows else None
    lines = [setting, "", "| contender | tokens/s | step ms | vs PyTorch |",
             "|:---|---:|---:|---:|"]
    for r in rows:
        ratio = "-" if reference is None else f"{r.tokens_per_second / reference:.2f}x"
        lines.append(f"| {r.name} | {r.tokens_per_second:,.0f} | {r.step_seconds * 1e3:.1f} "
                     f"| {ratio} |")
    return "\n".join(lines)
