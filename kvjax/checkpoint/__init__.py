"""Training checkpoints: atomic asynchronous saves with orbax, restores that check their target.

A checkpoint directory holds the training state at a few steps plus what is needed to use it::

    <directory>/
        config.json                  {"format": 1, "task": "lm", "model": {...TransformerConfig...}}
        tokenizer.model              the serialized sentencepiece model
        <step>/state/...             the training state at <step> (orbax StandardSave)
        <step>/manifest/...          SHA-256 of every array of that state, the model config and
                                     the tokenizer's hash (orbax JsonSave; steps saved before
                                     manifests existed lack it until `write_manifest`)
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
A checkpoint whose newest step was saved before manifests existed still loads, with the
finiteness check only and an `UnverifiedCheckpointWarning` (one line naming the directory and
the step) saying that its data cannot be verified. `write_manifest` gives such a step, once it
is known to be good, the manifest a save writes now; the shipped checkpoints under
`checkpoints/` got theirs that way.

Restores always take an abstract target (a pytree of `jax.ShapeDtypeStruct`, e.g. from
`jax.eval_shape`) and compare it leaf by leaf with the checkpoint's metadata before reading any
array, so a checkpoint of another model is reported as such instead of being silently cast,
padded or truncated. Readers open orbax read-only: loading never creates, rewrites or deletes
anything. Every failure names the path it concerns; orbax or tensorstore errors are wrapped in
`CheckpointError` with the original exception chained.

In a job of several processes (`kvjax.distributed`) every process saves and restores each
step together: each writes the shards on its own devices (`state/ocdbt.process_<i>`), process
0 writes the rest (metadata, the manifest, whose checksums are of the whole arrays, gathered)
and renames the step into place once every process's shards are written. Finding and
checking steps is each process's own business.

One file per part: `save.py` (`Checkpointer`, `write_manifest`), `restore.py` (the newest
step, checked), `metadata.py` (`config.json` and `tokenizer.model`), `load.py` (config,
tokenizer and params for sampling), `layout.py` (the names on disk and what the others share).
"""

from .layout import (
    CONFIG_FILE,
    MANIFEST_ITEM,
    PARAMS_KEY,
    STATE_ITEM,
    TOKENIZER_FILE,
    CheckpointError,
    UnverifiedCheckpointWarning,
)
from .load import load_adapters, load_for_sampling, read_adapters
from .metadata import (
    check_metadata,
    read_lora,
    read_metadata,
    write_atomically,
    write_metadata,
)
from .restore import (
    abstract_saved_state,
    latest_step,
    params_digest,
    params_digest_of,
    read_manifest,
    restore_latest,
    restore_params,
)
from .save import Checkpointer, manifest_metadata, write_manifest, write_model

__all__ = [
    "CONFIG_FILE",
    "MANIFEST_ITEM",
    "PARAMS_KEY",
    "STATE_ITEM",
    "TOKENIZER_FILE",
    "CheckpointError",
    "Checkpointer",
    "UnverifiedCheckpointWarning",
    "abstract_saved_state",
    "check_metadata",
    "latest_step",
    "load_adapters",
    "load_for_sampling",
    "params_digest",
    "params_digest_of",
    "read_adapters",
    "read_lora",
    "write_model",
    "manifest_metadata",
    "read_manifest",
    "read_metadata",
    "restore_latest",
    "restore_params",
    "write_atomically",
    "write_manifest",
    "write_metadata",
]
