"""The `config.json` reader of MPT (`mpt`: MPT-7B and 30B and their chat, instruct and
StoryWriter fine-tunes). `READERS` maps the model type to its reader.

MPT's layers run as transformers' MPT runs them: ALiBi over every head (the slopes of a
bias of at most 8, the paper's, `model/attention.py`), a LayerNorm without a bias before
each sublayer, q, k and v as one projection without biases (clipped at `clip_qkv` where
set), an FFN of four times the width with exact GELU, a tied output layer. Its attention
settings are the nested `attn_config`, every key of which is read or refused like the
top level's. Where MPT's own code could run something transformers does not (query and
key norms, a prefix LM, another FFN, scaled logits), the file is refused by name.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import UnsupportedModelError
from .reader import INFERENCE_NEUTRAL, Reader

# Top-level keys of the releases that change nothing in inference: initialisation, where
# the weights were made, logging, and the FFN's handling of padding in training.
NEUTRAL = ("init_device", "init_config", "verbose", "tokenizer_name", "embedding_fraction",
           "resid_pdrop", "emb_pdrop", "use_pad_tok_in_ffn", "learned_pos_emb")
# attn_config: key -> (the value kvjax runs, why another is refused); None: read below.
ATTENTION_KEYS = {
    "attn_type": ("multihead_attention", "transformers' MPT runs a kv head per query head"),
    "qk_ln": (False, "LayerNorm over queries and keys, which transformers' MPT leaves out"),
    "prefix_lm": (False, "a prefix LM's bidirectional prompt"),
    "attn_uses_sequence_id": (False, "attention within packed sequences"),
    "alibi": (True, "transformers' MPT always runs ALiBi"),
    "alibi_bias_max": (8, "transformers' MPT runs ALiBi's slopes of at most 8"),
    "attn_pdrop": None, "attn_impl": None, "clip_qkv": None, "softmax_scale": None}


def _mpt(c: Reader) -> dict[str, Any]:
    for key in NEUTRAL:
        c.get(key)
    c.expect("is_encoder_decoder", False, False, "MPT is decoder-only")
    c.expect("expansion_ratio", 4, 4, "transformers' MPT runs an FFN 4x the width")
    c.expect("no_bias", True, True, "transformers' MPT has no biases")
    c.expect("logit_scale", None, None, "logits scaled, which transformers' MPT leaves out")
    c.expect("fc_type", "torch", "torch", "dense layers")
    c.expect("ffn_config", {"ffn_type": "mptmlp"}, {"ffn_type": "mptmlp"}, "MPT's own FFN")
    norm = c.get("norm_type", "low_precision_layernorm")
    if norm not in ("low_precision_layernorm", "layernorm"):
        raise UnsupportedModelError(f"{c.source}: norm_type={norm!r} is not supported; kvjax "
                                    "runs LayerNorm ('layernorm', 'low_precision_layernorm')")
    attention = dict(c.get("attn_config") or {})
    for key, value in attention.items():
        if key not in ATTENTION_KEYS:
            # transformers writes attn_config as a config of its own, with every config's
            # bookkeeping keys (INFERENCE_NEUTRAL) beside MPT's.
            if key in INFERENCE_NEUTRAL or value in (None, False, 0, "", [], {}):
                continue
            raise UnsupportedModelError(f"{c.source}: attn_config's {key}={json.dumps(value)} "
                                        "is not supported")
        wanted = ATTENTION_KEYS[key]
        if wanted is not None and value != wanted[0]:
            raise UnsupportedModelError(f"{c.source}: attn_config's {key}={json.dumps(value)} "
                                        f"is not supported ({wanted[1]})")
    width = c.require("d_model")
    return dict(
        vocab_size=c.require("vocab_size"), d_model=width, num_heads=c.require("n_heads"),
        d_ff=4 * width, num_decoder_layers=c.require("n_layers"),
        max_len=c.require("max_seq_len"), positional_encoding="alibi", norm="pre",
        activation="gelu_exact", layer_norm_eps=c.get("layer_norm_epsilon", 1e-5),
        qkv_bias=False, out_bias=False, ffn_bias=False, scale_embeddings=False,
        qkv_clip=attention.get("clip_qkv"), attention_scale=attention.get("softmax_scale"))


READERS = {"mpt": _mpt}
