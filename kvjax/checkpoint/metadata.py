"""The files beside the steps: `config.json` and `tokenizer.model`, written atomically and
checked against the copy each step's manifest holds."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .layout import (
    CONFIG_FILE,
    METADATA_FORMAT,
    TOKENIZER_FILE,
    CheckpointError,
    existing_directory,
)
from .restore import latest_step, read_manifest

_MISSING = object()  # a config field that one side does not have


def write_metadata(
    directory: str | os.PathLike,
    config_dict: Mapping[str, Any],
    task: str,
    tokenizer_bytes: bytes,
    lora: Mapping[str, Any] | None = None,
) -> None:
    """Writes `config.json` (`task` and the model config) and `tokenizer.model` into `directory`.
    For a run that trains LoRA adapters on a base checkpoint, `lora` (the adapters' settings
    and their base, see `kvjax.train.lora`) goes into `config.json` too.

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
    contents = {"format": METADATA_FORMAT, "task": task, "model": dict(config_dict)}
    if lora is not None:
        contents["lora"] = dict(lora)
    try:
        text = json.dumps(
            contents,
            indent=2,
            sort_keys=True,
            allow_nan=False,
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"config_dict cannot be written as JSON: {e}") from e
    written = json.loads(text)  # as it will read back (tuples become lists, ...)
    model = written["model"]

    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"checkpoint directory {path} is not a directory")
    config_path, tokenizer_path = path / CONFIG_FILE, path / TOKENIZER_FILE
    write_config = write_tokenizer = True
    if config_path.exists():
        old_model, old_task, old_lora = _read_config(config_path)
        write_config = (old_model, old_task, old_lora) != (model, task, written.get("lora"))
        if write_config:
            keys = old_model.keys() | model.keys()
            changed = sorted(k for k in keys if old_model.get(k) != model.get(k))
            if old_task != task:
                changed.insert(0, "task")
            if old_lora != written.get("lora"):
                changed.insert(0, "lora")
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
    path = existing_directory(directory)
    config, task, _ = _read_config(path / CONFIG_FILE)
    tokenizer_path = path / TOKENIZER_FILE
    try:
        tokenizer_bytes = tokenizer_path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"tokenizer file {tokenizer_path} does not exist") from None
    if not tokenizer_bytes:
        raise CheckpointError(f"tokenizer file {tokenizer_path} is empty")
    return config, task, tokenizer_bytes


def read_lora(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The LoRA record `config.json` holds (`write_metadata`), or None for a checkpoint of a
    whole model."""
    return _read_config(Path(directory) / CONFIG_FILE)[2]


def _read_config(path: Path) -> tuple[dict[str, Any], str, dict[str, Any] | None]:
    """(model config, task, LoRA record or None) of a config.json, each checked."""
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
    lora = data.get("lora")
    if lora is not None and not isinstance(lora, dict):
        raise CheckpointError(f"config file {path}: 'lora' must be a JSON object")
    return data["model"], data["task"], lora


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


def check_metadata(directory: str | os.PathLike) -> None:
    """Raises `CheckpointError` if `config.json` or `tokenizer.model` in `directory` disagree
    with the copy the newest step's manifest holds, naming the config fields that differ.
    A step without a manifest (or one saved without metadata) is not checked."""
    path = existing_directory(directory)
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
    if manifest.get("lora") != read_lora(path):
        raise CheckpointError(
            f"{config_path} disagrees with the LoRA settings stored in the checkpoint "
            f"({_shown(read_lora(path))} in the file, {_shown(manifest.get('lora'))} in the "
            "checkpoint); the adapters were trained with the stored ones")
    wanted_hash = manifest.get("tokenizer_sha256")
    if wanted_hash is not None and hashlib.sha256(tokenizer_bytes).hexdigest() != wanted_hash:
        raise CheckpointError(
            f"{path / TOKENIZER_FILE} is not the tokenizer the checkpoint was trained with "
            "(its SHA-256 differs from the one stored in the checkpoint)")


def _shown(value: Any) -> str:
    return "missing" if value is _MISSING else json.dumps(value)
