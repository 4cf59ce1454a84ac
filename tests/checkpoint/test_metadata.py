"""kvjax/checkpoint/metadata.py: a directory's metadata round trips; writes that fail or would
replace what checkpoints depend on, and bad input, change nothing on disk."""

import os

import pytest
from checkpoint_support import TOKENIZER, make_saved_dir, snapshot

from kvjax import checkpoint as ckpt
from kvjax.checkpoint import CheckpointError


@pytest.fixture
def saved_dir(tmp_path):
    return make_saved_dir(tmp_path)


def test_metadata_round_trip(tmp_path):
    directory = tmp_path / "new" / "run"
    config = {"d_model": 8, "num_kv_heads": None, "dtype": "bfloat16"}

    ckpt.write_metadata(directory, config, "translate", b"\x00model\xff")

    assert ckpt.read_metadata(directory) == (config, "translate", b"\x00model\xff")
    assert sorted(p.name for p in directory.iterdir()) == [ckpt.CONFIG_FILE, ckpt.TOKENIZER_FILE]


def test_failed_metadata_write_keeps_the_old_file(tmp_path, monkeypatch):
    ckpt.write_metadata(tmp_path, {"d_model": 8}, "lm", b"old")

    def fail(fd):
        raise OSError("simulated crash before the data reached the disk")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="simulated crash"):
        ckpt.write_metadata(tmp_path, {"d_model": 16}, "lm", b"old")
    monkeypatch.undo()

    assert ckpt.read_metadata(tmp_path) == ({"d_model": 8}, "lm", b"old")
    assert sorted(p.name for p in tmp_path.iterdir()) == [ckpt.CONFIG_FILE, ckpt.TOKENIZER_FILE]


def test_rewriting_the_same_metadata_touches_nothing(saved_dir):
    before = snapshot(saved_dir)
    ckpt.write_metadata(saved_dir, {"d_model": 8}, "lm", TOKENIZER)
    assert snapshot(saved_dir) == before


@pytest.mark.parametrize(
    ("config", "task", "tokenizer", "expected"),
    [
        ({"d_model": 16}, "lm", TOKENIZER, r"different config \(\['d_model'\] differ\)"),
        ({"d_model": 8}, "translate", TOKENIZER, r"different config \(\['task'\] differ\)"),
        ({"d_model": 8}, "lm", b"another tokenizer", "already holds a different tokenizer"),
    ],
    ids=["config", "task", "tokenizer"],
)
def test_metadata_of_existing_checkpoints_is_never_replaced(
    saved_dir, config, task, tokenizer, expected
):
    before = snapshot(saved_dir)
    with pytest.raises(CheckpointError, match=expected) as info:
        ckpt.write_metadata(saved_dir, config, task, tokenizer)
    assert str(saved_dir) in str(info.value)
    assert snapshot(saved_dir) == before


def test_metadata_without_checkpoints_may_be_replaced(tmp_path):
    ckpt.write_metadata(tmp_path, {"d_model": 8}, "lm", b"old")
    ckpt.write_metadata(tmp_path, {"d_model": 16}, "translate", b"new")
    assert ckpt.read_metadata(tmp_path) == ({"d_model": 16}, "translate", b"new")


def test_invalid_metadata_input_writes_nothing(tmp_path):
    directory = tmp_path / "run"
    with pytest.raises(ValueError, match="JSON"):
        ckpt.write_metadata(directory, {"d_model": object()}, "lm", b"tok")
    with pytest.raises(ValueError, match="task"):
        ckpt.write_metadata(directory, {"d_model": 8}, "", b"tok")
    with pytest.raises(ValueError, match="tokenizer_bytes"):
        ckpt.write_metadata(directory, {"d_model": 8}, "lm", b"")
    assert not directory.exists()
