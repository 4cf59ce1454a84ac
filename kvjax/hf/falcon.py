"""The `config.json` reader of Falcon (`falcon`: Falcon-7B and 40B, 180B, Falcon 2 11B, and
the RefinedWeb models without ALiBi). `READERS` maps the model type to its reader.

Falcon's layer comes in three shapes, which its keys choose:
  - `new_decoder_architecture` (40B, 180B, Falcon 2): `num_kv_heads` kv heads, the attention
    and the FFN side by side on the layer's input, each through a LayerNorm of its own
    (`ln_attn`, `ln_mlp`) or both through one (`num_ln_in_parallel_attn` 1: Falcon 2);
  - else `parallel_attn` (7B): the two side by side on one LayerNorm, one kv head where
    `multi_query` (else one per query head);
  - else a LayerNorm before each sublayer in turn, as GPT-2's.
RoPE over every dimension of each head (its halves, as Llama's), GELU, a tied output layer
unless the files hold `lm_head.weight`, biases on every projection where `bias`.
"""

from __future__ import annotations

from typing import Any

from .errors import UnsupportedModelError
from .reader import Reader
from .rope import partial_rope, rope_settings

# The release files' older names of keys, as transformers' FalconConfig maps them.
OLDER_NAMES = {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
               "n_head_kv": "num_kv_heads", "n_embed": "hidden_size"}


def kv_heads(c: Reader) -> int:
    """The kv heads of a Falcon config: `num_kv_heads` (all the query heads where absent) in
    the new architecture or without `multi_query`; one with it, whatever `num_kv_heads` says
    (transformers' Falcon reads it only in the other two)."""
    given = c.get("num_kv_heads", c.require("num_attention_heads"))
    new_architecture, multi_query = (c.get("new_decoder_architecture", False),
                                     c.get("multi_query", True))
    return given if new_architecture or not multi_query else 1


def _falcon(c: Reader) -> dict[str, Any]:
    for old, new in OLDER_NAMES.items():
        c.rename(old, new)
    c.expect("alibi", False, False, "Falcon-RW's ALiBi, whose slopes times each key's position "
             "transformers rounds to bfloat16 and scales with the scores, is not BLOOM's and MPT's")
    c.expect("is_encoder_decoder", False, False, "Falcon is decoder-only")
    # A key of the first releases' own code that transformers' Falcon reads nowhere.
    c.get("apply_residual_connection_post_layernorm")
    width, heads = c.require("hidden_size"), c.require("num_attention_heads")
    new_architecture = bool(c.get("new_decoder_architecture", False))
    parallel = bool(c.get("parallel_attn", True))
    kv = kv_heads(c)
    c.expect("num_key_value_heads", kv, kv, "transformers writes the kv heads the other keys "
             "say")
    norms = c.get("num_ln_in_parallel_attn", 2 if new_architecture else None)
    if new_architecture and not parallel:
        raise UnsupportedModelError(f"{c.source}: new_decoder_architecture with parallel_attn "
                                    "false is a layer transformers' Falcon cannot run")
    if new_architecture and norms not in (1, 2):
        raise UnsupportedModelError(f"{c.source}: num_ln_in_parallel_attn={norms!r} must be 1 "
                                    "or 2")
    if not new_architecture and norms not in (None, 1):
        raise UnsupportedModelError(
            f"{c.source}: num_ln_in_parallel_attn={norms!r} outside the new decoder "
            "architecture is a layer transformers' Falcon cannot run (it has one LayerNorm)")
    if not (new_architecture or c.get("multi_query", True)) and kv != heads:
        raise UnsupportedModelError(
            f"{c.source}: num_kv_heads={kv} with multi_query false outside the new decoder "
            f"architecture must be num_attention_heads ({heads}): each head holds its q, k "
            "and v in turn")
    if heads % kv:
        raise UnsupportedModelError(f"{c.source}: num_kv_heads={kv} must divide "
                                    f"num_attention_heads={heads}")
    bias = bool(c.get("bias", False))
    return dict(
        vocab_size=c.require("vocab_size"), d_model=width, num_heads=heads, num_kv_heads=kv,
        d_ff=c.get("ffn_hidden_size") or 4 * width, num_decoder_layers=c.require(
            "num_hidden_layers"), max_len=c.get("max_position_embeddings", 2048),
        norm="pre", activation=c.activation("activation", "gelu"),
        layer_norm_eps=c.get("layer_norm_epsilon", 1e-5), qkv_bias=bias, out_bias=bias,
        ffn_bias=bias, scale_embeddings=False,
        parallel_residual=new_architecture or parallel,
        shared_norm=(norms == 1) if new_architecture else parallel,
        **partial_rope(c, rope_settings(c), None, c.get("rope_theta", 10000.0)))


READERS = {"falcon": _falcon}
