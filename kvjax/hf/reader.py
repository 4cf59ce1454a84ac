"""A Hugging Face `config.json` read key by key, every key accounted for.

Every key of the file is either read, known to change nothing in inference (training-time
dropout, labels, caching switches, bookkeeping), checked to hold the one value kvjax
implements, or refused: a key no reader asked for, with a value that is not empty, false or
null, is an error naming it. A loader that silently ignores, say, `rope_scaling` gives a
model that runs and writes worse text; this one stops and says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import UnsupportedModelError

# Keys that change nothing in inference: dropout (kvjax imports models for inference and
# fine-tunes them without dropout), initialisation, heads for other tasks, caching and
# output switches, token ids the tokenizer and generation_config.json own, bookkeeping.
INFERENCE_NEUTRAL = frozenset({
    "_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype",
    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "id2label",
    "label2id", "problem_type", "chunk_size_feed_forward", "is_decoder", "add_cross_attention",
    "initializer_range", "init_std", "bos_token_id", "eos_token_id", "pad_token_id",
    "sep_token_id", "forced_eos_token_id", "forced_bos_token_id", "tokenizer_class",
    "task_specific_params", "prefix", "finetuning_task", "use_bfloat16", "torchscript",
    "pruned_heads", "tf_legacy_loss", "tie_encoder_decoder", "max_length", "min_length",
    "num_beams", "bad_words_ids", "do_sample", "early_stopping", "length_penalty",
    "no_repeat_ngram_size", "num_return_sequences", "temperature", "top_k", "top_p",
    "repetition_penalty", "transformers.js_config", "is_llama_config", "model_type",
    "tie_word_embeddings",  # tied or not follows the weight files (lm_head present or not)
    "attn_pdrop", "embd_pdrop", "embed_dropout", "resid_pdrop", "attention_dropout", "dropout",
    "hidden_dropout",
    "activation_dropout", "classifier_dropout", "classif_dropout", "summary_activation",
    "summary_first_dropout", "summary_proj_to_labels", "summary_type", "summary_use_proj",
    "encoder_layerdrop", "decoder_layerdrop", "layerdrop", "residual_dropout",
    "embedding_dropout", "pretraining_tp", "num_hidden_layers",
    "max_window_layers",  # read only where use_sliding_window is on
    "gradient_checkpointing", "_num_labels", "output_past",
    "_attn_implementation", "_attn_implementation_autoset",
    "cache_implementation",  # Gemma's "hybrid" cache: how transformers holds it
    # Classes of the model's own code (Phi-3's first releases), which transformers passes
    # over for its built-in implementation of the model type, as kvjax implements that one.
    "auto_map",
    # Marian, BART, mBART: transformers reads none of these (their layers are always post-LN,
    # or pre-LN for mBART; their positions always what the family has), so the same model
    # runs here.
    "normalize_before", "add_final_layer_norm", "normalize_embedding",
    "static_position_embeddings", "extra_pos_embeddings", "add_bias_logits",
})

ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_fast": "gelu",
                "gelu": "gelu_exact", "relu": "relu", "relu2": "relu2", "silu": "silu",
                "swish": "silu", "xielu": "xielu"}


class Reader:
    """Reads keys of a config.json and remembers which were read."""

    def __init__(self, values: dict[str, Any], source: str,
                 neutral: frozenset[str] = INFERENCE_NEUTRAL):
        self.values, self.source, self.read, self.neutral = dict(values), source, set(), neutral

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        value = self.values.get(key)
        return default if value is None else value

    def given(self, key: str, absent: Any = None) -> Any:
        """The file's value of `key`, null included (None), or `absent` where the file has no
        such key: for a key whose null means something else than its absence (`get` takes
        null for absent)."""
        self.read.add(key)
        return self.values[key] if key in self.values else absent

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.source} has no {key!r}")
        return value

    def expect(self, key: str, wanted: Any, default: Any, why: str) -> None:
        """Refuses the model unless `key` (or `default` when absent) is `wanted`."""
        value = self.get(key, default)
        if value != wanted:
            raise UnsupportedModelError(f"{self.source}: {key}={json.dumps(value)} is not "
                                        f"supported ({why})")

    def rename(self, old: str, new: str) -> None:
        """Reads the key a family's older files name `old` as `new`, as transformers' config
        class maps it; a file holding both, with different values, is refused."""
        if old not in self.values:
            return
        self.read.add(old)
        if new in self.values and self.values[new] != self.values[old]:
            raise UnsupportedModelError(f"{self.source}: {old}={json.dumps(self.values[old])} "
                                        f"and {new}={json.dumps(self.values[new])} differ")
        self.values[new] = self.values[old]

    def activation(self, key: str, default: str) -> str:
        name = self.get(key, default)
        if name not in ACTIVATIONS:
            raise UnsupportedModelError(f"{self.source}: {key}={name!r} is not supported; "
                                        f"kvjax runs {sorted(ACTIVATIONS)}")
        return ACTIVATIONS[name]

    def refuse_unread(self) -> None:
        unknown = sorted(key for key, value in self.values.items()
                         if key not in self.read and key not in self.neutral
                         and value not in (None, False, 0, "", [], {}))
        if unknown:
            shown = ", ".join(f"{key}={json.dumps(self.values[key])}" for key in unknown)
            raise UnsupportedModelError(
                f"{self.source}: kvjax does not implement {shown}; it refuses a setting it "
                "would otherwise ignore")


def read_json_object(path: Path, absent: str) -> dict[str, Any]:
    """The JSON object in the file `path`; `absent` is the FileNotFoundError's message when
    there is no such file. Any other file is a ValueError naming it."""
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(absent) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return values
