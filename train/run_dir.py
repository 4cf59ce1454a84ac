"""The files of a training run's output directory besides its checkpoints::

    run.json          what the run was started with (`run_record`): a resumed run must match it;
                      for a run started from another checkpoint's params, which (`INIT_FROM`)
    metrics.jsonl     one JSON object per logged step (`MetricsLog`)
    loss_curve.png    training and validation loss (`plot_loss_curve`)
    .lock             held (flock) by the one process training into the directory (`exclusive`)
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from kvjax import checkpoint
from kvjax import model as M

from .config import TRAJECTORY_FIELDS, TrainConfig, TrainTask

METRICS_FILE = "metrics.jsonl"
LOSS_CURVE_FILE = "loss_curve.png"
RUN_FILE = "run.json"
LOCK_FILE = ".lock"
# run.json's record of the checkpoint a run took its first params from: {"checkpoint": its
# absolute path, "step": the step read}. Not compared on resume: the run's own checkpoints
# hold the params from then on.
INIT_FROM = "init_from"


@contextlib.contextmanager
def exclusive(out_dir: Path, lock: bool = True) -> Iterator[None]:
    """Holds an exclusive lock on `out_dir/.lock` (flock: released by the kernel when the
    process ends, however it ends), so that two runs never write one directory. Of a job of
    several processes, process 0 holds it for all (`lock=False` in the others)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"output directory {out_dir} is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    if not lock:
        yield
        return
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


def run_record(train_config: TrainConfig, task: TrainTask) -> dict[str, Any]:
    """What run.json records: the task's data description and the trajectory settings."""
    training = {name: getattr(train_config, name) for name in TRAJECTORY_FIELDS}
    return json.loads(json.dumps({"task": task.name, "data": dict(task.data),
                                  "training": training}))


def write_run_record(out_dir: Path, record: Mapping[str, Any]) -> None:
    checkpoint.write_atomically(out_dir / RUN_FILE, json.dumps(record, indent=2) + "\n")


def read_run_record(out_dir: Path) -> dict[str, Any] | None:
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


def check_same_record(out_dir: Path, old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    for part, what in (("data", "data"), ("training", "settings")):
        before, now = old.get(part, {}), new[part]
        if part == "training":  # a setting an older record leaves out had its default
            before = {k: before.get(k, defaults.get(k)) for k in before.keys() | now.keys()}
        differ = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
        if differ:
            details = "; ".join(f"{k}: {json.dumps(before.get(k))} then, "
                                f"{json.dumps(now.get(k))} now" for k in differ)
            raise checkpoint.CheckpointError(
                f"cannot resume: the run in {out_dir} was started with other {what} "
                f"({details}); the learning-rate schedule and the batches depend on them. "
                "Allow the change explicitly (--allow-changes) to continue anyway")


def check_same_run(out_dir: Path, model_config: M.TransformerConfig, task: TrainTask,
                   action: str = "cannot resume") -> None:
    """Raises `CheckpointError` (starting with `action`) unless the checkpoint directory
    `out_dir` was written for this model config, task and tokenizer."""
    saved_model, saved_task, saved_tokenizer = checkpoint.read_metadata(out_dir)
    config_path = out_dir / checkpoint.CONFIG_FILE
    if saved_task != task.name:
        raise checkpoint.CheckpointError(
            f"{action}: {config_path} is for task {saved_task!r}, not {task.name!r}")
    # Compared as configs, not as files: a field an older config.json leaves out holds its
    # default, and settings that change how fast, not what, a model computes may differ.
    try:
        saved_model = _computed_fields(M.TransformerConfig.from_dict(saved_model))
    except (TypeError, ValueError) as error:
        raise checkpoint.CheckpointError(f"{action}: {config_path}: {error}") from error
    wanted = _computed_fields(model_config)
    if saved_model != wanted:
        differ = sorted(k for k in saved_model.keys() | wanted.keys()
                        if saved_model.get(k) != wanted.get(k))
        details = ", ".join(f"{k}: saved {saved_model.get(k)!r}, requested {wanted.get(k)!r}"
                            for k in differ)
        raise checkpoint.CheckpointError(
            f"{action}: the model config in {config_path} differs from the requested "
            f"one ({details})")
    if saved_tokenizer != task.tokenizer.to_bytes():
        raise checkpoint.CheckpointError(
            f"{action}: {out_dir / checkpoint.TOKENIZER_FILE} differs from the tokenizer "
            "of the requested run")


def _computed_fields(config: M.TransformerConfig) -> dict:
    """The config as config.json stores it, less the fields that only set how it is run."""
    stored = json.loads(json.dumps(config.to_dict()))
    return {k: v for k, v in stored.items() if k not in M.SPEED_ONLY_FIELDS}


class MetricsLog:
    """Appends one JSON object per line to `path`. Records after `keep_through_step` (left by a
    run interrupted after its last checkpoint) are dropped first, so that a resumed run's file
    reads as one run. With `write=False` (a process other than a job's first) it only keeps
    `last_step` and leaves the file alone."""

    def __init__(self, path: Path, keep_through_step: int, write: bool = True):
        self.path, self.writes = path, write
        self.last_step = keep_through_step
        if not write:
            return
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
        if self.writes:
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
