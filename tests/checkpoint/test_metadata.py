"""Tests for kvjax.checkpoint's directory metadata and loading for sampling: round trips,
writes that fail or would replace what checkpoints depend on, and bad input that changes
nothing on disk."""

import os

import jax
import jax.numpy as jnp
import optax
import pytest
from checkpoint_support import TOKENIZER, assert_trees_equal, make_saved_dir, snapshot

from kvjax import checkpoint as ckpt
from kvjax.checkpoint import Checkpointer, CheckpointError


@pytest.fixture
def saved_dir(tmp_path):
    return make_saved_dir(tmp_path)


# Directory metadata ----------------------------------------------------------------------------


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


# Loading for sampling --------------------------------------------------------------------------


def _model_and_tokenizer():
    from kvjax.model import init_params
    from kvjax.model.config import preset
    from kvjax.tokenizer import train_tokenizer

    text = "the quick brown fox jumps over the lazy dog.\n" * 20 + "pack my box with jugs\n"
    tokenizer = train_tokenizer([text], 300)
    config = preset("tiny", vocab_size=tokenizer.vocab_size)
    return config, tokenizer, init_params


def test_load_for_sampling_round_trip(tmp_path):
    config, tokenizer, init_params = _model_and_tokenizer()
    params = init_params(config, jax.random.key(1))
    state = {"params": params, "opt_state": optax.adam(1e-3).init(params), "step": jnp.int32(5)}
    ckpt.write_metadata(tmp_path, config.to_dict(), "lm", tokenizer.to_bytes())
    with Checkpointer(tmp_path, save_every=100, keep=1) as checkpointer:
        assert checkpointer.save(5, state, force=True)

    loaded_config, loaded_tokenizer, loaded_params = ckpt.load_for_sampling(tmp_path)

    assert loaded_config == config
    assert loaded_tokenizer.to_bytes() == tokenizer.to_bytes()
    assert loaded_tokenizer.encode("the lazy fox") == tokenizer.encode("the lazy fox")
    assert_trees_equal(loaded_params, params)


@pytest.mark.parametrize("saved_scanned", [True, False])
def test_load_for_sampling_holds_the_layers_as_asked_whichever_way_they_were_saved(
        tmp_path, saved_scanned):
    from kvjax import model as M

    config, tokenizer, init_params = _model_and_tokenizer()
    config = config.replace(scan_layers=saved_scanned)
    params = init_params(config, jax.random.key(1))
    ckpt.write_metadata(tmp_path, config.to_dict(), "lm", tokenizer.to_bytes())
    with Checkpointer(tmp_path, save_every=1, keep=1) as checkpointer:
        checkpointer.save(1, {"params": params, "step": jnp.int32(1)})

    default_config, _, default_params = ckpt.load_for_sampling(tmp_path)
    assert default_config == config.replace(scan_layers=M.TransformerConfig.scan_layers)
    for scan_layers in (True, False):
        loaded_config, _, loaded_params = ckpt.load_for_sampling(tmp_path, scan_layers=scan_layers)
        assert loaded_config == config.replace(scan_layers=scan_layers)
        assert_trees_equal(loaded_params, M.with_layer_layout(config, params, scan_layers)[1])
        if scan_layers == default_config.scan_layers:
            assert_trees_equal(loaded_params, default_params)


def test_load_for_sampling_refuses_params_of_another_config(tmp_path):
    config, tokenizer, init_params = _model_and_tokenizer()
    params = init_params(config, jax.random.key(1))
    ckpt.write_metadata(tmp_path, config.replace(d_model=64).to_dict(), "lm", tokenizer.to_bytes())
    save = {"params": params, "step": jnp.int32(1)}
    with Checkpointer(tmp_path, save_every=1, keep=1) as checkpointer:
        checkpointer.save(1, save)
    before = snapshot(tmp_path)

    with pytest.raises(CheckpointError, match=f"checkpoint {tmp_path / '1'} does not match"):
        ckpt.load_for_sampling(tmp_path)

    assert snapshot(tmp_path) == before
