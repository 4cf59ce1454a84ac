"""Restoring: the newest step of a directory, checked against its target, checksums and NaN.

Every restore takes an abstract target (a pytree of `jax.ShapeDtypeStruct`, e.g. from
`jax.eval_shape`) and compares it leaf by leaf with the checkpoint's metadata before reading
any array, then checks each array against its step's manifest and for NaN and infinity. A step
without a manifest is restored with a warning that its data could not be verified.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
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
    leaf_name,
    reader,
    sha256,
)

_MAX_LISTED_MISMATCHES = 5


def latest_step(directory: str | os.PathLike) -> int | None:
    """The newest finalized step in `directory`, or None if it has none or does not exist."""
    path = Path(directory)
    if not path.is_dir():
        return None
    with reader(path) as manager:
        return manager.latest_step()


def restore_latest(directory: str | os.PathLike, abstract_state: Any) -> tuple[int, Any]:
    """Returns `(step, state)` for the newest step in `directory`.

    `abstract_state` gives the structure, shapes and dtypes wanted (e.g.
    `jax.eval_shape(make_state)`); the result has its structure with `jax.Array` leaves.
    Raises `FileNotFoundError` if the directory is missing and `CheckpointError` if it holds no
    step, if the saved arrays do not match `abstract_state`, if they cannot be read, if one
    differs from its checksum in the step's manifest, or if one holds NaN or infinity. A step
    saved without a manifest loads with an `UnverifiedCheckpointWarning` naming it.
    """
    path = existing_directory(directory)
    target = _restore_target(abstract_state)
    with reader(path) as manager:
        step = _newest_step(manager, path)
        _check_matches(path / str(step), _saved_leaves(manager, path, step), flat(target))
        manifest = _manifest(manager, path, step)
        state = _restore(manager, path, step, ocp.args.StandardRestore(target))
    _verify(path / str(step), manifest, state)
    if manifest is None:
        _warn_unverified(path, step)
    return step, state


def restore_params(directory: str | os.PathLike, abstract_params: Any) -> Any:
    """Returns the `params` subtree of the newest step's training state; reads no other array.

    Contract and errors as `restore_latest`, with `abstract_params` describing only the params.
    """
    path = existing_directory(directory)
    target = {PARAMS_KEY: _restore_target(abstract_params)}
    with reader(path) as manager:
        step = _newest_step(manager, path)
        saved = {
            key: leaf
            for key, leaf in _saved_leaves(manager, path, step).items()
            if key[:1] == (PARAMS_KEY,)
        }
        _check_matches(path / str(step), saved, flat(target))
        manifest = _manifest(manager, path, step)
        # partial_restore leaves every array outside `target` (the optimizer state) unread.
        args = ocp.args.PyTreeRestore(
            item=target,
            restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True,
        )
        restored = _restore(manager, path, step, args)
    _verify(path / str(step), manifest, restored)
    if manifest is None:
        _warn_unverified(path, step)
    return restored[PARAMS_KEY]


def abstract_saved_state(directory: str | os.PathLike) -> Any:
    """The newest step's state as saved, as a pytree of `jax.ShapeDtypeStruct`: a target for
    `restore_latest` that needs no model or optimizer to build. Containers come back as orbax
    stores them (dicts and lists), under the same names the step's manifest uses."""
    path = existing_directory(directory)
    with reader(path) as manager:
        tree = _saved_tree(manager, path, _newest_step(manager, path))
    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype), tree)


def read_manifest(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest of the newest step in `directory` (see `Checkpointer`), or None for a step
    saved without one. Raises `CheckpointError` if there is no step or the manifest is damaged."""
    path = existing_directory(directory)
    with reader(path) as manager:
        return _manifest(manager, path, _newest_step(manager, path))


def params_digest(directory: str | os.PathLike) -> str | None:
    """One SHA-256 over the checksums of the params of the newest step in `directory`, as its
    manifest holds them (None without a manifest): what LoRA adapters record of the base they
    were trained on, whichever layer layout it is loaded in."""
    manifest = read_manifest(directory)
    if manifest is None:
        return None
    return _digest(manifest["sha256"])


def params_digest_of(params: Any) -> str:
    """`params_digest` of a checkpoint that would hold `params` (unrolled layers, as every
    checkpoint kvjax writes of a whole model holds them): whether params in memory are the
    ones adapters were trained on."""
    return _digest({"/".join((PARAMS_KEY, *key)): sha256(leaf)
                    for key, leaf in flat(host_arrays(params)).items()})


def _digest(checksums: dict[str, str]) -> str:
    entries = sorted(f"{key} {value}" for key, value in checksums.items()
                     if key.startswith(f"{PARAMS_KEY}/"))
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()


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
            f"cannot read checkpoint {step_path} (its manifest): {describe(e)}") from e
    if (not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT
            or not isinstance(manifest.get("sha256"), dict)):
        raise CheckpointError(f"checkpoint {step_path} has a damaged or unknown manifest")
    return manifest


def _warn_unverified(path: Path, step: int) -> None:
    # stacklevel 3: the line that called restore_latest or restore_params.
    warnings.warn(
        f"checkpoint {path} step {step} has no manifest, so its data cannot be verified "
        "against checksums (only checked for NaN and infinity)",
        UnverifiedCheckpointWarning, stacklevel=3)


def _verify(step_path: Path, manifest: dict[str, Any] | None, restored: Any) -> None:
    """Checksums (where the step has a manifest) and finiteness of every restored array."""
    leaves = flat(host_arrays(restored))  # with several processes, every one must call
    if manifest is not None:
        for key, leaf in leaves.items():
            name, actual = "/".join(key), sha256(leaf)
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
                f"abstract leaf {leaf_name(path)} is a {type(leaf).__name__}; expected a "
                "jax.ShapeDtypeStruct (e.g. from jax.eval_shape)"
            )
        if jnp.issubdtype(dtype, jax.dtypes.prng_key):
            raise TypeError(f"abstract leaf {leaf_name(path)} is a typed PRNG key; use key data")
        sharding = getattr(leaf, "sharding", None) or device
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    target = jax.tree_util.tree_map_with_path(convert, abstract)
    if not jax.tree.leaves(target):
        raise ValueError("the abstract target holds no arrays")
    return target


def _saved_leaves(manager: ocp.CheckpointManager, path: Path, step: int) -> dict[tuple, Any]:
    return ocp.tree.to_flat_dict(_saved_tree(manager, path, step))


def _saved_tree(manager: ocp.CheckpointManager, path: Path, step: int) -> Any:
    step_path = path / str(step)
    try:
        item = manager.metadata(step).item_metadata[STATE_ITEM]
    except Exception as e:
        raise CheckpointError(
            f"cannot read checkpoint {step_path} (its metadata): {describe(e)}"
        ) from e
    if item is None:
        raise CheckpointError(f"checkpoint {step_path} holds no '{STATE_ITEM}' item")
    return item.tree


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
        raise CheckpointError(f"cannot read checkpoint {path / str(step)}: {describe(e)}") from e
    return restored[STATE_ITEM]


def _shape(leaf: Any) -> tuple[int, ...] | None:
    shape = getattr(leaf, "shape", None)
    return None if shape is None else tuple(shape)


def _dtype(leaf: Any) -> np.dtype | None:
    dtype = getattr(leaf, "dtype", None)
    return None if dtype is None else np.dtype(dtype)


def _spec(leaf: Any) -> str:
    return f"shape {_shape(leaf)} {_dtype(leaf)}"
