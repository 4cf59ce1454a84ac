"""The `config.json` reader of BLOOM (`bloom`: BLOOM 560M to 176B, BLOOMZ). `READERS` maps
the model type to its reader.

BLOOM gives its tokens no position: each head adds ALiBi's bias to its attention logits
(`positional_encoding="alibi"`, `model/attention.py`). Its layers are GPT-2's (a LayerNorm
before each sublayer, biases on every projection, tanh GELU), with a LayerNorm over the
embeddings and q, k and v of each head in turn in `query_key_value`. With no table of
positions it runs past the length it was trained on (2,048, or `seq_length`), which is its
`max_len` unless the loader is given another.
"""

from __future__ import annotations

from typing import Any

from .reader import Reader

# Keys of the first releases, switches of Megatron-DeepSpeed's training (fused kernels, an
# ALiBi offset) that transformers' BLOOM reads nowhere, so the model it runs is the same
# whatever they hold; and its softmax in float32, which kvjax's always is.
UNREAD_BY_TRANSFORMERS = ("bias_dropout_fusion", "masked_softmax_fusion", "offset_alibi",
                          "skip_bias_add", "skip_bias_add_qkv", "unk_token_id",
                          "attention_softmax_in_fp32", "slow_but_exact")
TRAINED_LENGTH = 2048
# Other spellings of keys, read under the names transformers' BloomConfig keeps (its
# attribute_map and `n_embed`).
ALIASES = {"num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
           "n_embed": "hidden_size"}


def _bloom(c: Reader) -> dict[str, Any]:
    for alias, name in ALIASES.items():
        c.rename(alias, name)
    for key in UNREAD_BY_TRANSFORMERS:
        c.get(key)
    c.expect("apply_residual_connection_post_layernorm", False, False,
             "the residual taken after the norm")
    c.expect("is_encoder_decoder", False, False, "BLOOM is decoder-only")
    width = c.require("hidden_size")
    c.expect("n_inner", 4 * width, 4 * width, "transformers' BLOOM runs an FFN 4x the width")
    return dict(
        vocab_size=c.require("vocab_size"), d_model=width, num_heads=c.require("n_head"),
        d_ff=4 * width, num_decoder_layers=c.require("n_layer"),
        max_len=c.get("seq_length", TRAINED_LENGTH), positional_encoding="alibi", norm="pre",
        activation="gelu", layer_norm_eps=c.get("layer_norm_epsilon", 1e-5), qkv_bias=True,
        out_bias=True, ffn_bias=True, scale_embeddings=False, embedding_norm=True)


READERS = {"bloom": _bloom}
