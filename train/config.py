"""What a training run is given: how to train (`TrainConfig`: optimizer, schedule, evaluation,
logging, checkpointing) and what to learn from (`TrainTask`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from kvjax.model import LoRA
from kvjax.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How to train: optimizer, schedule, evaluation, logging and checkpointing.

    The learning rate rises linearly from 0 over `warmup_steps`, then follows a cosine down to
    `learning_rate * final_lr_fraction` at `steps`. Weight decay applies to kernels and
    embedding tables only (`update.decay_mask`), not to biases or norm scales. Periodic evaluations
    use the first `eval_batches` validation batches (0: all of them); the final one always
    uses all. A checkpoint is saved every `save_every` steps (None: a tenth of `steps`), at the
    end, and at the current step when the process gets SIGINT or SIGTERM.

    `deterministic` compiles the training step with XLA's deterministic ops on a GPU (no
    atomics in scatter-adds and reductions, no timing-based choice of matmul kernels), so the
    same seed gives bit-identical losses and a resumed run continues bit-identically there as
    on a CPU or TPU, where it changes nothing. Its attention is XLA's own, not cuDNN's fused
    kernel (`kvjax.model.fused_attention`). It is off by default because it costs a GPU a
    noticeable share of every step (`kvjax bench train --deterministic both` measures it).

    `remat` recomputes each layer's activations in the backward pass instead of keeping
    them from the forward pass (`TransformerConfig.remat`), and the output logits a part of
    the tokens at a time (`update.chunked_cross_entropy_sum`): a step holds one layer's
    activations and one part's logits rather than all of them, for one more forward pass of
    compute. The losses are the same up to float rounding.

    `lora` trains low-rank adapters on the chosen kernels of a frozen base checkpoint instead
    of every param (`kvjax.train.lora`); the run must start from that base (`init_from`).

    `router_aux_loss_coef` > 0 adds that times a mixture of experts' load-balancing loss to
    the loss minimized (`model.experts.load_balancing_loss`, transformers'
    `router_aux_loss_coef` with `output_router_logits`), which keeps the router spreading
    tokens over the experts; the losses reported stay the cross-entropy. 0: none, as
    transformers trains by default.
    """

    steps: int = 1000
    batch_size: int = 32
    learning_rate: float = 1e-3
    warmup_steps: int = 100
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    adam_b1: float = 0.9
    adam_b2: float = 0.98
    label_smoothing: float = 0.0
    eval_every: int = 200
    eval_batches: int = 8
    log_every: int = 10
    save_every: int | None = None
    keep_checkpoints: int = 2
    seed: int = 0
    progress: bool = True  # the tqdm bar; off for tests and logs
    deterministic: bool = False
    remat: bool = False
    lora: LoRA | None = None
    router_aux_loss_coef: float = 0.0

    def __post_init__(self):
        problems = []
        for name in ("steps", "batch_size", "eval_every", "log_every", "save_every",
                     "keep_checkpoints", "warmup_steps", "eval_batches", "seed"):
            value = getattr(self, name)
            if name == "save_every" and value is None:
                continue
            minimum = 0 if name in ("warmup_steps", "eval_batches", "seed") else 1
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                problems.append(f"{name}={value!r} must be an int")
            elif value < minimum:
                problems.append(f"{name}={value} must be >= {minimum}")
            elif name == "seed" and value >= 2**63:
                problems.append(f"seed={value} must be < 2**63")
        for name in ("learning_rate", "final_lr_fraction", "weight_decay", "clip_norm",
                     "adam_b1", "adam_b2", "label_smoothing", "router_aux_loss_coef"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float | np.number):
                problems.append(f"{name}={value!r} must be a number")
            elif not math.isfinite(value):
                problems.append(f"{name}={value} must be finite")
        if self.lora is not None and not isinstance(self.lora, LoRA):
            problems.append(f"lora={self.lora!r} must be a kvjax.model.LoRA or None")
        for name in ("deterministic", "remat"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name}={getattr(self, name)!r} must be a bool")
        if problems:
            raise ValueError("invalid TrainConfig: " + "; ".join(problems))
        if not 0 <= self.warmup_steps < self.steps:
            problems.append(f"warmup_steps={self.warmup_steps} must be in [0, steps={self.steps})")
        if not self.learning_rate > 0:
            problems.append(f"learning_rate={self.learning_rate} must be > 0")
        if not self.router_aux_loss_coef >= 0:
            problems.append(f"router_aux_loss_coef={self.router_aux_loss_coef} must be >= 0")
        if not 0 <= self.label_smoothing < 1:
            problems.append(f"label_smoothing={self.label_smoothing} must be in [0, 1)")
        if not 0 <= self.final_lr_fraction <= 1:
            problems.append(f"final_lr_fraction={self.final_lr_fraction} must be in [0, 1]")
        if problems:
            raise ValueError("invalid TrainConfig: " + "; ".join(problems))

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    @property
    def save_interval(self) -> int:
        """Steps between checkpoints: `save_every`, or a tenth of the run (at least 1)."""
        return self.save_every if self.save_every is not None else max(1, self.steps // 10)


# The fields that decide what a run computes; `--resume` refuses to change them silently.
TRAJECTORY_FIELDS = ("steps", "batch_size", "learning_rate", "warmup_steps",
                     "final_lr_fraction", "weight_decay", "clip_norm", "adam_b1", "adam_b2",
                     "label_smoothing", "seed", "router_aux_loss_coef")


@dataclasses.dataclass(frozen=True)
class TrainTask:
    """What a run learns from. `train` and `val` map batch keys (see `kvjax.train.trainer`) to
    arrays sharing their first axis. `evaluate(params, final)` returns extra metrics at each
    evaluation (`final` is True at the end of the run, where it may do more work)."""

    name: str  # stored in config.json, e.g. "lm" or "translate"
    tokenizer: Tokenizer
    train: Mapping[str, np.ndarray]
    val: Mapping[str, np.ndarray]
    evaluate: Callable[[Any, bool], dict[str, float]] | None = None
    # What the data is, as run.json records it (file names and SHA-256 hashes, split
    # settings); a resumed run must have the same unless changes are allowed.
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)
