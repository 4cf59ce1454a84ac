"""A Hugging Face directory written as a kvjax checkpoint (`kvjax import-hf DIR OUT`).

The checkpoint is what `kvjax train` writes, so everything that reads one reads it:
`config.json` (the task and the model config), `tokenizer.model` (the tokenizer's files
bundled, see `kvjax.tokenizer.tokenizer_from_bytes`) and step 0 holding the params with an
integrity manifest of their checksums.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvjax import checkpoint
from kvjax import model as M

from . import load_pretrained


def import_checkpoint(hf_directory: str | os.PathLike, out: str | os.PathLike, *,
                      dtype: str | None = None, max_len: int | None = None,
                      lora: str | os.PathLike | None = None,
                      kernel_dtype: str | None = None) -> Path:
    """Reads the model in `hf_directory` (`load_pretrained`) and saves it into `out` as a
    kvjax checkpoint at step 0; returns `out`. `out` must not hold checkpoint steps yet.
    `max_len`, `lora` and `kernel_dtype` are `load_pretrained`'s: a RoPE model's longest
    sequence, a PEFT LoRA adapter written merged into the params, and "int8" to write the
    kernels and the embedding table as int8 with their scales (a quarter of float32's bytes,
    read back as they are: nothing quantizes them again).

    The task recorded is "translate" for an encoder-decoder, else "lm", as `kvjax train`
    records it; nothing is written when reading the model fails.
    """
    out = Path(out)
    if out.is_dir() and checkpoint.latest_step(out) is not None:  # before reading the model
        raise checkpoint.CheckpointError(f"{out} already holds checkpoint steps; import into a "
                                         "new directory")
    config, tokenizer, params = load_pretrained(hf_directory, dtype=dtype, max_len=max_len,
                                                lora=lora, kernel_dtype=kernel_dtype)
    task = "translate" if M.prompt_is_source(config) else "lm"
    return checkpoint.write_model(out, config.to_dict(), task, tokenizer.to_bytes(), params)
