"""The text model of a vision-language release: Gemma 3 (4B, 12B, 27B: `gemma3`) and
Ministral 3 (`mistral3`) ship their language model beside a vision encoder, in one directory
whose `config.json` holds the language model's config as `text_config`. kvjax runs the
language model alone, on text: its config is `text_config`, its tensors those of the
directory under the language model's names (transformers writes them as
`language_model.model.*` and `language_model.lm_head.*`, or `model.language_model.*` and
`lm_head.*`), read as the text model's own `model.*` and `lm_head.*`; the vision encoder's
and projector's tensors are left unread, as are the config's keys about images."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .errors import UnsupportedModelError
from .tensors import WeightFiles

# Each wrapper's model type -> its text model's, the one `text_config` must name.
TEXT_MODELS = {"gemma3": "gemma3_text", "mistral3": "ministral3"}
# What transformers' config class of each text model (5.25) takes where `text_config` is
# silent: releases written by older versions hold only the keys that differ from these
# (Gemma 3 4B's gives its width, depth, FFN width, RoPE scaling and window alone). RoPE's
# defaults apply only where the file names no RoPE setting at all.
TEXT_DEFAULTS = {
    "gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216,
                        num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                        head_dim=256, max_position_embeddings=131072,
                        query_pre_attn_scalar=256, rms_norm_eps=1e-6,
                        hidden_activation="gelu_pytorch_tanh", sliding_window=4096,
                        bos_token_id=2, eos_token_id=1, pad_token_id=0),
    "ministral3": dict(vocab_size=131072, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=34, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, max_position_embeddings=262144, rms_norm_eps=1e-5,
                       hidden_act="silu", sliding_window=None, bos_token_id=1, eos_token_id=2,
                       pad_token_id=11),
}
ROPE_DEFAULTS = {
    "ministral3": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                   "original_max_position_embeddings": 16384, "beta_fast": 32.0,
                   "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                   "llama_4_scaling_beta": 0.1},
}
ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta")
# The prefixes of the language model's tensors, either way transformers writes them, and the
# names the text model's own files give them.
_RENAMES = (("language_model.model.", "model."), ("model.language_model.", "model."),
            ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))


def is_text_of_multimodal(hf: dict[str, Any]) -> bool:
    return hf.get("model_type") in TEXT_MODELS


def text_config(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The language model's config of a wrapper's `hf`, its silent keys at transformers'
    defaults (`TEXT_DEFAULTS`), refusing one that names another text model than the
    wrapper's."""
    wrapper, text = hf["model_type"], hf.get("text_config")
    if not isinstance(text, dict):
        raise UnsupportedModelError(f"{source}: a {wrapper} directory needs a text_config, the "
                                    "config of its language model")
    expected = TEXT_MODELS[wrapper]
    if text.get("model_type", expected) != expected:
        raise UnsupportedModelError(f"{source}: the text_config of a {wrapper} model is "
                                    f"{expected}'s, not {text.get('model_type')!r}")
    config = {**TEXT_DEFAULTS[expected], **text, "model_type": expected}
    if expected in ROPE_DEFAULTS and not any(key in text for key in ROPE_KEYS):
        config["rope_parameters"] = ROPE_DEFAULTS[expected]
    return config


class TextModelFiles:
    """A wrapper's tensors as its language model's own files would name them: reads
    `WeightFiles` under the language model's names, and lists nothing else."""

    def __init__(self, files: WeightFiles):
        self.files, self.directory = files, files.directory
        self._source_of: dict[str, str] = {}
        for name in files.names():
            for prefix, renamed in _RENAMES:
                if name.startswith(prefix):
                    self._source_of.setdefault(renamed + name[len(prefix):], name)
                    break
        if not self._source_of:
            raise ValueError(f"{Path(self.directory)}: no tensor of a language model "
                             "(language_model.* or model.language_model.*)")

    def names(self) -> set[str]:
        return set(self._source_of)

    def __contains__(self, name: str) -> bool:
        return name in self._source_of

    def read(self, name: str) -> np.ndarray:
        if name not in self._source_of:
            raise ValueError(f"{self.directory}: tensor {name} of the language model is missing")
        return self.files.read(self._source_of[name])
