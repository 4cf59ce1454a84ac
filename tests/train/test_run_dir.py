"""train/run_dir.py: one process trains into a directory at a time; a resumed run's metrics
read as one run; run.json records what a resumed run must match, and a mismatch or a damaged
file is an error naming it."""

import json

import numpy as np
import pytest

from kvjax.checkpoint import CheckpointError
from kvjax.train import run_dir
from kvjax.train.config import TRAJECTORY_FIELDS, TrainConfig, TrainTask


def test_a_directory_is_held_by_one_run_at_a_time(tmp_path):
    out_dir = tmp_path / "run"
    with run_dir.exclusive(out_dir):
        # flock belongs to an open file, so a second opening is refused even in this process.
        with pytest.raises(CheckpointError, match=f"{out_dir} is in use by another training "
                                                  f"run \\(it holds {out_dir / '.lock'}\\)"):
            with run_dir.exclusive(out_dir):
                pass
        with run_dir.exclusive(out_dir, lock=False):  # a job's other processes
            pass
    with run_dir.exclusive(out_dir):  # released when the run ends
        pass
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        with run_dir.exclusive(tmp_path / "file"):
            pass


def test_a_resumed_runs_metrics_drop_what_came_after_its_checkpoint(tmp_path):
    path = tmp_path / run_dir.METRICS_FILE
    first = run_dir.MetricsLog(path, keep_through_step=0)
    for step in (10, 20, 30):
        first.write({"step": step, "loss": 1 / step})
    assert first.last_step == 30
    other = run_dir.MetricsLog(path, keep_through_step=20, write=False)
    assert other.last_step == 20 and len(other.read()) == 3  # a job's other process: untouched
    resumed = run_dir.MetricsLog(path, keep_through_step=20)
    assert [r["step"] for r in resumed.read()] == [10, 20] and resumed.last_step == 20
    resumed.write({"step": 30, "loss": 0.5})
    assert [(r["step"], r["loss"]) for r in resumed.read()] == [(10, 0.1), (20, 0.05), (30, 0.5)]
    assert run_dir.MetricsLog(tmp_path / "new.jsonl", keep_through_step=7).last_step == 7


def task(**data):
    arrays = {"inputs": np.zeros((2, 3), np.int32)}
    return TrainTask(name="lm", tokenizer=None, train=arrays, val=arrays, data=data)


def test_run_json_records_the_data_and_the_trajectory_and_a_resume_must_match(tmp_path):
    config = TrainConfig(steps=50, warmup_steps=5, learning_rate=1e-3)
    record = run_dir.run_record(config, task(file="a.txt", sha256="00"))
    assert record["task"] == "lm" and record["data"] == {"file": "a.txt", "sha256": "00"}
    assert record["training"] == {name: getattr(config, name) for name in TRAJECTORY_FIELDS}
    run_dir.write_run_record(tmp_path, {**record, "resumed_with_changes_at_step": 3})
    assert run_dir.read_run_record(tmp_path) == record
    run_dir.check_same_record(tmp_path, record, record)
    longer = run_dir.run_record(config.replace(steps=80, seed=1), task(file="a.txt", sha256="00"))
    with pytest.raises(CheckpointError, match=r"other settings \(seed: 0 then, 1 now; "
                                              r"steps: 50 then, 80 now\).*--allow-changes"):
        run_dir.check_same_record(tmp_path, record, longer)
    other_data = run_dir.run_record(config, task(file="b.txt", sha256="00"))
    with pytest.raises(CheckpointError, match=r'other data \(file: "a.txt" then, "b.txt" now\)'):
        run_dir.check_same_record(tmp_path, record, other_data)
    # A setting an older record leaves out had its default then.
    older = {**record, "training": {k: v for k, v in record["training"].items()
                                    if k != "router_aux_loss_coef"}}
    run_dir.check_same_record(tmp_path, older, record)
    with pytest.raises(CheckpointError, match=r"router_aux_loss_coef: 0.0 then, 0.01 now"):
        run_dir.check_same_record(tmp_path, older, run_dir.run_record(
            config.replace(router_aux_loss_coef=0.01), task(file="a.txt", sha256="00")))


def test_a_missing_run_json_is_none_and_a_damaged_one_an_error_naming_it(tmp_path):
    assert run_dir.read_run_record(tmp_path) is None
    path = tmp_path / run_dir.RUN_FILE
    for content, message in (("{not json", "is not valid JSON"),
                             (json.dumps([1, 2]), "must hold a JSON object"),
                             (b"\xff\xfe", "is not valid JSON")):
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        with pytest.raises(CheckpointError, match=f"{path} {message}"):
            run_dir.read_run_record(tmp_path)
