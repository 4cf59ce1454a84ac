"""Saving: `Checkpointer` writes a training state every few steps, atomically, in the background;
`write_manifest` gives a step saved before manifests existed the one a save writes now."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from kvjax.distributed import host_arrays

from .layout import (
    MANIFEST_FORMAT,
    MANIFEST_ITEM,
    PARAMS_KEY,
    STATE_ITEM,
    CheckpointError,
    UnverifiedCheckpointWarning,
    describe,
    existing_directory,
    flat,
    handler_registry,
    leaf_name,
    sha256,
)
from .metadata import read_metadata, write_metadata
from .restore import abstract_saved_state, latest_step, restore_latest


class Checkpointer:
    """Saves a training state every `save_every` steps into `directory`, keeping the newest `keep`.

    The state is any pytree of arrays, e.g. `{"params": ..., "opt_state": ..., "step": int32[],
    "rng": uint32[2] (jax.random.key_data), "data_position": int32[]}`. Leaves are stored as JAX
    holds them (`jnp.asarray`: with 64-bit mode off an int64 numpy leaf becomes int32), so
    `jax.eval_shape(lambda: state)` is always a valid target for `restore_latest`. Typed PRNG
    keys are refused: store `jax.random.key_data(key)`.

    With `async_save`, `save` returns once orbax holds the arrays (numpy leaves are copied first,
    jax arrays are immutable) and a background thread writes them while training continues;
    `wait()` blocks until that write is on disk and raises `CheckpointError` if it failed, as do
    `close()`, leaving the `with` block, and the next `save`. Not thread-safe; one writer per
    directory.

    Each step also gets a manifest: the SHA-256 of every array's bytes (taken before the
    write starts), plus `manifest`, JSON data stored verbatim with every step (the trainer
    puts the model config, the task and the tokenizer's hash there, see `manifest_metadata`).
    """

    def __init__(
        self, directory: str | os.PathLike, *, save_every: int, keep: int, async_save: bool = True,
        manifest: Mapping[str, Any] | None = None,
    ):
        if save_every < 1:
            raise ValueError(f"save_every must be >= 1, got {save_every}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise NotADirectoryError(f"checkpoint directory {self.directory} is not a directory")
        self.save_every = save_every
        self.keep = keep
        self._manifest = _json_round_trip(dict(manifest or {}), "manifest")
        options = ocp.CheckpointManagerOptions(
            # The policies replace the deprecated `save_interval_steps`/`max_to_keep`; a bare
            # interval policy also drops orbax's default "always save the first step".
            save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(save_every),
            preservation_policy=ocp.checkpoint_managers.LatestN(keep),
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
        )
        # orbax needs an absolute path; messages keep the one the caller gave.
        self._manager = ocp.CheckpointManager(
            self.directory.absolute(), options=options, handler_registry=handler_registry()
        )
        self._step_in_flight: int | None = None
        self._closed = False

    def maybe_save(self, step: int, state: Any) -> bool:
        """Saves `state` as `step` if the step is due (`step % save_every == 0`); see `save`."""
        return self.save(step, state)

    def save(self, step: int, state: Any, *, force: bool = False) -> bool:
        """Saves `state` as `step` if `force` or the step is due; returns whether it started one.

        Without `force` a step not newer than the latest saved one is skipped (False); with it,
        an already saved step is skipped and an older one raises ValueError, since retention
        assumes steps only grow. Waits for the previous save first; raises `CheckpointError` if
        that one or this one fails.
        """
        self._check_open()
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        # Decided before waiting, so that calling this every step never blocks on a save.
        if not force and not self._manager.should_save(step):
            return False
        latest = self._manager.latest_step()
        if latest is not None and step <= latest:
            if step in self._manager.all_steps():
                return False
            raise ValueError(
                f"step {step} is older than step {latest}, the latest in {self.directory}"
            )
        stored = _as_stored(state)
        manifest = _step_manifest(self._manifest, stored)
        self.wait()
        args = ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardSave(stored),
                                     MANIFEST_ITEM: ocp.args.JsonSave(manifest)})
        try:
            self._manager.save(step, args=args, force=True)
        except Exception as e:
            raise CheckpointError(
                f"saving step {step} to {self.directory} failed: {describe(e)}"
            ) from e
        self._step_in_flight = step
        return True

    def wait(self) -> None:
        """Blocks until the last save is on disk; raises `CheckpointError` if it failed."""
        step, self._step_in_flight = self._step_in_flight, None
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise CheckpointError(
                f"saving step {step} to {self.directory} failed: {describe(e)}"
            ) from e

    def all_steps(self) -> list[int]:
        """Steps saved or being saved, oldest first."""
        return sorted(self._manager.all_steps())

    def close(self) -> None:
        """Waits for the last save (raising `CheckpointError` if it failed) and releases orbax."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"Checkpointer for {self.directory} is closed")


def write_manifest(directory: str | os.PathLike) -> int:
    """Writes the manifest a `Checkpointer` of today would have saved with the newest step of
    `directory`, a step saved without one; returns the step.

    The checksums are those of the arrays as they are now on disk, so they vouch only for what
    the step holds today: run this on a checkpoint known to be good (it loads, and samples or
    scores as it should), after which any change to its data is caught. The metadata part is
    what the trainer stores (`manifest_metadata` of `config.json` and `tokenizer.model`). The
    step's arrays and files are left as they are: the manifest is written into a temporary
    directory beside them and renamed into place, then the whole step is read back and checked
    against it. Raises `CheckpointError` if the step already has a manifest, or if it cannot be
    read or holds NaN or infinity (then nothing is written).
    """
    path = existing_directory(directory)
    step = latest_step(path)
    if step is None:
        raise CheckpointError(f"no checkpoint found in {path}: it holds no finalized step")
    step_path = path / str(step)
    if (step_path / MANIFEST_ITEM).exists():
        raise CheckpointError(f"checkpoint {step_path} already has a manifest")
    config_dict, task, tokenizer_bytes = read_metadata(path)
    abstract = abstract_saved_state(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnverifiedCheckpointWarning)  # the step has none yet
        restored_step, state = restore_latest(path, abstract)
    if restored_step != step:
        raise CheckpointError(f"{path} gained step {restored_step} while its manifest was made")
    manifest = _step_manifest(manifest_metadata(config_dict, task, tokenizer_bytes),
                              _as_stored(state))
    _write_manifest_item(step_path, manifest)
    restore_latest(path, abstract)  # a manifest that disagrees with the data fails here, not later
    return step


def _write_manifest_item(step_path: Path, manifest: dict[str, Any]) -> None:
    # The handler a save uses for this item, so that the file is the one a save writes.
    handler = handler_registry().get(MANIFEST_ITEM, ocp.args.JsonSave)
    staging = Path(tempfile.mkdtemp(dir=step_path, prefix=f".{MANIFEST_ITEM}.", suffix=".tmp"))
    try:
        os.chmod(staging, 0o755)  # mkdtemp's 0700 would make the item private
        handler.save(staging, args=ocp.args.JsonSave(manifest))
        os.rename(staging, step_path / MANIFEST_ITEM)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _step_manifest(metadata: Mapping[str, Any], stored: Any) -> dict[str, Any]:
    """The manifest saved with a step: `metadata` (see `Checkpointer`) and the checksums."""
    return {**metadata, "format": MANIFEST_FORMAT, "sha256": _checksums(stored)}


def _checksums(tree: Any) -> dict[str, str]:
    """SHA-256 of each leaf's bytes (C order, as stored), keyed by its '/'-joined path."""
    return {"/".join(key): sha256(leaf) for key, leaf in flat(host_arrays(tree)).items()}


def _json_round_trip(value: Any, what: str) -> Any:
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} cannot be written as JSON: {e}") from e


def write_model(out: str | os.PathLike, config_dict: Mapping[str, Any], task: str,
                tokenizer_bytes: bytes, params: Any) -> Path:
    """Saves a whole model into the new checkpoint directory `out` at step 0: its
    config.json, tokenizer and params, with a manifest (what `kvjax import-hf` and `kvjax
    merge-lora` write). `out` must not hold checkpoint steps yet."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} is not a directory")
    if out.is_dir() and latest_step(out) is not None:
        raise CheckpointError(f"{out} already holds checkpoint steps; write into a new "
                              "directory")
    write_metadata(out, config_dict, task, tokenizer_bytes)
    manifest = manifest_metadata(config_dict, task, tokenizer_bytes)
    with Checkpointer(out, save_every=1, keep=1, async_save=False, manifest=manifest) as saver:
        saver.save(0, {PARAMS_KEY: params}, force=True)
    return out


def manifest_metadata(config_dict: Mapping[str, Any], task: str, tokenizer_bytes: bytes,
                      lora: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What a trainer stores in every step's manifest: the model config and task (and the
    LoRA record) as `config.json` holds them, and the SHA-256 of the tokenizer file."""
    metadata = {"task": task, "model": _json_round_trip(dict(config_dict), "config_dict"),
                "tokenizer_sha256": hashlib.sha256(bytes(tokenizer_bytes)).hexdigest()}
    if lora is not None:
        metadata["lora"] = _json_round_trip(dict(lora), "lora")
    return metadata


def _as_stored(state: Any) -> Any:
    def convert(path: tuple, leaf: Any) -> jax.Array:
        if isinstance(leaf, jax.Array):
            array = leaf
        else:
            # A copy: the caller may reuse a numpy buffer while the background write runs.
            try:
                array = jnp.array(leaf)
            except TypeError as e:
                raise TypeError(
                    f"state leaf {leaf_name(path)} is a {type(leaf).__name__}, not an array"
                ) from e
        if jnp.issubdtype(array.dtype, jax.dtypes.prng_key):
            raise TypeError(
                f"state leaf {leaf_name(path)} is a typed PRNG key; "
                "store jax.random.key_data(key) instead"
            )
        return array

    stored = jax.tree_util.tree_map_with_path(convert, state)
    if not jax.tree.leaves(stored):
        raise ValueError("the state to save holds no arrays")
    return stored
