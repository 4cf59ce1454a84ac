"""Training checkpoints: atomic asynchronous saves with orbax, restores that check their target.

A checkpoint directory holds the training state at a few steps plus what is needed to use it::

    <directory>/
        config.json                  {"format": 1, "task": "lm", "model": {...TransformerConfig...}}
        tokenizer.model              the serialized sentencepiece model
        <step>/state/...             the training state at <step> (orbax StandardSave)
        <step>/manifest/...          SHA-256 of every array of that state, the model config and
                                     the tokenizer's hash (orbax JsonSave; older steps lack it)
        <step>.orbax-checkpoint-tmp/ a save in progress, or one killed mid-way: never read

Saves are atomic. Orbax writes a step into `<step>.orbax-checkpoint-tmp`, writes
`commit_success.txt` and only then renames the directory to `<step>`; step discovery skips
names that are not plain integers, so a process killed mid-save leaves the previous steps
loadable and the half-written one invisible. The next `Checkpointer` on the directory deletes
such leftovers. `config.json` and `tokenizer.model` are written to a temporary file in the same
directory and moved into place with `os.replace`, so they are either old or new, never partial.

Every restore checks what it read: each array against the SHA-256 its step's manifest holds
(so a flipped byte in the data, or a bit-rotted file, is an error naming the array, never a
silently wrong model) and every floating-point array for NaN and infinity. A `config.json` or
tokenizer that disagrees with the copy in the manifest is an error naming the fields that differ.
Checkpoints written before manifests existed still load, with the finiteness check only.

Restores always take an abstract target (a pytree of `jax.ShapeDtypeStruct`, e.g. from
`jax.eval_shape`) and compare it leaf by leaf with the checkpoint's metadata before reading any
array, so a checkpoint of another model is reported as such instead of being silently cast,
padded or truncated. Readers open orbax read-only: loading never creates, rewrites or deletes
anything. Every failure names the path it concerns; orbax or tensorstore errors are wrapped in
`CheckpointError` with the original exception chained.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.model"
METADATA_FORMAT = 1
STATE_ITEM = "state"  # orbax item name of the training state inside each step directory
MANIFEST_ITEM = "manifest"  # orbax item name of the step's checksums and metadata copy
MANIFEST_FORMAT = 1
PARAMS_KEY = "params"  # the subtree of the training state that `restore_params` reads

_MAX_LISTED_MISMATCHES = 5


class _QuietReadOnlyNotice(logging.Filter):
    """Readers open orbax read-only on purpose; its warning that they did is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Given directory is read only")


logging.getLogger("absl").addFilter(_QuietReadOnlyNotice())


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be written or read as asked; the message names it."""


# Saving ----------------------------------------------------------------------------------------


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
            self.directory.absolute(), options=options, handler_registry=_handler_registry()
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
        manifest = {**self._manifest, "format": MANIFEST_FORMAT, "sha256": _checksums(stored)}
        self.wait()
        args = ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardSave(stored),
                                     MANIFEST_ITEM: ocp.args.JsonSave(manifest)})
        try:
            self._manager.save(step, args=args, force=True)
        except Exception as e:
            raise CheckpointError(
                f"saving step {step} to {self.directory} failed: {_describe(e)}"
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
                f"saving step {step} to {self.directory} failed: {_describe(e)}"
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


def _handler_registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    # Registered up front so that metadata can be read before anything is restored, and so that
    # the params-only restore (PyTreeRestore) reads the same on-disk item as StandardSave wrote.
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for args_type in (ocp.args.StandardSave, ocp.args.StandardRestore, ocp.args.PyTreeRestore):
        registry.add(STATE_ITEM, args_type)
    for args_type in (ocp.args.JsonSave, ocp.args.JsonRestore):
        registry.add(MANIFEST_ITEM, args_type)
    return registry


def _checksums(tree: Any) -> dict[str, str]:
    """SHA-256 of each leaf's bytes (C order, as stored), keyed by its '/'-joined path."""
    return {"/".join(key): _sha256(leaf) for key, leaf in _flat(jax.device_get(tree)).items()}


def _sha256(array: Any) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def _json_round_trip(value: Any, what: str) -> Any:
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} cannot be written as JSON: {e}") from e


def manifest_metadata(config_dict: Mapping[str, Any], task: str,
                      tokenizer_bytes: bytes) -> dict[str, Any]:
    """What a trainer stores in every step's manifest: the model config and task (as
    `config.json` holds them) and the SHA-256 of the tokenizer file."""
    return {"task": task, "model": _json_round_trip(dict(config_dict), "config_dict"),
            "tokenizer_sha256": hashlib.sha256(bytes(tokenizer_bytes)).hexdigest()}


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
                    f"state leaf {_leaf_name(path)} is a {type(leaf).__name__}, not an array"
                ) from e
        if jnp.issubdtype(array.dtype, jax.dtypes.prng_key):
            raise TypeError(
                f"state leaf {_leaf_name(path)} is a typed PRNG key; "
                "store jax.random.key_data(key) instead"
            )
        return array

    stored = jax.tree_util.tree_map_with_path(convert, state)
    if not jax.tree.leaves(stored):
        raise ValueError("the state to save holds no arrays")
    return stored


# Directory metadata ----------------------------------------------------------------------------


def write_metadata(
    directory: str | os.PathLike,
    config_dict: Mapping[str, Any],
    task: str,
    tokenizer_bytes: bytes,
) -> None:
    """Writes `config.json` (`task` and the model config) and `tokenizer.model` into `directory`.

    Creates the directory if needed; each file is replaced atomically. Writing what is already
    there changes nothing, so a resumed run may call this again. Different content is refused
    with `CheckpointError` while the directory holds checkpoint steps: they belong to the
    config and tokenizer already there.
    """
    if not isinstance(task, str) or not task:
        raise ValueError(f"task must be a non-empty string, got {task!r}")
    if not isinstance(tokenizer_bytes, bytes | bytearray | memoryview) or not tokenizer_bytes:
        raise ValueError("tokenizer_bytes must be the non-empty serialized tokenizer model")
    tokenizer_bytes = bytes(tokenizer_bytes)
    try:
        text = json.dumps(
            {"format": METADATA_FORMAT, "task": task, "model": dict(config_dict)},
            indent=2,
            sort_keys=True,
            allow_nan=False,
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"config_dict cannot be written as JSON: {e}") from e
    model = json.loads(text)["model"]  # as it will read back (tuples become lists, ...)

    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"checkpoint directory {path} is not a directory")
    config_path, tokenizer_path = path / CONFIG_FILE, path / TOKENIZER_FILE
    write_config = write_tokenizer = True
    if config_path.exists():
        old_model, old_task = _read_config(config_path)
        write_config = (old_model, old_task) != (model, task)
        if write_config:
            keys = old_model.keys() | model.keys()
            changed = sorted(k for k in keys if old_model.get(k) != model.get(k))
            if old_task != task:
                changed.insert(0, "task")
            _refuse_if_steps(path, config_path, f"config ({changed} differ)")
    if tokenizer_path.exists():
        write_tokenizer = tokenizer_path.read_bytes() != tokenizer_bytes
        if write_tokenizer:
            _refuse_if_steps(path, tokenizer_path, "tokenizer")

    path.mkdir(parents=True, exist_ok=True)
    if write_config:
        write_atomically(config_path, (text + "\n").encode("utf-8"))
    if write_tokenizer:
        write_atomically(tokenizer_path, tokenizer_bytes)


def read_metadata(directory: str | os.PathLike) -> tuple[dict[str, Any], str, bytes]:
    """Returns `(config_dict, task, tokenizer_bytes)` as `write_metadata` stored them."""
    path = _existing_directory(directory)
    config, task = _read_config(path / CONFIG_FILE)
    tokenizer_path = path / TOKENIZER_FILE
    try:
        tokenizer_bytes = tokenizer_path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"tokenizer file {tokenizer_path} does not exist") from None
    if not tokenizer_bytes:
        raise CheckpointError(f"tokenizer file {tokenizer_path} is empty")
    return config, task, tokenizer_bytes


def _read_config(path: Path) -> tuple[dict[str, Any], str]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {path} does not exist") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"config file {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"config file {path} must hold a JSON object, not {data!r:.80}")
    missing = [key for key in ("format", "task", "model") if key not in data]
    if missing:
        raise CheckpointError(f"config file {path} is missing the keys {missing}")
    if data["format"] != METADATA_FORMAT:
        raise CheckpointError(
            f"config file {path} has format {data['format']!r}; this version reads "
            f"format {METADATA_FORMAT}"
        )
    if not isinstance(data["task"], str) or not data["task"]:
        raise CheckpointError(f"config file {path}: 'task' must be a non-empty string")
    if not isinstance(data["model"], dict):
        raise CheckpointError(f"config file {path}: 'model' must be a JSON object")
    return data["model"], data["task"]


def _refuse_if_steps(directory: Path, path: Path, what: str) -> None:
    step = latest_step(directory)
    if step is not None:
        raise CheckpointError(
            f"{path} already holds a different {what}; the checkpoints in {directory} (latest "
            f"step {step}) were saved with it, so it is not replaced. Use a new directory."
        )


def write_atomically(path: str | os.PathLike, data: bytes | str) -> None:
    """Replaces the file at `path` with `data` (str is written as UTF-8) so that a reader or a
    crash sees the old content or the new, never a part: a temporary file in the same
    directory, flushed to disk, then `os.replace`."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp_name, 0o644)  # mkstemp's 0600 would make the file private
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp_name)
        raise
    # Persists the rename itself; not every platform can open a directory.
    with contextlib.suppress(OSError):
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


# Restoring -------------------------------------------------------------------------------------


def latest_step(directory: str | os.PathLike) -> int | None:
    """The newest finalized step in `directory`, or None if it has none or does not exist."""
    path = Path(directory)
    if not path.is_dir():
        return None
    with _reader(path) as manager:
        return manager.latest_step()


def restore_latest(directory: str | os.PathLike, abstract_state: Any) -> tuple[int, Any]:
    """Returns `(step, state)` for the newest step in `directory`.

    `abstract_state` gives the structure, shapes and dtypes wanted (e.g.
    `jax.eval_shape(make_state)`); the result has its structure with `jax.Array` leaves.
    Raises `FileNotFoundError` if the directory is missing and `CheckpointError` if it holds no
    step, if the saved arrays do not match `abstract_state`, if they cannot be read, if one
    differs from its checksum in the step's manifest, or if one holds NaN or infinity.
    """
    path = _existing_directory(directory)
    target = _restore_target(abstract_state)
    with _reader(path) as manager:
        step = _newest_step(manager, path)
        _check_matches(path / str(step), _saved_leaves(manager, path, step), _flat(target))
        manifest = _manifest(manager, path, step)
        state = _restore(manager, path, step, ocp.args.StandardRestore(target))
    _verify(path / str(step), manifest, state)
    return step, state


def restore_params(directory: str | os.PathLike, abstract_params: Any) -> Any:
    """Returns the `params` subtree of the newest step's training state; reads no other array.

    Contract and errors as `restore_latest`, with `abstract_params` describing only the params.
    """
    return _restore_params(_existing_directory(directory), abstract_params)[1]


def _restore_params(path: Path, abstract_params: Any) -> tuple[int, Any]:
    target = {PARAMS_KEY: _restore_target(abstract_params)}
    with _reader(path) as manager:
        step = _newest_step(manager, path)
        saved = {
            key: leaf
            for key, leaf in _saved_leaves(manager, path, step).items()
            if key[:1] == (PARAMS_KEY,)
        }
        _check_matches(path / str(step), saved, _flat(target))
        manifest = _manifest(manager, path, step)
        # partial_restore leaves every array outside `target` (the optimizer state) unread.
        args = ocp.args.PyTreeRestore(
            item=target,
            restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True,
        )
        restored = _restore(manager, path, step, args)
    _verify(path / str(step), manifest, restored)
    return step, restored[PARAMS_KEY]


def read_manifest(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest of the newest step in `directory` (see `Checkpointer`), or None for a step
    saved without one. Raises `CheckpointError` if there is no step or the manifest is damaged."""
    path = _existing_directory(directory)
    with _reader(path) as manager:
        return _manifest(manager, path, _newest_step(manager, path))


def check_metadata(directory: str | os.PathLike) -> None:
    """Raises `CheckpointError` if `config.json` or `tokenizer.model` in `directory` disagree
    with the copy the newest step's manifest holds, naming the config fields that differ.
    A step without a manifest (or one saved without metadata) is not checked."""
    path = _existing_directory(directory)
    manifest = read_manifest(path)
    if manifest is None or "model" not in manifest:
        return
    model, task, tokenizer_bytes = read_metadata(path)
    config_path = path / CONFIG_FILE
    stored_model = manifest["model"]
    if not isinstance(stored_model, dict):
        raise CheckpointError(f"the manifest of {path}'s newest step is damaged ('model')")
    differ = sorted(k for k in model.keys() | stored_model.keys()
                    if model.get(k, _MISSING) != stored_model.get(k, _MISSING))
    if manifest.get("task", task) != task:
        differ.insert(0, "task")
    if differ:
        details = ", ".join(
            f"{k}: {_shown(model.get(k, _MISSING) if k != 'task' else task)} in the file, "
            f"{_shown(stored_model.get(k, _MISSING) if k != 'task' else manifest['task'])} "
            "in the checkpoint" for k in differ)
        raise CheckpointError(
            f"{config_path} disagrees with the config stored in the checkpoint ({details}); "
            "the params were trained with the stored one")
    wanted_hash = manifest.get("tokenizer_sha256")
    if wanted_hash is not None and hashlib.sha256(tokenizer_bytes).hexdigest() != wanted_hash:
        raise CheckpointError(
            f"{path / TOKENIZER_FILE} is not the tokenizer the checkpoint was trained with "
            "(its SHA-256 differs from the one stored in the checkpoint)")


_MISSING = object()


def _shown(value: Any) -> str:
    return "missing" if value is _MISSING else json.dumps(value)


def load_for_sampling(directory: str | os.PathLike, mesh: Any = None, *,
                      scan_layers: bool | None = None) -> tuple[Any, Any, Any]:
    """Returns `(TransformerConfig, Tokenizer, params)` from the newest step in `directory`.

    `config.json` and the tokenizer are checked against the step's manifest and the params
    against the shapes `model.init_params` gives for the config, their checksums and NaN.
    With a `mesh` (`kvjax.parallel.make_mesh`) the params are read straight into its layout
    (`parallel.state_shardings`), whatever mesh saved them; without one, onto one device.

    The layers come back held as `scan_layers` says (None: `TransformerConfig`'s default,
    unrolled), whichever way the checkpoint stores them (its `config.json` says which); the
    returned config says how they are held (`model.with_layer_layout` converts).
    """
    # Imported here so that saving and restoring training state does not depend on them.
    from kvjax.model import TransformerConfig, init_params, with_layer_layout
    from kvjax.tokenizer import Tokenizer

    path = _existing_directory(directory)
    config_dict, _task, tokenizer_bytes = read_metadata(path)
    check_metadata(path)
    try:
        config = TransformerConfig.from_dict(config_dict)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"config file {path / CONFIG_FILE}: invalid model config: {e}") from e
    try:
        tokenizer = Tokenizer.from_bytes(tokenizer_bytes)
    except ValueError as e:
        raise CheckpointError(f"tokenizer file {path / TOKENIZER_FILE}: {e}") from e
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} pieces but the model's "
            f"vocab_size is {config.vocab_size}"
        )
    abstract_params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    if mesh is not None:
        from kvjax import parallel

        parallel.check_model_axis(config, mesh)
        abstract_params = parallel.abstract_on(abstract_params, mesh)
    params = _restore_params(path, abstract_params)[1]
    if scan_layers is None:
        scan_layers = TransformerConfig.scan_layers
    if scan_layers != config.scan_layers:
        config, params = with_layer_layout(config, params, scan_layers)
        if mesh is not None:
            params = parallel.shard_params(params, mesh)
    return config, tokenizer, params


def _manifest(manager: ocp.CheckpointManager, path: Path, step: int) -> dict[str, Any] | None:
    step_path = path / str(step)
    if not (step_path / MANIFEST_ITEM).is_dir():
        return None  # saved before manifests existed
    try:
        restored = manager.restore(
            step, args=ocp.args.Composite(**{MANIFEST_ITEM: ocp.args.JsonRestore()}))
        manifest = restored[MANIFEST_ITEM]
    except Exception as e:
        raise CheckpointError(
            f"cannot read checkpoint {step_path} (its manifest): {_describe(e)}") from e
    if (not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT
            or not isinstance(manifest.get("sha256"), dict)):
        raise CheckpointError(f"checkpoint {step_path} has a damaged or unknown manifest")
    return manifest


def _verify(step_path: Path, manifest: dict[str, Any] | None, restored: Any) -> None:
    """Checksums (where the step has a manifest) and finiteness of every restored array."""
    leaves = _flat(jax.device_get(restored))
    if manifest is not None:
        for key, leaf in leaves.items():
            name, actual = "/".join(key), _sha256(leaf)
            expected = manifest["sha256"].get(name)
            if expected is None:
                raise CheckpointError(
                    f"checkpoint {step_path}: {name} has no checksum in the manifest")
            if actual != expected:
                raise CheckpointError(
                    f"checkpoint {step_path} is corrupted: the data of {name} does not match "
                    "the checksum saved with it")
    for key, leaf in leaves.items():
        array = np.asarray(leaf)
        if jnp.issubdtype(array.dtype, jnp.inexact):  # bfloat16 included
            if not np.isfinite(array.astype(np.float32)).all():
                raise CheckpointError(
                    f"checkpoint {step_path}: {'/'.join(key)} holds NaN or infinite values; "
                    "it is not loaded")


@contextlib.contextmanager
def _reader(path: Path) -> Iterator[ocp.CheckpointManager]:
    # read_only also turns off create, cleanup of temporary directories and deletion; the other
    # values are the ones read_only would otherwise force, with a warning each.
    options = ocp.CheckpointManagerOptions(
        read_only=True,
        create=False,
        save_interval_steps=0,
        enable_async_checkpointing=False,
        lightweight_initialize=True,
    )
    manager = ocp.CheckpointManager(path.absolute(), options=options,
                                    handler_registry=_handler_registry())
    try:
        yield manager
    finally:
        manager.close()


def _existing_directory(directory: str | os.PathLike) -> Path:
    path = Path(directory)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"checkpoint directory {path} is not a directory")
    return path


def _newest_step(manager: ocp.CheckpointManager, path: Path) -> int:
    step = manager.latest_step()
    if step is None:
        raise CheckpointError(f"no checkpoint found in {path}: it holds no finalized step")
    return step


def _restore_target(abstract: Any) -> Any:
    # Without a sharding orbax would use the saved one, which names the saving machine's device.
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def convert(path: tuple, leaf: Any) -> jax.ShapeDtypeStruct:
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape is None or dtype is None:
            raise TypeError(
                f"abstract leaf {_leaf_name(path)} is a {type(leaf).__name__}; expected a "
                "jax.ShapeDtypeStruct (e.g. from jax.eval_shape)"
            )
        if jnp.issubdtype(dtype, jax.dtypes.prng_key):
            raise TypeError(f"abstract leaf {_leaf_name(path)} is a typed PRNG key; use key data")
        sharding = getattr(leaf, "sharding", None) or device
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    target = jax.tree_util.tree_map_with_path(convert, abstract)
    if not jax.tree.leaves(target):
        raise ValueError("the abstract target holds no arrays")
    return target


def _saved_leaves(manager: ocp.CheckpointManager, path: Path, step: int) -> dict[tuple, Any]:
    step_path = path / str(step)
    try:
        item = manager.metadata(step).item_metadata[STATE_ITEM]
    except Exception as e:
        raise CheckpointError(
            f"cannot read checkpoint {step_path} (its metadata): {_describe(e)}"
        ) from e
    if item is None:
        raise CheckpointError(f"checkpoint {step_path} holds no '{STATE_ITEM}' item")
    return ocp.tree.to_flat_dict(item.tree)


def _flat(tree: Any) -> dict[tuple, Any]:
    # Keys as orbax flattens its metadata: the tuple of str(key name) along the path.
    return {
        tuple(str(_key_name(k)) for k in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _check_matches(step_path: Path, saved: dict[tuple, Any], wanted: dict[tuple, Any]) -> None:
    problems = []
    for key, want in wanted.items():
        have = saved.get(key)
        if have is None:
            problems.append(f"{'/'.join(key)} is missing (wanted {_spec(want)})")
        elif (_shape(have), _dtype(have)) != (_shape(want), _dtype(want)):
            problems.append(f"{'/'.join(key)} is {_spec(have)}, wanted {_spec(want)}")
    problems += [f"{'/'.join(key)} is saved but not wanted" for key in saved if key not in wanted]
    if problems:
        listed = "; ".join(problems[:_MAX_LISTED_MISMATCHES])
        more = len(problems) - _MAX_LISTED_MISMATCHES
        raise CheckpointError(
            f"checkpoint {step_path} does not match the requested state (was it saved with "
            f"another config?): {listed}" + (f"; and {more} more" if more > 0 else "")
        )


def _restore(manager: ocp.CheckpointManager, path: Path, step: int, args: Any) -> Any:
    try:
        restored = manager.restore(step, args=ocp.args.Composite(**{STATE_ITEM: args}))
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint {path / str(step)}: {_describe(e)}") from e
    return restored[STATE_ITEM]


def _shape(leaf: Any) -> tuple[int, ...] | None:
    shape = getattr(leaf, "shape", None)
    return None if shape is None else tuple(shape)


def _dtype(leaf: Any) -> np.dtype | None:
    dtype = getattr(leaf, "dtype", None)
    return None if dtype is None else np.dtype(dtype)


def _spec(leaf: Any) -> str:
    return f"shape {_shape(leaf)} {_dtype(leaf)}"


def _key_name(key: Any) -> Any:
    if isinstance(key, jax.tree_util.DictKey):
        return key.key
    if isinstance(key, jax.tree_util.SequenceKey):
        return key.idx
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return key.key
    return key


def _leaf_name(path: tuple) -> str:
    return "/".join(str(_key_name(k)) for k in path) or "<root>"


def _describe(error: BaseException) -> str:
    # The innermost cause is the specific one (e.g. tensorstore's "byte range ... not valid for
    # value of size ..."); its first line is enough, as the message may embed a whole JSON spec.
    seen = {id(error)}
    while error.__cause__ is not None and id(error.__cause__) not in seen:
        error = error.__cause__
        seen.add(id(error))
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    if len(first) > 400:
        first = first[:400] + "..."
    return f"{type(error).__name__}: {first}"
