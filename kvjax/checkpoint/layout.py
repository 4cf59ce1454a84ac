"""What a checkpoint directory holds on disk, and the pieces every reader and writer shares.

File and orbax item names, `CheckpointError`, the orbax handler registry, a read-only orbax
manager, and the names of pytree leaves as orbax flattens them (`"params/embed/embedding"`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.model"
METADATA_FORMAT = 1
STATE_ITEM = "state"  # orbax item name of the training state inside each step directory
MANIFEST_ITEM = "manifest"  # orbax item name of the step's checksums and metadata copy
MANIFEST_FORMAT = 1
PARAMS_KEY = "params"  # the subtree of the training state that `restore_params` reads


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be written or read as asked; the message names it."""


class UnverifiedCheckpointWarning(UserWarning):
    """A step restored without a manifest: its arrays could not be checked against checksums."""


class _QuietReadOnlyNotice(logging.Filter):
    """Readers open orbax read-only on purpose; its warning that they did is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Given directory is read only")


logging.getLogger("absl").addFilter(_QuietReadOnlyNotice())


def handler_registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    # Registered up front so that metadata can be read before anything is restored, and so that
    # the params-only restore (PyTreeRestore) reads the same on-disk item as StandardSave wrote.
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for args_type in (ocp.args.StandardSave, ocp.args.StandardRestore, ocp.args.PyTreeRestore):
        registry.add(STATE_ITEM, args_type)
    for args_type in (ocp.args.JsonSave, ocp.args.JsonRestore):
        registry.add(MANIFEST_ITEM, args_type)
    return registry


@contextlib.contextmanager
def reader(path: Path) -> Iterator[ocp.CheckpointManager]:
    """An orbax manager on `path` that never creates, rewrites or deletes anything."""
    # read_only also turns off create, cleanup of temporary directories and deletion; the other
    # values are the ones read_only would otherwise force, with a warning each.
    # Of a job of several processes, a reader is this process's alone: orbax's barriers
    # would otherwise wait for every process to read the same directory at the same time.
    own = jax.process_index()
    options = ocp.CheckpointManagerOptions(
        read_only=True,
        create=False,
        save_interval_steps=0,
        enable_async_checkpointing=False,
        lightweight_initialize=True,
        multiprocessing_options=ocp.options.MultiprocessingOptions(
            primary_host=own, active_processes={own}),
    )
    manager = ocp.CheckpointManager(path.absolute(), options=options,
                                    handler_registry=handler_registry())
    try:
        yield manager
    finally:
        manager.close()


def existing_directory(directory: str | os.PathLike) -> Path:
    path = Path(directory)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"checkpoint directory {path} is not a directory")
    return path


def sha256(array: Any) -> str:
    """SHA-256 of an array's bytes in C order, as they are stored."""
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def flat(tree: Any) -> dict[tuple, Any]:
    """The leaves of `tree` keyed as orbax flattens its metadata: the tuple of str(key name)
    along the path."""
    return {
        tuple(str(_key_name(k)) for k in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def leaf_name(path: tuple) -> str:
    """A pytree path as it appears in messages, e.g. `params/embed/embedding`."""
    return "/".join(str(_key_name(k)) for k in path) or "<root>"


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


def describe(error: BaseException) -> str:
    """One line naming the innermost cause of an orbax or tensorstore failure."""
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
