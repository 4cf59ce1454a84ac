"""kvjax/checkpoint/restore.py: what cannot be restored as asked (no directory, no step, another
shape, dtype or config, truncated or corrupted files, a bad config.json) is an error naming it,
and the directory is byte-for-byte and mtime-for-mtime what it was: restoring never repairs,
creates or deletes."""

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from checkpoint_support import (
    abstract_of,
    make_saved_dir,
    make_state,
    snapshot,
)

from kvjax import checkpoint as ckpt
from kvjax.checkpoint import Checkpointer, CheckpointError

TMP_SUFFIX = ".orbax-checkpoint-tmp"


@pytest.fixture
def saved_dir(tmp_path):
    return make_saved_dir(tmp_path)


def test_missing_directory_is_named_and_not_created(tmp_path):
    missing = tmp_path / "no-such-run"
    abstract = abstract_of(make_state())
    for call in (
        lambda: ckpt.restore_latest(missing, abstract),
        lambda: ckpt.restore_params(missing, abstract["params"]),
        lambda: ckpt.read_metadata(missing),
    ):
        with pytest.raises(FileNotFoundError, match=str(missing)):
            call()
    assert ckpt.latest_step(missing) is None
    assert not missing.exists()


def test_directory_without_steps(tmp_path):
    directory = tmp_path / "run"
    ckpt.write_metadata(directory, {"d_model": 8}, "lm", b"tok")
    (directory / f"7{TMP_SUFFIX}").mkdir()  # an unfinished save is not a checkpoint
    before = snapshot(directory)

    with pytest.raises(CheckpointError, match=f"no checkpoint found in {directory}"):
        ckpt.restore_latest(directory, abstract_of(make_state()))
    with pytest.raises(CheckpointError, match=f"no checkpoint found in {directory}"):
        ckpt.restore_params(directory, abstract_of(make_state()["params"]))

    assert snapshot(directory) == before


def _with_shape(abstract, shape):
    abstract["params"]["embed"] = jax.ShapeDtypeStruct(shape, abstract["params"]["embed"].dtype)


def _with_dtype(abstract, dtype):
    abstract["params"]["embed"] = jax.ShapeDtypeStruct(abstract["params"]["embed"].shape, dtype)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            lambda a: _with_shape(a, (16, 12)),
            r"params/embed is shape \(16, 8\) float32, wanted shape \(16, 12\) float32",
        ),
        (
            lambda a: _with_dtype(a, jnp.bfloat16),
            r"params/embed is shape \(16, 8\) float32, wanted shape \(16, 8\) bfloat16",
        ),
        (lambda a: a.pop("data_position"), r"data_position is saved but not wanted"),
        (
            lambda a: a["params"].update(extra=jax.ShapeDtypeStruct((2,), jnp.float32)),
            r"params/extra is missing \(wanted shape \(2,\) float32\)",
        ),
    ],
    ids=["shape", "dtype", "missing-in-target", "missing-in-checkpoint"],
)
def test_state_mismatch_names_path_leaf_and_shapes(saved_dir, change, expected):
    abstract = abstract_of(make_state())
    change(abstract)
    before = snapshot(saved_dir)

    with pytest.raises(CheckpointError, match=expected) as info:
        ckpt.restore_latest(saved_dir, abstract)

    assert f"checkpoint {saved_dir / '2'} does not match" in str(info.value)
    assert snapshot(saved_dir) == before


def test_params_of_another_config_are_refused(saved_dir):
    before = snapshot(saved_dir)
    wider = abstract_of(make_state(d_model=16)["params"])

    with pytest.raises(CheckpointError, match=str(saved_dir / "2")) as info:
        ckpt.restore_params(saved_dir, wider)

    assert "params/embed is shape (16, 8) float32, wanted shape (16, 16) float32" in str(info.value)
    assert snapshot(saved_dir) == before


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


@pytest.mark.parametrize("damaged", ["index", "array-data"])
def test_truncated_files_raise_checkpoint_error(tmp_path, damaged):
    # One array: when one of several concurrent reads fails, orbax leaves the others pending,
    # and they print "Exception ignored" whenever they are garbage collected, even at exit.
    state = {"params": {"big": jnp.linspace(0.0, 1.0, 100_000)}}
    with Checkpointer(tmp_path, save_every=1, keep=1) as checkpointer:
        checkpointer.save(1, state)
    step_path = tmp_path / "1"
    if damaged == "index":  # the OCDBT b-tree that locates every array
        for path in (step_path / "state" / "d").iterdir():
            _truncate(path)
    else:  # the chunk of the big array: only reading the values finds out
        files = [p for p in step_path.rglob("*") if p.is_file()]
        _truncate(max(files, key=lambda p: p.stat().st_size))
    before = snapshot(tmp_path)

    for restore in (
        lambda: ckpt.restore_latest(tmp_path, abstract_of(state)),
        lambda: ckpt.restore_params(tmp_path, abstract_of(state["params"])),
    ):
        with pytest.raises(CheckpointError, match=f"cannot read checkpoint {step_path}") as info:
            restore()
        assert info.value.__cause__ is not None

    assert snapshot(tmp_path) == before


def test_corrupted_array_metadata_raises_checkpoint_error(saved_dir):
    metadata = saved_dir / "2" / "state" / "_METADATA"
    metadata.write_bytes(metadata.read_bytes()[: metadata.stat().st_size // 2])
    before = snapshot(saved_dir)

    with pytest.raises(CheckpointError, match=str(saved_dir / "2")):
        ckpt.restore_params(saved_dir, abstract_of(make_state()["params"]))

    assert snapshot(saved_dir) == before


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"format": 1, "task": "lm", "model": {', "is not valid JSON"),
        ('{"format": 1, "model": {}}', r"is missing the keys \['task'\]"),
        ('["format", 1]', "must hold a JSON object"),
        ('{"format": 99, "task": "lm", "model": {}}', "has format 99"),
    ],
    ids=["invalid-json", "missing-key", "not-an-object", "unknown-format"],
)
def test_bad_config_json_is_named(saved_dir, content, expected):
    config_path = saved_dir / ckpt.CONFIG_FILE
    config_path.write_text(content)
    before = snapshot(saved_dir)

    with pytest.raises(ValueError, match=expected) as info:
        ckpt.read_metadata(saved_dir)

    assert str(config_path) in str(info.value)
    assert snapshot(saved_dir) == before
