"""The `config.json` readers of T5 (`t5`: T5, T5 v1.1, Flan-T5), mT5 (`mt5`) and UMT5
(`umt5`). `READERS` maps the model types to their readers.

T5 gives its tokens no position: each self-attention adds a learned bias by the bucket of
the distance from query to key, one table per stack (`positional_encoding="relative"`,
`positional.PositionBias`), bidirectional in the encoder and causal in the decoder; its
cross-attention has none. RMSNorm before each sublayer, no biases anywhere, attention
unscaled (the scale is folded into the weights), an FFN of ReLU (T5) or gated GELU (v1.1,
Flan-T5); the decoder's output is scaled by 1/√d_model before a tied output layer where
the config says so (`scale_decoder_outputs`, or an older file's `tie_word_embeddings`; mT5's
never is, whatever its files say). UMT5 is mT5's layer with a table in every
self-attention (`relative_bias_per_layer`), its output scaled as T5's.
With no table of positions it runs any length: `max_len` is `n_positions` (512 where
absent), or any length the loader is given.
"""

from __future__ import annotations

from typing import Any

from .errors import UnsupportedModelError
from .reader import Reader

# feed_forward_proj -> (kvjax's activation, the dense_act_fn transformers derives from it).
ACTIVATIONS = {"relu": ("relu", "relu"), "gated-gelu": ("geglu", "gelu_new"),
               "gated-silu": ("swiglu", "silu")}
TRAINED_LENGTH = 512


def _t5(c: Reader) -> dict[str, Any]:
    return _fields(c, _scaled(c))


def _umt5(c: Reader) -> dict[str, Any]:
    return {**_fields(c, _scaled(c)), "relative_bias_per_layer": True}


def _scaled(c: Reader) -> bool:
    """Whether the decoder's output is scaled by 1/√d_model: transformers 5 writes
    tie_word_embeddings true and says it in scale_decoder_outputs; older files said it with
    tie_word_embeddings."""
    scaled = c.given("scale_decoder_outputs")
    return c.get("tie_word_embeddings", True) is not False if scaled is None else scaled


def _mt5(c: Reader) -> dict[str, Any]:
    c.get("tie_word_embeddings")  # transformers' mT5 ties its head whatever this says
    return _fields(c, scaled=False)


def _fields(c: Reader, scaled: bool) -> dict[str, Any]:
    c.expect("is_encoder_decoder", True, True, "T5 is an encoder-decoder")
    for key in ("dropout_rate", "initializer_factor", "classifier_dropout"):
        c.get(key)
    projection = c.get("feed_forward_proj", "relu")
    if projection not in ACTIVATIONS:
        raise UnsupportedModelError(f"{c.source}: feed_forward_proj={projection!r} is not "
                                    f"supported; kvjax runs {sorted(ACTIVATIONS)}")
    activation, dense_act = ACTIVATIONS[projection]
    c.expect("dense_act_fn", dense_act, dense_act, f"transformers derives it from "
             f"feed_forward_proj={projection!r}")
    gated = projection.startswith("gated-")
    c.expect("is_gated_act", gated, gated, f"transformers derives it from "
             f"feed_forward_proj={projection!r}")
    width, layers = c.require("d_model"), c.require("num_layers")
    return dict(
        vocab_size=c.require("vocab_size"), d_model=width, num_heads=c.require("num_heads"),
        head_dim=c.require("d_kv"), d_ff=c.require("d_ff"), num_encoder_layers=layers,
        num_decoder_layers=c.get("num_decoder_layers", layers),
        max_len=c.get("n_positions", TRAINED_LENGTH), positional_encoding="relative",
        relative_buckets=c.get("relative_attention_num_buckets", 32),
        relative_max_distance=c.get("relative_attention_max_distance", 128),
        norm="pre", norm_type="rmsnorm", layer_norm_eps=c.get("layer_norm_epsilon", 1e-6),
        activation=activation, qkv_bias=False, out_bias=False, ffn_bias=False,
        scale_embeddings=False, attention_scale=1.0,
        logits_scaling=float(width) ** 0.5 if scaled else 1.0,
        bos_id=c.get("decoder_start_token_id", c.get("pad_token_id", 0)))


READERS = {"t5": _t5, "mt5": _mt5, "umt5": _umt5}
