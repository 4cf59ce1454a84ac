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

Batches are dicts of arrays. Both variants have ``inputs`` [B, T] (decoder input tokens) and
``targets`` [B, T] (the next tokens; PAD where there is nothing to predict). An encoder-decoder
batch also has ``source`` [B, S], ``source_lengths`` [B] and ``lengths`` [B] (decoder inputs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import json
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from tqdm.auto import tqdm

from kvjax import checkpoint, parallel
from kvjax import model as M
from kvjax.tokenizer import PAD_ID, Tokenizer

from .data import Batches

METRICS_FILE = "metrics.jsonl"
LOSS_CURVE_FILE = "loss_curve.png"
RUN_FILE = "run.json"
LOCK_FILE = ".lock"

Batch = Mapping[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How to train: optimizer, schedule, evaluation, logging and checkpointing.

    The learning rate rises linearly from 0 over `warmup_steps`, then follows a cosine down to
    `learning_rate * final_lr_fraction` at `steps`. Weight decay applies to kernels and
    embedding tables only (`decay_mask`), not to biases or norm scales. Periodic evaluations
    use the first `eval_batches` validation batches (0: all of them); the final one always
    uses all. A checkpoint is saved every `save_every` steps (None: a tenth of `steps`), at the
    end, and at the current step when the process gets SIGINT or SIGTERM.
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
                     "adam_b1", "adam_b2", "label_smoothing"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float | np.number):
                problems.append(f"{name}={value!r} must be a number")
            elif not math.isfinite(value):
                problems.append(f"{name}={value} must be finite")
        if problems:
            raise ValueError("invalid TrainConfig: " + "; ".join(problems))
        if not 0 <= self.warmup_steps < self.steps:
            problems.append(f"warmup_steps={self.warmup_steps} must be in [0, steps={self.steps})")
        if self.eval_batches < 0:
            problems.append(f"eval_batches={self.eval_batches} must be >= 0 (0: all)")
        if not self.learning_rate > 0:
            problems.append(f"learning_rate={self.learning_rate} must be > 0")
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
                     "label_smoothing", "seed")


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
class TrainTask:
    """What a run learns from. `train` and `val` map batch keys (see the module docstring) to
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
        return self.out_dir / METRICS_FILE

    @property
    def loss_curve_path(self) -> Path:
        return self.out_dir / LOSS_CURVE_FILE


@flax.struct.dataclass
class TrainState:
    """params and opt_state (pytrees), step int32[] (updates done = index of the next batch),
    rng uint32[2] (key data of the run's base key; step s uses fold_in(rng, s))."""

    params: Any
    opt_state: Any
    step: jax.Array
    rng: jax.Array


# Loss ------------------------------------------------------------------------------------------


def cross_entropy_sum(logits_BTV, targets_BT, label_smoothing: float = 0.0):
    """(sum of per-token losses, number of non-PAD targets); PAD targets count for nothing.

    With label smoothing e, a token's loss is (1 - e) * -log p(target) + e * mean_v -log p(v),
    the cross-entropy against (1 - e) * one_hot(target) + e / V.
    """
    logits_BTV = logits_BTV.astype(jnp.float32)
    log_total_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    # The target's logit as a product with its one-hot row rather than a gather: the
    # gather's gradient is a scatter, which XLA:CPU runs as a pass of its own over [B, T, V]
    # before the gradient's transposing copy; the one-hot product fuses into that copy.
    one_hot_BTV = jax.nn.one_hot(targets_BT, logits_BTV.shape[-1], dtype=logits_BTV.dtype)
    nll_BT = log_total_BT - jnp.sum(logits_BTV * one_hot_BTV, axis=-1)
    if label_smoothing:
        mean_log_prob_BT = logits_BTV.mean(-1) - log_total_BT
        nll_BT = (1 - label_smoothing) * nll_BT - label_smoothing * mean_log_prob_BT
    weights_BT = (targets_BT != PAD_ID).astype(jnp.float32)
    return (nll_BT * weights_BT).sum(), weights_BT.sum()


# Optimizer and compiled steps ------------------------------------------------------------------


def learning_rate_schedule(config: TrainConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.learning_rate, warmup_steps=config.warmup_steps,
        decay_steps=config.steps, end_value=config.learning_rate * config.final_lr_fraction)


DECAYED_PARAMS = ("kernel", "embedding", "position_embedding")


def decay_mask(params) -> Any:
    """True for the params weight decay applies to: kernels and embedding tables, chosen by
    name. Biases and LayerNorm scales are not decayed, whatever their rank: stacked over
    scanned layers they are [L, D], as a kernel of an unrolled layer is."""
    def decayed(path, _):
        return getattr(path[-1], "key", None) in DECAYED_PARAMS

    return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        optax.adamw(learning_rate_schedule(config), b1=config.adam_b1, b2=config.adam_b2,
                    weight_decay=config.weight_decay, mask=decay_mask),
    )


def _update_config(config: TrainConfig) -> TrainConfig:
    # train_step is compiled per TrainConfig; resetting the fields it does not read lets runs
    # that differ only in them (seed, evaluation, logging, saving) share one compilation.
    return config.replace(seed=0, eval_every=1, eval_batches=0, log_every=1, save_every=None,
                          keep_checkpoints=1, progress=False)


def init_state(model_config: M.TransformerConfig, train_config: TrainConfig,
               mesh: Mesh | None = None) -> TrainState:
    """The state before the first step: fresh params and optimizer state for the seed, laid
    out on `mesh` by `parallel.state_shardings` when one is given."""
    state = _init_state(model_config, _update_config(train_config),
                        jax.random.key(train_config.seed))
    return state if mesh is None else parallel.shard_params(state, mesh)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_state(model_config: M.TransformerConfig, update_config: TrainConfig,
                seed_key: jax.Array) -> TrainState:
    params_rng, base_rng = jax.random.split(seed_key)
    params = M.init_params(model_config, params_rng)
    return TrainState(params=params, opt_state=make_optimizer(update_config).init(params),
                      step=jnp.zeros((), jnp.int32), rng=jax.random.key_data(base_rng))


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames="mesh", donate_argnums=2)
def train_step(model_config: M.TransformerConfig, train_config: TrainConfig, state: TrainState,
               batch: Batch, mesh: Mesh | None = None) -> tuple[TrainState, jax.Array]:
    """One AdamW update on `batch`; returns the new state and the batch's mean loss.

    With a `mesh`, the state comes in laid out by `parallel.state_shardings` and the batch
    split over `data` (`parallel.shard_batch`); the new state leaves with the same layout,
    so every step runs one compiled program. The loss and gradients are sums over the whole
    batch, which XLA reduces across devices: the same numbers as on one device.
    """
    dropout_rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)

    def loss_fn(params):
        logits = M.teacher_forced_logits(model_config, params, batch, dropout_rng)
        total, count = cross_entropy_sum(logits, batch["targets"], train_config.label_smoothing)
        return total / jnp.maximum(count, 1.0)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    updates, opt_state = make_optimizer(train_config).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    state = state.replace(params=params, opt_state=opt_state, step=state.step + 1)
    if mesh is not None:
        state = jax.lax.with_sharding_constraint(state, parallel.state_shardings(state, mesh))
    return state, loss


@functools.partial(jax.jit, static_argnums=0)
def _loss_sum(model_config: M.TransformerConfig, params, batch: Batch):
    return cross_entropy_sum(M.teacher_forced_logits(model_config, params, batch), batch["targets"])


def validation_loss(model_config: M.TransformerConfig, params, val: Mapping[str, np.ndarray],
                    batch_size: int, max_batches: int = 0) -> dict[str, float]:
    """Mean cross-entropy per non-PAD target token over the validation set and its exp."""
    total = count = 0.0
    for batch in _chunks(val, batch_size, max_batches):
        batch_total, batch_count = _loss_sum(model_config, params, batch)
        total, count = total + float(batch_total), count + float(batch_count)
    loss = total / max(count, 1.0)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}


def _chunks(arrays: Mapping[str, np.ndarray], size: int, max_chunks: int) -> Iterator[dict]:
    # Every chunk has `size` rows, so one compiled program serves them all: the last one is
    # filled up with earlier rows whose targets are all PAD, which count for nothing.
    num_examples = len(next(iter(arrays.values())))
    starts = range(0, num_examples, size)
    for start in starts[:max_chunks] if max_chunks else starts:
        positions = np.arange(start, start + size)
        chunk = {key: value[positions % num_examples] for key, value in arrays.items()}
        chunk["targets"][positions >= num_examples] = PAD_ID
        yield chunk


# The loop --------------------------------------------------------------------------------------


def train(model_config: M.TransformerConfig, train_config: TrainConfig, task: TrainTask,
          out_dir: str | Path, *, resume: bool = False, stop_after: int | None = None,
          allow_changes: bool = False, mesh: Mesh | None = None) -> TrainResult:
    """Trains `model_config` on `task`, writing checkpoints and metrics into `out_dir`.

    With `resume`, continues from the newest checkpoint in `out_dir`, which must have been
    written for the same model config, task and tokenizer, and (unless `allow_changes`) the
    same data and trajectory settings (`TRAJECTORY_FIELDS`, recorded in run.json); without it,
    `out_dir` must hold no checkpoint. `stop_after` ends the run after that step as if
    interrupted there (with a checkpoint, a final evaluation and the loss curve); the schedule
    still spans `train_config.steps`, so a resumed run continues it.

    Raises `TrainingDiverged` on a non-finite loss or params (saving nothing from that step
    on) and, after saving a checkpoint at the current step, `TrainingInterrupted` on SIGINT or
    SIGTERM. Another process training into `out_dir` at the same time is refused.

    With a `mesh` (`parallel.make_mesh`), every batch of `train_config.batch_size` rows is
    split over its `data` axis and the params and optimizer state over its `model` axis;
    checkpoints are saved sharded and a resumed run restores onto this mesh, whichever mesh
    saved them.
    """
    if mesh is not None:
        parallel.check_batch(train_config.batch_size, mesh)
        parallel.check_model_axis(model_config, mesh)
    out_dir = Path(out_dir)
    with _exclusive(out_dir), _deferred_signals() as signals:
        state = _start_state(model_config, train_config, task, out_dir, resume, allow_changes,
                             mesh)
        return _run(model_config, train_config, task, out_dir, state, stop_after, signals,
                    mesh)


def _run(model_config, train_config: TrainConfig, task: TrainTask, out_dir: Path,
         state: TrainState, stop_after: int | None, signals: _Signals,
         mesh: Mesh | None) -> TrainResult:
    update_config = _update_config(train_config)
    start = int(state.step)
    end = train_config.steps if stop_after is None else min(stop_after, train_config.steps)
    batches = Batches(tuple(task.train.values()), train_config.batch_size, train_config.seed)
    log = MetricsLog(out_dir / METRICS_FILE, keep_through_step=start)
    schedule = learning_rate_schedule(train_config)
    losses: dict[int, jax.Array] = {}
    guard = _DivergenceGuard(out_dir, start)
    meter = _Throughput()
    bar = tqdm(total=end, initial=start, disable=not train_config.progress, unit="step",
               dynamic_ncols=True)
    metrics: dict[str, float] = {}
    manifest = checkpoint.manifest_metadata(model_config.to_dict(), task.name,
                                            task.tokenizer.to_bytes())
    with bar, checkpoint.Checkpointer(out_dir, save_every=train_config.save_interval,
                                      keep=train_config.keep_checkpoints,
                                      manifest=manifest) as checkpointer:
        for step in range(start + 1, end + 1):
            batch = dict(zip(task.train.keys(), batches.batch(step - 1), strict=True))
            placed = batch if mesh is None else parallel.shard_batch(batch, mesh)
            state, losses[step] = train_step(model_config, update_config, state, placed,
                                             mesh=mesh)
            meter.add_tokens(int(np.count_nonzero(batch["targets"] != PAD_ID)))
            if signals.received is not None:
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
                metrics = _evaluate(model_config, train_config, task, state.params, final)
                record.update(metrics)
                bar.write(_describe(record))
                meter.restart()  # evaluation time is not training throughput
            log.write(record)
        guard.check(losses, state)
        if not metrics:  # nothing left to run: the checkpoint was already at `end`
            metrics = _evaluate(model_config, train_config, task, state.params, True)
        checkpointer.save(int(state.step), _checkpoint_tree(state), force=True)
    plot_loss_curve(log.read(), out_dir / LOSS_CURVE_FILE)
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


@contextlib.contextmanager
def _deferred_signals() -> Iterator[_Signals]:
    """While training, SIGINT and SIGTERM only set a flag, which the loop reads after each
    step to save a checkpoint before it stops. A second Ctrl-C stops at once. Signals can be
    caught only in the main thread; elsewhere they keep their handlers."""
    signals = _Signals()
    if threading.current_thread() is not threading.main_thread():
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


@contextlib.contextmanager
def _exclusive(out_dir: Path) -> Iterator[None]:
    """Holds an exclusive lock on `out_dir/.lock` (flock: released by the kernel when the
    process ends, however it ends), so that two runs never write one directory."""
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"output directory {out_dir} is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    lock_path = out_dir / LOCK_FILE
    with open(lock_path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise checkpoint.CheckpointError(
                f"{out_dir} is in use by another training run (it holds {lock_path}); wait "
                "for it to end or choose another output directory") from None
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _start_state(model_config, train_config, task: TrainTask, out_dir: Path,
                 resume: bool, allow_changes: bool, mesh: Mesh | None) -> TrainState:
    saved_step = checkpoint.latest_step(out_dir)
    if saved_step is not None and not resume:
        raise checkpoint.CheckpointError(
            f"{out_dir} already holds checkpoints (latest step {saved_step}); resume them or "
            "choose a new directory")
    record = run_record(train_config, task)
    if resume:
        if saved_step is None:
            raise checkpoint.CheckpointError(f"cannot resume: {out_dir} holds no checkpoint")
        _check_same_run(out_dir, model_config, task)
        checkpoint.check_metadata(out_dir)
        old = _read_run_record(out_dir)
        if old is not None and not allow_changes:
            _check_same_record(out_dir, old, record)
        if old != record:
            if old is not None:
                record["resumed_with_changes_at_step"] = saved_step
            checkpoint.write_atomically(out_dir / RUN_FILE, json.dumps(record, indent=2) + "\n")
    checkpoint.write_metadata(out_dir, model_config.to_dict(), task.name,
                              task.tokenizer.to_bytes())
    if not resume:
        checkpoint.write_atomically(out_dir / RUN_FILE, json.dumps(record, indent=2) + "\n")
        return init_state(model_config, train_config, mesh)
    abstract = jax.eval_shape(lambda: _checkpoint_tree(init_state(model_config, train_config)))
    if mesh is not None:
        abstract = parallel.abstract_on(abstract, mesh)
    _, tree = checkpoint.restore_latest(out_dir, abstract)
    return TrainState(params=tree["params"], opt_state=tree["opt_state"],
                      step=tree["data_position"], rng=tree["rng"])


def run_record(train_config: TrainConfig, task: TrainTask) -> dict[str, Any]:
    """What run.json records: the task's data description and the trajectory settings."""
    training = {name: getattr(train_config, name) for name in TRAJECTORY_FIELDS}
    return json.loads(json.dumps({"task": task.name, "data": dict(task.data),
                                  "training": training}))


def _read_run_record(out_dir: Path) -> dict[str, Any] | None:
    path = out_dir / RUN_FILE
    if not path.exists():
        return None  # written before run.json existed
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise checkpoint.CheckpointError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(record, dict):
        raise checkpoint.CheckpointError(f"{path} must hold a JSON object")
    record.pop("resumed_with_changes_at_step", None)
    return record


def _check_same_record(out_dir: Path, old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    for part, what in (("data", "data"), ("training", "settings")):
        before, now = old.get(part, {}), new[part]
        differ = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
        if differ:
            details = "; ".join(f"{k}: {json.dumps(before.get(k))} then, "
                                f"{json.dumps(now.get(k))} now" for k in differ)
            raise checkpoint.CheckpointError(
                f"cannot resume: the run in {out_dir} was started with other {what} "
                f"({details}); the learning-rate schedule and the batches depend on them. "
                "Allow the change explicitly (--allow-changes) to continue anyway")


def _check_same_run(out_dir: Path, model_config: M.TransformerConfig, task: TrainTask) -> None:
    saved_model, saved_task, saved_tokenizer = checkpoint.read_metadata(out_dir)
    wanted = json.loads(json.dumps(model_config.to_dict()))  # as config.json stores it
    config_path = out_dir / checkpoint.CONFIG_FILE
    if saved_task != task.name:
        raise checkpoint.CheckpointError(
            f"cannot resume: {config_path} is for task {saved_task!r}, not {task.name!r}")
    if saved_model != wanted:
        differ = sorted(k for k in saved_model.keys() | wanted.keys()
                        if saved_model.get(k) != wanted.get(k))
        details = ", ".join(f"{k}: saved {saved_model.get(k)!r}, requested {wanted.get(k)!r}"
                            for k in differ)
        raise checkpoint.CheckpointError(
            f"cannot resume: the model config in {config_path} differs from the requested "
            f"one ({details})")
    if saved_tokenizer != task.tokenizer.to_bytes():
        raise checkpoint.CheckpointError(
            f"cannot resume: {out_dir / checkpoint.TOKENIZER_FILE} differs from the tokenizer "
            "of the requested run")


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


# Metrics file and loss curve -------------------------------------------------------------------


class MetricsLog:
    """Appends one JSON object per line to `path`. Records after `keep_through_step` (left by a
    run interrupted after its last checkpoint) are dropped first, so that a resumed run's file
    reads as one run."""

    def __init__(self, path: Path, keep_through_step: int):
        self.path = path
        records = self.read()
        kept = [r for r in records if r["step"] <= keep_through_step]
        if len(kept) != len(records):
            checkpoint.write_atomically(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self.last_step = kept[-1]["step"] if kept else keep_through_step

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        lines = self.path.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def write(self, record: Mapping[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        self.last_step = record["step"]


def plot_loss_curve(records: list[Mapping[str, Any]], path: Path) -> None:
    """Training loss and validation loss (where evaluated) against the step, as a PNG."""
    # The object-oriented API draws without pyplot's global state or a display (Agg).
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.plot([r["step"] for r in records], [r["loss"] for r in records], label="train loss")
    evaluated = [r for r in records if "val_loss" in r]
    axes.plot([r["step"] for r in evaluated], [r["val_loss"] for r in evaluated], "o-",
              label="validation loss")
    axes.set_xlabel("step")
    axes.set_ylabel("cross-entropy (nats per token)")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
