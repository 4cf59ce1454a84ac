"""Training that loses nothing and hides nothing: periodic checkpoints, a checkpoint on SIGTERM
or Ctrl-C, a resume after SIGKILL that ends bit-identical, a NaN guard, one trainer per
directory, and a run record that `--resume` holds to.

All runs share one tiny model and one step count, so they share one compiled train step.
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from kvjax import checkpoint
from kvjax import model as M
from kvjax.tokenizer import Tokenizer, train_tokenizer
from kvjax.train import data, run_dir, tasks, trainer
from kvjax.train.config import TrainConfig, TrainTask
from kvjax.train.trainer import TrainingDiverged, TrainingInterrupted

HERE = Path(__file__).resolve().parent
STEPS = 30
TRAIN = TrainConfig(steps=STEPS, batch_size=8, learning_rate=3e-3, warmup_steps=3,
                    eval_every=STEPS, eval_batches=1, log_every=5, keep_checkpoints=2,
                    progress=False, deterministic=True)
TEXT = "the quick brown fox jumps over the lazy dog.\nPack my box with five dozen jugs!\n" * 20


def make_task(tokenizer: Tokenizer) -> tuple[M.TransformerConfig, TrainTask]:
    windows = data.repeat_task(160, 16, max_segment_len=1, vocab_low=4, vocab_high=20, seed=0)
    config = M.preset("tiny", vocab_size=tokenizer.vocab_size, num_decoder_layers=1,
                      dropout=0.1)
    task = TrainTask(name="lm", tokenizer=tokenizer, train=tasks.lm_arrays(windows[:144]),
                     val=tasks.lm_arrays(windows[144:]), data={"windows": "repeat-0"})
    return config, task


@pytest.fixture(scope="module")
def faults_task():
    return make_task(train_tokenizer([TEXT], 300))


@pytest.fixture(scope="module")
def full_run(faults_task, tmp_path_factory):
    config, task = faults_task
    return trainer.train(config, TRAIN, task, tmp_path_factory.mktemp("full"))


def final_params(out_dir: Path):
    return checkpoint.load_for_sampling(out_dir)[2]


def assert_identical(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def saved_steps(out_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in out_dir.iterdir() if p.name.isdigit())


def test_checkpoints_every_tenth_of_the_run_by_default(full_run):
    assert TRAIN.save_every is None and TRAIN.save_interval == 3
    assert saved_steps(full_run.out_dir) == [27, 30]  # keep_checkpoints=2 of 3, 6, ..., 30
    assert TrainConfig(steps=5, warmup_steps=0).save_interval == 1
    record = json.loads((full_run.out_dir / run_dir.RUN_FILE).read_text())
    assert record["training"]["steps"] == STEPS and record["data"] == {"windows": "repeat-0"}


# Killed, interrupted, resumed ------------------------------------------------------------------

_CHILD = """
import os, signal, sys
from pathlib import Path
from kvjax.tokenizer import Tokenizer
from kvjax.train import trainer
import test_training_faults as t

out, kill_before, signum = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
config, task = t.make_task(Tokenizer.from_bytes(Path(sys.argv[4]).read_bytes()))
step_fn, calls = trainer.train_step, [0]

def killing_step(*args, **kwargs):
    calls[0] += 1
    if calls[0] == kill_before:
        os.kill(os.getpid(), signum)
    return step_fn(*args, **kwargs)

trainer.train_step = killing_step
trainer.train(config, t.TRAIN, task, out)
"""


def run_child(tmp_path: Path, task: TrainTask, kill_before: int, signum: int):
    tokenizer_file = tmp_path / "tokenizer.bin"
    tokenizer_file.write_bytes(task.tokenizer.to_bytes())
    out = tmp_path / "run"
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(out), str(kill_before), str(signum),
         str(tokenizer_file)],
        env={**os.environ, "PYTHONPATH": str(HERE)}, capture_output=True, text=True,
        timeout=300)
    return out, child


def test_sigkill_late_in_a_run_resumes_from_a_periodic_checkpoint_bit_identical(
        faults_task, full_run, tmp_path):
    config, task = faults_task
    out, child = run_child(tmp_path, task, kill_before=26, signum=signal.SIGKILL)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    # Killed during step 26 of 30: the checkpoint at 24, or at 21 if the background write of
    # 24 was still under way (orbax never exposes a half-written step).
    saved = checkpoint.latest_step(out)
    assert saved in (21, 24)

    resumed = trainer.train(config, TRAIN, task, out, resume=True)

    assert sorted(resumed.losses) == list(range(saved + 1, STEPS + 1))
    assert all(resumed.losses[s] == full_run.losses[s] for s in resumed.losses)
    assert_identical(final_params(out), final_params(full_run.out_dir))


def test_sigterm_saves_the_current_step_and_the_resumed_run_is_identical(
        faults_task, full_run, tmp_path, monkeypatch):
    config, task = faults_task
    real_step, calls = trainer.train_step, []

    def step_then_signal(*args, **kwargs):
        calls.append(1)
        if len(calls) == 17:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives during step 17
        return real_step(*args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", step_then_signal)
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(TrainingInterrupted, match="SIGTERM: saved a checkpoint at step 17"
                       ) as info:
        trainer.train(config, TRAIN, task, tmp_path)
    assert info.value.step == 17 and info.value.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) is handler  # restored after the run
    assert checkpoint.latest_step(tmp_path) == 17
    monkeypatch.undo()

    resumed = trainer.train(config, TRAIN, task, tmp_path, resume=True)
    assert min(resumed.losses) == 18
    assert_identical(final_params(tmp_path), final_params(full_run.out_dir))


def test_ctrl_c_saves_the_current_step_too(faults_task, tmp_path, monkeypatch):
    config, task = faults_task
    real_step, calls = trainer.train_step, []

    def step_then_ctrl_c(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", step_then_ctrl_c)
    with pytest.raises(TrainingInterrupted, match="SIGINT: saved a checkpoint at step 5") as info:
        trainer.train(config, TRAIN, task, tmp_path)
    assert info.value.exit_code == 130 and checkpoint.latest_step(tmp_path) == 5


# NaN guard -------------------------------------------------------------------------------------


def test_a_diverging_run_stops_with_an_error_and_saves_no_nan(faults_task, tmp_path):
    config, task = faults_task
    with pytest.raises(TrainingDiverged, match=r"training diverged: the (loss at step \d+ is "
                       r"(nan|inf)|params after step \d+ are not finite)") as info:
        trainer.train(config, TRAIN.replace(learning_rate=1e6), task, tmp_path)
    steps = saved_steps(tmp_path)
    if steps:  # what was saved before the divergence is finite, and the error names it
        assert f"the last good checkpoint is step {max(steps)} in {tmp_path}" in str(info.value)
        leaves = jax.tree.leaves(final_params(tmp_path))  # raises on a non-finite param
        assert all(np.isfinite(np.asarray(x)).all() for x in leaves)
    else:
        assert "no checkpoint was saved" in str(info.value)
    assert not (tmp_path / run_dir.LOSS_CURVE_FILE).exists()


# One trainer per directory; run records ---------------------------------------------------------


def test_a_second_trainer_on_the_same_directory_is_refused(faults_task, tmp_path):
    config, task = faults_task
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'a'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); sys.stdin.read()",
         str(tmp_path / run_dir.LOCK_FILE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(checkpoint.CheckpointError, match="in use by another training run"):
            trainer.train(config, TRAIN, task, tmp_path)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert checkpoint.latest_step(tmp_path) is None


def test_resume_refuses_other_steps_or_data_unless_allowed(faults_task, full_run, tmp_path):
    config, task = faults_task
    other_data = dataclasses.replace(task, data={"windows": "repeat-1"})
    with pytest.raises(checkpoint.CheckpointError, match=r"other data \(windows: "):
        trainer.train(config, TRAIN, other_data, full_run.out_dir, resume=True)
    with pytest.raises(checkpoint.CheckpointError, match=r"other settings \(steps: 30 then, 40 "
                       r"now\).*--allow-changes"):
        trainer.train(config, TRAIN.replace(steps=40), task, full_run.out_dir, resume=True)
    record = json.loads((full_run.out_dir / run_dir.RUN_FILE).read_text())
    assert record["training"]["steps"] == STEPS  # the refused calls changed nothing


def test_resume_with_allowed_changes_records_them(faults_task, tmp_path):
    config, task = faults_task
    trainer.train(config, TRAIN, task, tmp_path, stop_after=3)
    other_data = dataclasses.replace(task, data={"windows": "repeat-1"})
    trainer.train(config, TRAIN, other_data, tmp_path, resume=True, stop_after=6,
                  allow_changes=True)
    record = json.loads((tmp_path / run_dir.RUN_FILE).read_text())
    assert record["data"] == {"windows": "repeat-1"}
    assert record["resumed_with_changes_at_step"] == 3


def test_no_validation_set_means_no_validation_metrics(faults_task, tmp_path):
    config, task = faults_task
    no_val = dataclasses.replace(task, val={k: v[:0] for k, v in task.val.items()})
    result = trainer.train(config, TRAIN, no_val, tmp_path, stop_after=5)
    assert "val_loss" not in result.metrics and "val_ppl" not in result.metrics


def test_invalid_train_config_types_are_named():
    for field, value, message in [
            ("steps", 10.5, "must be an int"), ("steps", True, "must be an int"),
            ("steps", -1, "must be >= 1"), ("save_every", "3", "must be an int"),
            ("learning_rate", "1e-3", "must be a number"), ("seed", 2**64, "must be < 2"),
            ("seed", "1", "must be an int"), ("clip_norm", float("inf"), "must be finite")]:
        with pytest.raises(ValueError, match=f"{field}=.* {message}"):
            TrainConfig(**{field: value})


def test_an_lm_without_validation_text_reports_no_validation_metrics(tmp_path):
    """val_fraction=0 once reported val_ppl=1.0 and unigram_ppl=nan. (The settings are
    test_tasks.py's end-to-end run's, so that the two can share a compilation.)"""
    text_file = tmp_path / "text.txt"
    text_file.write_text(data.python_docs_text()[:40_000], encoding="utf-8")
    result = tasks.train_lm(tmp_path / "lm", data_files=[text_file], preset="tiny",
                            model_overrides={}, vocab_size=400, seq_len=32, batch_size=8,
                            val_fraction=0.0, steps=8, warmup_steps=2, eval_every=4,
                            save_every=4, progress=False)
    assert result.step == 8 and result.metrics == {}
    records = [json.loads(line) for line in (tmp_path / "lm" / run_dir.METRICS_FILE).open()]
    assert records and not any("val_loss" in r or "unigram_ppl" in r for r in records)
