"""The training loop, one for both model variants.

`train` fits a model to a `TrainTask` (train and validation arrays, the tokenizer, and an
optional extra evaluation such as greedy-decoding accuracy) with AdamW, a linear warmup into a
cosine decay, and global-norm gradient clipping. Everything a run does is a pure function of
its configs and seed: batch ``s`` is ``Batches.batch(s)`` and the dropout key of step ``s`` is
``fold_in(key(seed), s)``, so a run resumed from a checkpoint continues with exactly the losses
an uninterrupted run has.

An output directory holds::

    config.json, tokenizer.model   what the checkpoints need to be used (kvjax.checkpoint)
    <step>/                        checkpoints: params, optimizer state, step, rng, data position
    metrics.jsonl                  one JSON object per logged step
    run.json                       what the run was started with: data, steps, schedule
    .lock                          held (flock) by the one process training into the directory
    loss_curve.png                 training and validation loss, redrawn at the end of a run

A job of several processes (`kvjax.distributed`) runs `train` in every one of them with a
mesh over all their devices: each process builds only its rows of each batch, every
process writes its shards of each checkpoint, and process 0 alone holds the lock and
writes the other files. A SIGTERM to any of them (a preemption notice) stops all of them
after the same step, with a checkpoint.

The configs are in `config`, one update (loss, optimizer, compiled step) in `update`, and the
files of the directory besides the checkpoints in `run_dir`.

Batches are dicts of arrays. Both variants have ``inputs`` [B, T] (decoder input tokens),
``targets`` [B, T] (the next tokens) and ``weights`` [B, T] (float32: how much each target
counts in the loss, 1 or 0 where there is nothing to predict; without it every target counts).
No token id marks padding: an imported vocabulary uses every id, 0 included. An
encoder-decoder batch also has ``source`` [B, S], ``source_lengths`` [B] and ``lengths`` [B]
(decoder inputs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from kvjax import checkpoint, distributed, parallel
from kvjax import model as M

from . import lora, run_dir
from .config import TrainConfig, TrainTask
from .data import Batches
from .update import (
    TrainState,
    compiled_fields,
    init_state,
    learning_rate_schedule,
    target_weights,
    train_step,
    validation_loss,
)


class TrainingDiverged(RuntimeError):
    """The training loss became NaN or infinite; the message names the step and the last good
    checkpoint. Nothing after the last finite step is saved."""


class TrainingInterrupted(Exception):
    """SIGINT or SIGTERM arrived during training; a checkpoint was saved at `step`."""

    def __init__(self, message: str, step: int, signum: int):
        super().__init__(message)
        self.step, self.signum = step, signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """The outcome of one `train` call: the training loss of every step it ran (keyed by the
    step number after the update, 1-based) and the final evaluation's metrics."""

    out_dir: Path
    step: int
    losses: dict[int, float]
    metrics: dict[str, float]

    @property
    def metrics_path(self) -> Path:
        return self.out_dir / run_dir.METRICS_FILE

    @property
    def loss_curve_path(self) -> Path:
        return self.out_dir / run_dir.LOSS_CURVE_FILE


# The loop --------------------------------------------------------------------------------------


def train(model_config: M.TransformerConfig, train_config: TrainConfig, task: TrainTask,
          out_dir: str | Path, *, resume: bool = False, stop_after: int | None = None,
          allow_changes: bool = False, mesh: Mesh | None = None,
          init_from: str | Path | None = None) -> TrainResult:
    """Trains `model_config` on `task`, writing checkpoints and metrics into `out_dir`.

    With `resume`, continues from the newest checkpoint in `out_dir`, which must have been
    written for the same model config, task and tokenizer, and (unless `allow_changes`) the
    same data and trajectory settings (`config.TRAJECTORY_FIELDS`, recorded in run.json);
    without it, `out_dir` must hold no checkpoint. `stop_after` ends the run after that step as if
    interrupted there (with a checkpoint, a final evaluation and the loss curve); the schedule
    still spans `train_config.steps`, so a resumed run continues it.

    With `init_from` (a checkpoint directory written for the same model config, task and
    tokenizer: kvjax's own, or a pretrained model `kvjax.hf.convert` imported), a new run
    starts from the params of its newest step, restored with their checksums checked, and a
    fresh optimizer at step 0; run.json records where they came from. A resumed run continues
    from its own checkpoints and keeps that record; `init_from` is not read then.

    With `train_config.lora`, the run trains LoRA adapters on the params of `init_from`,
    which stay frozen (`kvjax.train.lora`): its checkpoints hold the adapters alone, and a
    resumed run reads the base again from where config.json says, checking it is the same.

    Raises `TrainingDiverged` on a non-finite loss or params (saving nothing from that step
    on) and, after saving a checkpoint at the current step, `TrainingInterrupted` on SIGINT or
    SIGTERM. Another process training into `out_dir` at the same time is refused.

    With a `mesh` (`parallel.make_mesh`), every batch of `train_config.batch_size` rows is
    split over its `data` axis and the params and optimizer state over its `model` axis;
    checkpoints are saved sharded and a resumed run restores onto this mesh, whichever mesh
    saved them. In a job of several processes every process calls `train` with the same
    arguments (a ValueError says if they differ); the mesh defaults to all their devices.
    """
    if mesh is None and distributed.is_multiprocess():
        mesh = parallel.make_mesh()  # every process's devices: one job
    if mesh is not None:
        parallel.check_batch(train_config.batch_size, mesh)
        parallel.check_model_axis(model_config, mesh)
    out_dir = Path(out_dir)
    if distributed.is_multiprocess():
        distributed.check_same("model config, task, tokenizer or training settings",
                               _fingerprint(model_config, train_config, task, resume, stop_after))
    with run_dir.exclusive(out_dir, lock=distributed.is_primary()), \
            _deferred_signals() as signals:
        state, base, lora_record = _start_state(model_config, train_config, task, out_dir,
                                                resume, allow_changes, mesh, init_from)
        return _run(model_config, train_config, task, out_dir, state, base, lora_record,
                    stop_after, signals, mesh)


def _fingerprint(model_config, train_config: TrainConfig, task: TrainTask, resume: bool,
                 stop_after: int | None) -> bytes:
    """What every process of a job must agree on, as bytes."""
    settings = [model_config.to_dict(), run_dir.run_record(train_config, task), resume,
                stop_after]
    return json.dumps(settings, sort_keys=True).encode() + task.tokenizer.to_bytes()


def _run(model_config, train_config: TrainConfig, task: TrainTask, out_dir: Path,
         state: TrainState, base, lora_record: dict[str, Any] | None,
         stop_after: int | None, signals: _Signals, mesh: Mesh | None) -> TrainResult:
    step_config = compiled_fields(train_config)
    start = int(state.step)
    end = train_config.steps if stop_after is None else min(stop_after, train_config.steps)
    batches = Batches(tuple(task.train.values()), train_config.batch_size, train_config.seed)
    own_rows = slice(None) if mesh is None else parallel.local_rows(train_config.batch_size, mesh)
    primary = distributed.is_primary()
    log = run_dir.MetricsLog(out_dir / run_dir.METRICS_FILE, keep_through_step=start,
                             write=primary)
    schedule = learning_rate_schedule(train_config)
    losses: dict[int, jax.Array] = {}
    guard = _DivergenceGuard(out_dir, start)
    meter = _Throughput()
    bar = tqdm(total=end, initial=start, disable=not (train_config.progress and primary),
               unit="step", dynamic_ncols=True)
    metrics: dict[str, float] = {}
    manifest = checkpoint.manifest_metadata(model_config.to_dict(), task.name,
                                            task.tokenizer.to_bytes(), lora_record)

    def metrics_now(final: bool) -> dict[str, float]:
        params = lora.model_params(model_config, train_config, state.params, base)
        return _evaluate(model_config, train_config, task, params, final)

    with bar, checkpoint.Checkpointer(out_dir, save_every=train_config.save_interval,
                                      keep=train_config.keep_checkpoints,
                                      manifest=manifest) as checkpointer:
        for step in range(start + 1, end + 1):
            batch = dict(zip(task.train.keys(), batches.batch(step - 1, own_rows), strict=True))
            placed = batch if mesh is None else parallel.shard_batch(batch, mesh)
            state, losses[step] = train_step(model_config, step_config, state, placed,
                                             mesh=mesh, base=base)
            # Counted on this process's rows: with several, an estimate of the whole batch's.
            meter.add_tokens(int(np.count_nonzero(target_weights(batch))) * jax.process_count())
            if signals.stop_after(step):
                guard.check(losses, state)
                checkpointer.save(step, _checkpoint_tree(state), force=True)
                checkpointer.wait()
                name = signal.Signals(signals.received).name
                raise TrainingInterrupted(
                    f"interrupted by {name}: saved a checkpoint at step {step} in {out_dir}; "
                    "continue with --resume", step, signals.received)
            if step % train_config.save_interval == 0:
                guard.check(losses, state)
                checkpointer.save(step, _checkpoint_tree(_copy(state)))
                guard.saved(step)
            final = step == end
            evaluate = final or step % train_config.eval_every == 0
            if not (evaluate or step % train_config.log_every == 0):
                continue
            guard.check(losses, state)
            record = {"step": step, "loss": _mean_since_last_record(losses, log.last_step),
                      "lr": float(schedule(step - 1)), "tokens_per_sec": meter.rate()}
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_sec']:.0f}")
            bar.update(step - bar.n)
            if evaluate:
                metrics = metrics_now(final)
                record.update(metrics)
                bar.write(_describe(record))
                meter.restart()  # evaluation time is not training throughput
            log.write(record)
        guard.check(losses, state)
        if not metrics:  # nothing left to run: the checkpoint was already at `end`
            metrics = metrics_now(True)
        checkpointer.save(int(state.step), _checkpoint_tree(state), force=True)
    if primary:
        run_dir.plot_loss_curve(log.read(), out_dir / run_dir.LOSS_CURVE_FILE)
    return TrainResult(out_dir=out_dir, step=int(state.step),
                       losses={step: float(loss) for step, loss in losses.items()},
                       metrics=metrics)


class _DivergenceGuard:
    """Raises `TrainingDiverged` if a loss since the last check, or a param, is not finite.
    Checked before every save and log record only, so that steps are not synchronised one by
    one with the device."""

    def __init__(self, out_dir: Path, start: int):
        self.out_dir, self.checked_through, self.last_saved = out_dir, start, start or None

    def saved(self, step: int) -> None:
        self.last_saved = step

    def check(self, losses: Mapping[int, jax.Array], state: TrainState) -> None:
        steps = [step for step in losses if step > self.checked_through]
        values = np.asarray(jax.device_get([losses[step] for step in steps]), np.float64)
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            self._raise(f"the loss at step {steps[bad[0]]} is {values[bad[0]]}")
        if not bool(_all_finite(state.params)):
            self._raise(f"the params after step {int(state.step)} are not finite")
        self.checked_through = max(steps, default=self.checked_through)

    def _raise(self, what: str):
        if self.last_saved is None:
            last = "no checkpoint was saved"
        else:
            last = f"the last good checkpoint is step {self.last_saved} in {self.out_dir}"
        raise TrainingDiverged(f"training diverged: {what}; nothing from that step on was "
                               f"saved, {last} (try a lower learning rate)")


@jax.jit
def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


class _Signals:
    """The first SIGINT/SIGTERM received while training (None while none was)."""

    received: int | None = None

    def stop_after(self, step: int) -> bool:
        """Whether to save and stop after `step`. With several processes, JAX's preemption
        notifier catches SIGTERM in any of them and they agree on the step to stop after."""
        if distributed.is_multiprocess():
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                self.received = signal.SIGTERM
        return self.received is not None


@contextlib.contextmanager
def _deferred_signals() -> Iterator[_Signals]:
    """While training, SIGINT and SIGTERM only set a flag, which the loop reads after each
    step to save a checkpoint before it stops. A second Ctrl-C stops at once. Signals can be
    caught only in the main thread; elsewhere they keep their handlers. With several
    processes they keep them too: SIGTERM is JAX's (see `_Signals.stop_after`), and Ctrl-C
    ends a process at once, as one step cannot be agreed on for it."""
    signals = _Signals()
    if (threading.current_thread() is not threading.main_thread()
            or distributed.is_multiprocess()):
        yield signals
        return

    def handler(signum, frame):
        if signals.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        signals.received = signum

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield signals
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _start_state(model_config, train_config, task: TrainTask, out_dir: Path,
                 resume: bool, allow_changes: bool, mesh: Mesh | None,
                 init_from: str | Path | None) -> tuple[TrainState, Any, dict[str, Any] | None]:
    """The state to start from, and for a LoRA run its frozen base params and the record
    config.json and the manifests keep of the adapters (else None, None)."""
    saved_step = checkpoint.latest_step(out_dir)
    if saved_step is not None and not resume:
        raise checkpoint.CheckpointError(
            f"{out_dir} already holds checkpoints (latest step {saved_step}); resume them or "
            "choose a new directory")
    record = run_dir.run_record(train_config, task)
    if resume:
        if saved_step is None:
            raise checkpoint.CheckpointError(f"cannot resume: {out_dir} holds no checkpoint")
        run_dir.check_same_run(out_dir, model_config, task)
        checkpoint.check_metadata(out_dir)
        old = run_dir.read_run_record(out_dir)
        if old is not None and run_dir.INIT_FROM in old:
            record[run_dir.INIT_FROM] = old[run_dir.INIT_FROM]
        if old is not None and not allow_changes:
            run_dir.check_same_record(out_dir, old, record)
        if old != record:
            if old is not None:
                record["resumed_with_changes_at_step"] = saved_step
            if distributed.is_primary():
                run_dir.write_run_record(out_dir, record)
    params = base = lora_record = None
    if train_config.lora is not None:
        source = (record.get(run_dir.INIT_FROM) or {}).get("checkpoint") if resume else init_from
        base, base_record = _initial_params(lora.base_checkpoint(source), model_config, task,
                                            mesh)
        base = lora.as_base(base, train_config.lora)
        record[run_dir.INIT_FROM] = {**base_record,
                                     "params_sha256": checkpoint.params_digest(source)}
        if resume:
            lora.check_same_base(out_dir, record[run_dir.INIT_FROM])
        else:
            params = lora.init_adapters(model_config, train_config, base)
        lora_record = lora.record(train_config, record[run_dir.INIT_FROM])
    elif not resume and init_from is not None:
        params, record[run_dir.INIT_FROM] = _initial_params(init_from, model_config, task, mesh)
    if distributed.is_primary():
        checkpoint.write_metadata(out_dir, model_config.to_dict(), task.name,
                                  task.tokenizer.to_bytes(), lora_record)
        if not resume:
            run_dir.write_run_record(out_dir, record)
    if not resume:
        return init_state(model_config, train_config, mesh, params=params), base, lora_record
    trained = None if base is None else M.lora.adapter_shapes(model_config, base,
                                                             train_config.lora)
    abstract = jax.eval_shape(lambda p: _checkpoint_tree(
        init_state(model_config, train_config, params=p)), trained)
    if mesh is not None:
        abstract = parallel.abstract_on(abstract, mesh)
    _, tree = checkpoint.restore_latest(out_dir, abstract)
    return TrainState(params=tree["params"], opt_state=tree["opt_state"],
                      step=tree["data_position"], rng=tree["rng"]), base, lora_record


def _initial_params(init_from: str | Path, model_config, task: TrainTask,
                    mesh: Mesh | None) -> tuple[Any, dict[str, Any]]:
    """The params of the newest step in `init_from`, and what run.json records of them.
    A checkpoint of int8 weights (`kernel_dtype="int8"`, `kvjax import-hf --kernel-dtype
    int8`) starts the float model of its dequantized weights, which computes what it does;
    one of bfloat16 params starts a run of float32 params (`tasks._pretrained`), widened."""
    path = Path(init_from)
    stored = M.TransformerConfig.from_dict(checkpoint.read_metadata(path)[0])
    saved = model_config.replace(kernel_dtype=stored.kernel_dtype,
                                 param_dtype=stored.param_dtype)
    run_dir.check_same_run(path, saved, task, action=f"cannot start from {path}")
    _, _, params = checkpoint.load_for_sampling(path, mesh,
                                                scan_layers=model_config.scan_layers)
    _, params = M.with_float_kernels(saved, params)
    return (M.cast_floats(params, model_config.param_dtype),
            {"checkpoint": str(path.resolve()), "step": checkpoint.latest_step(path)})


def _checkpoint_tree(state: TrainState) -> dict[str, Any]:
    # Batches are a pure function of the step, so the data position is the step itself.
    return {"params": state.params, "opt_state": state.opt_state, "step": state.step,
            "rng": state.rng, "data_position": state.step}


@jax.jit
def _copy(state: TrainState) -> TrainState:
    # The next train_step donates (frees) the state's buffers while an async save may still be
    # reading them; a copy is cheap next to a checkpoint write.
    return jax.tree.map(jnp.copy, state)


def _evaluate(model_config, train_config: TrainConfig, task: TrainTask, params,
              final: bool) -> dict[str, float]:
    max_batches = 0 if final else train_config.eval_batches
    metrics = {}
    if task.val and len(next(iter(task.val.values()))):  # no validation set, no val metrics
        metrics = validation_loss(model_config, params, task.val, train_config.batch_size,
                                  max_batches)
    if task.evaluate is not None:
        metrics.update(task.evaluate(params, final))
    return metrics


def _mean_since_last_record(losses: dict[int, jax.Array], last_step: int) -> float:
    recent = [loss for step, loss in losses.items() if step > last_step]
    return float(np.mean(jax.device_get(recent)))


def _describe(record: Mapping[str, float]) -> str:
    values = " ".join(f"{key}={value:.4g}" for key, value in record.items() if key != "step")
    return f"step {record['step']}: {values}"


class _Throughput:
    """Target tokens per second of wall time since the last `restart`/`rate`."""

    def __init__(self):
        self.restart()

    def restart(self) -> None:
        self._tokens, self._since = 0, time.perf_counter()

    def add_tokens(self, count: int) -> None:
        self._tokens += count

    def rate(self) -> float:
        rate = self._tokens / max(time.perf_counter() - self._since, 1e-9)
        self.restart()
        return rate
