"""Checkpoint integrity: damaged data, non-finite values and an edited config.json are errors
naming what is wrong, never a silently loaded model; checkpoints without a manifest still load.
"""

import gc
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from kvjax import checkpoint as ckpt
from kvjax import model as M
from kvjax.checkpoint import Checkpointer, CheckpointError
from kvjax.tokenizer import train_tokenizer

TEXT = "the quick brown fox jumps over the lazy dog.\n" * 20 + "pack my box with jugs\n"


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([TEXT], 300)


@pytest.fixture(scope="module")
def config(tokenizer):
    return M.preset("tiny", vocab_size=tokenizer.vocab_size)


def save_run(directory: Path, config, tokenizer, params=None, step: int = 3) -> dict:
    """A checkpoint directory as the trainer writes it: metadata, one step with a manifest."""
    params = M.init_params(config, jax.random.key(1)) if params is None else params
    state = {"params": params, "opt_state": optax.adam(1e-3).init(params),
             "step": jnp.int32(step)}
    ckpt.write_metadata(directory, config.to_dict(), "lm", tokenizer.to_bytes())
    manifest = ckpt.manifest_metadata(config.to_dict(), "lm", tokenizer.to_bytes())
    with Checkpointer(directory, save_every=1, keep=1, manifest=manifest) as checkpointer:
        checkpointer.save(step, state)
    return state


def data_files(step_path: Path) -> list[Path]:
    """The OCDBT data files of a step's state, largest first."""
    files = (step_path / "state" / "ocdbt.process_0" / "d").iterdir()
    return sorted(files, key=lambda p: -p.stat().st_size)


def flip(path: Path, offset: int, count: int = 1) -> None:
    data = bytearray(path.read_bytes())
    for i in range(offset, offset + count):
        data[i % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


def test_the_manifest_holds_a_checksum_per_array_and_the_config(tmp_path, config, tokenizer):
    state = save_run(tmp_path, config, tokenizer)
    manifest = ckpt.read_manifest(tmp_path)
    leaves = jax.tree_util.tree_leaves_with_path(state)
    assert len(manifest["sha256"]) == len(leaves)
    assert manifest["model"] == json.loads(json.dumps(config.to_dict()))
    assert manifest["task"] == "lm"
    loaded_config, _, params = ckpt.load_for_sampling(tmp_path)
    assert loaded_config == config
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state["params"]), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("count", [1, 64])
def test_flipped_bytes_in_param_data_are_an_error_naming_the_array(tmp_path, config, tokenizer,
                                                                   count):
    save_run(tmp_path, config, tokenizer)
    biggest = data_files(tmp_path / "3")[0]
    flip(biggest, biggest.stat().st_size // 2, count)
    with pytest.raises(CheckpointError) as info:
        ckpt.load_for_sampling(tmp_path)
    message = str(info.value)
    assert str(tmp_path / "3") in message
    # Either the reader sees the damage (a compressed chunk that no longer decodes) or the
    # checksum does; both name the checkpoint, and the checksum names the array.
    assert "params/" in message or "cannot read checkpoint" in message, message


# A read that fails on a damaged file leaves orbax's reads of the other arrays unfinished;
# Python closes them when it collects them, which pytest reports under whatever test runs
# then. They are collected here, where that is expected.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_flipped_byte_anywhere_is_an_error_or_changes_nothing(tmp_path, config, tokenizer):
    """Resume reads params and optimizer state: a flipped byte in any data file either raises
    or lies outside what is read (B-tree nodes of superseded versions, padding), so the state
    comes back bit-identical. It never comes back silently different."""
    state = save_run(tmp_path, config, tokenizer)
    abstract = jax.eval_shape(lambda: state)
    caught = 0
    for path in data_files(tmp_path / "3"):
        original = path.read_bytes()
        for offset in np.linspace(0, len(original) - 1, 5).astype(int):
            flip(path, int(offset))
            try:
                _, restored = ckpt.restore_latest(tmp_path, abstract)
            except CheckpointError as error:
                assert str(tmp_path / "3") in str(error)
                caught += 1
            else:
                for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
                    np.testing.assert_array_equal(a, b)
            path.write_bytes(original)
    assert caught >= 4  # the array data itself is covered
    gc.collect()


def test_optimizer_state_damage_is_named(tmp_path, config, tokenizer):
    params = M.init_params(config, jax.random.key(1))
    state = save_run(tmp_path, config, tokenizer, params)
    # Damage found by the checksum alone: rewrite the manifest's hash of one optimizer array,
    # as a flipped byte in that array's data would make it differ.
    manifest_file = tmp_path / "3" / ckpt.MANIFEST_ITEM / "metadata"
    manifest = json.loads(manifest_file.read_text())
    name = next(k for k in manifest["sha256"] if k.startswith("opt_state/"))
    manifest["sha256"][name] = "0" * 64
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=f"the data of {name} does not match"):
        ckpt.restore_latest(tmp_path, jax.eval_shape(lambda: state))
    ckpt.load_for_sampling(tmp_path)  # sampling reads only the params, which are intact


def test_non_finite_params_are_refused_naming_the_leaf(tmp_path, config, tokenizer):
    params = M.init_params(config, jax.random.key(1))
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x.at[0].set(jnp.nan) if "embed" in jax.tree_util.keystr(path) else x,
        params)
    save_run(tmp_path, config, tokenizer, params)
    with pytest.raises(CheckpointError, match=r"embed\S* holds NaN or infinite values"):
        ckpt.load_for_sampling(tmp_path)


@pytest.mark.parametrize("edit, field", [
    ({"positional_encoding": "rope"}, "positional_encoding"),
    ({"activation": "gelu"}, "activation"),
    ({"d_model": "128"}, "d_model"),
])
def test_a_config_json_that_disagrees_with_the_checkpoint_is_an_error(tmp_path, config,
                                                                       tokenizer, edit, field):
    save_run(tmp_path, config, tokenizer)
    config_file = tmp_path / ckpt.CONFIG_FILE
    stored = json.loads(config_file.read_text())
    stored["model"].update(edit)
    config_file.write_text(json.dumps(stored))
    with pytest.raises(CheckpointError, match=f"disagrees with the config stored.*{field}"):
        ckpt.load_for_sampling(tmp_path)


def test_another_tokenizer_file_is_an_error(tmp_path, config, tokenizer):
    save_run(tmp_path, config, tokenizer)
    other = train_tokenizer([TEXT.replace("fox", "cat")], 300)
    (tmp_path / ckpt.TOKENIZER_FILE).write_bytes(other.to_bytes())
    with pytest.raises(CheckpointError, match="not the tokenizer the checkpoint was trained"):
        ckpt.load_for_sampling(tmp_path)


def test_write_atomically_replaces_whole_files(tmp_path):
    target = tmp_path / "run.json"
    ckpt.write_atomically(target, "old")
    ckpt.write_atomically(target, b"new")
    assert target.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]  # no temporary left behind
