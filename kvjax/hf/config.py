"""A Hugging Face `config.json` as a `TransformerConfig`, refusing what kvjax does not run.

`reader.py` accounts for every key of the file, so none is silently ignored; `families.py`
(with `llama_like.py`, `ministral3.py`, `output_norms.py`, `plain_ffn.py` and `cohere.py`)
reads each supported model type's keys. A vision-language directory's language model is
read from its `text_config` (`text_of_multimodal.py`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvjax.model import TransformerConfig

from .errors import UnsupportedModelError
from .families import READERS
from .reader import Reader, read_json_object

SUPPORTED_MODEL_TYPES = tuple(sorted(READERS))


def read_hf_config(directory: str | os.PathLike) -> dict[str, Any]:
    """The parsed `config.json` of a Hugging Face model directory."""
    if not Path(directory).is_dir():
        raise FileNotFoundError(f"{directory} is not a directory")
    return read_json_object(Path(directory) / "config.json",
                            f"{directory} has no config.json: not a Hugging Face model "
                            "directory")


def to_kvjax_config(hf: dict[str, Any], *, tied: bool, dtype: str = "float32",
                    source: str = "config.json", max_len: int | None = None
                    ) -> TransformerConfig:
    """The `TransformerConfig` of the model `hf` (a parsed config.json) describes.

    `tied` says whether the output layer is the embedding table (the weight files hold no
    separate `lm_head.weight`). `max_len`, for a RoPE model, is the longest sequence it will
    run, up to its max_position_embeddings (None: that, or a LongRoPE model's original length);
    for an ALiBi or T5 model, any length (None: the one it was trained on). Raises
    `UnsupportedModelError` naming what is not supported.
    """
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"{source}: model_type {model_type!r} is not supported; "
                                    f"kvjax loads {', '.join(SUPPORTED_MODEL_TYPES)}")
    reader = Reader(hf, source)
    fields = READERS[model_type](reader)
    reader.refuse_unread()
    if max_len is not None:
        fields["max_len"] = _chosen_max_len(hf, fields, max_len, source)
    try:
        return TransformerConfig(**fields, tie_embeddings=tied, dtype=dtype, param_dtype=dtype,
                                 dropout=0.0)
    except ValueError as e:
        raise UnsupportedModelError(f"{source}: {e}") from None


def _chosen_max_len(hf: dict[str, Any], fields: dict[str, Any], max_len, source: str) -> int:
    if (fields.get("positional_encoding") in ("alibi", "relative")  # no table of positions
            or fields.get("sinusoid_layout") == "fairseq"):  # sinusoids of any position
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise UnsupportedModelError(f"{source}: max_len={max_len!r} must be an int >= 1")
        return max_len
    longest = hf.get("max_position_embeddings")
    if fields.get("positional_encoding") != "rope" or not longest:
        raise UnsupportedModelError(f"{source}: max_len is chosen only for a RoPE model with a "
                                    f"max_position_embeddings; {hf.get('model_type')!r} runs "
                                    f"the length of its positions ({fields['max_len']})")
    if isinstance(max_len, bool) or not isinstance(max_len, int) or not 1 <= max_len <= longest:
        raise UnsupportedModelError(f"{source}: max_len={max_len!r} must be an int from 1 to "
                                    f"max_position_embeddings={longest}")
    return max_len
