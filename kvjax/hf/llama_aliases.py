"""The `config.json` readers of families that transformers runs as Llama whose releases name
some keys (and tensors) in their own way, EXAONE 3 and InternLM3, or name Llama's keys alone
under a type of their own, IQuest-Coder. `READERS` maps each model type to its reader."""

from __future__ import annotations

from typing import Any

from .llama_like import read_llama
from .reader import Reader


def _exaone(c: Reader) -> dict[str, Any]:
    """EXAONE 3.0 and 3.5 (LG AI Research): Llama's layer, as transformers runs it. The
    releases' files name some keys as GPT-2's do (`num_layers`, `layer_norm_epsilon`,
    `activation_function`), read as Llama's, and their tensors too (`weights.EXAONE_NAMES`);
    RoPE's base is 500,000 where they name none."""
    for old, new in (("num_layers", "num_hidden_layers"), ("layer_norm_epsilon", "rms_norm_eps"),
                     ("activation_function", "hidden_act")):
        c.rename(old, new)
    return read_llama(c, rope_base=5e5)


def _internlm3(c: Reader) -> dict[str, Any]:
    """InternLM3 (8B): Llama's layer, as transformers runs it, its biases named `qkv_bias`
    (q, k, v and the output, as `attention_bias`) and `bias` (the FFN's, as `mlp_bias`),
    which must agree as transformers requires; dynamic NTK RoPE in the release."""
    c.rename("qkv_bias", "attention_bias")
    c.rename("bias", "mlp_bias")
    c.expect("mlp_bias", bool(c.get("attention_bias", False)), False,
             "transformers' InternLM3 runs one setting for the attention's and FFN's biases")
    return read_llama(c)


# IQuest-Coder-V1 (40B): Llama's config and layer as they are; transformers runs it as Llama.
READERS = {"exaone": _exaone, "internlm3": _internlm3, "iquestcoder": read_llama}
