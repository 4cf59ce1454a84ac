"""The weights of GPT-2 and its descendants (GPTBigCode, GPT-Neo, OPT, BLOOM; GPT-J, GPT-NeoX, Phi
and Falcon with their parallel layers) and of Marian, read into kvjax params
(`weights.load_params` chooses the reader).

Shape letters as in `model/`; O and X of `groups_apart` are a tensor's output rows and inputs.
"""

from __future__ import annotations

import functools

import numpy as np

from kvjax import model as M
from kvjax.model.config_checks import GATED_ACTIVATIONS
from kvjax.model.positional import sinusoidal

from . import tensors
from .tensors import Params

# The output layer's tensor, where it is not lm_head.weight.
OUTPUT_TENSORS = {"gpt_neox": "embed_out.weight"}


def groups_apart(rows_OX: np.ndarray, kv_heads: int, head_dim: int) -> np.ndarray:
    """Fused q, k and v rows by kv-head group [K·(G+2)·H, X], each kv head's G query heads,
    then its key, then its value, in kvjax's order [(N+2K)·H, X]: every q head (kv-major, as
    kvjax groups them), then every k head, then every v head. Falcon's query_key_value in
    its three layouts; with a kv head per query head (K = N), each head's q, k and v in turn:
    GPT-NeoX's and BLOOM's query_key_value, GPTBigCode's c_attn without multi_query."""
    grouped = rows_OX.reshape(kv_heads, -1, head_dim, rows_OX.shape[-1])
    return np.concatenate([grouped[:, :-2].reshape(-1, rows_OX.shape[-1]),
                           grouped[:, -2].reshape(-1, rows_OX.shape[-1]),
                           grouped[:, -1].reshape(-1, rows_OX.shape[-1])])


def groups_together(rows_OX: np.ndarray, kv_heads: int, num_heads: int,
                    head_dim: int) -> np.ndarray:
    """The inverse of `groups_apart`: rows in kvjax's order [(N+2K)·H, X] in Falcon's."""
    x = rows_OX.shape[-1]
    q_KGHX = rows_OX[:num_heads * head_dim].reshape(kv_heads, -1, head_dim, x)
    k_KHX, v_KHX = rows_OX[num_heads * head_dim:].reshape(2, kv_heads, 1, head_dim, x)
    return np.concatenate([q_KGHX, k_KHX, v_KHX], axis=1).reshape(-1, x)


def _gpt2(c: M.TransformerConfig, p: Params):
    prefix = "transformer." if "transformer.wte.weight" in p.files else ""
    d, n, h, f = c.d_model, c.num_heads, c.head_dim, c.d_ff
    p.set("embedder/embedding/embedding", p.read(prefix + "wte.weight", (c.vocab_size, d)))
    p.set("embedder/position_embedding", p.read(prefix + "wpe.weight", (c.max_len, d)))
    for i in range(c.num_decoder_layers):
        src, dst = f"{prefix}h.{i}.", f"layers/{i}/"
        tensors.layer_norm(p, src + "ln_1", dst + "attention_block/norm", d)
        tensors.layer_norm(p, src + "ln_2", dst + "ffn_block/norm", d)
        # Conv1D is [in, out]; c_attn's output columns are q, k, v, each head-major.
        p.set(dst + "self_attention/qkv/kernel",
              p.read(src + "attn.c_attn.weight", (d, 3 * n * h)).reshape(d, 3 * n, h))
        p.set(dst + "self_attention/qkv/bias",
              p.read(src + "attn.c_attn.bias", (3 * n * h,)).reshape(3 * n, h))
        p.set(dst + "self_attention/out/kernel",
              p.read(src + "attn.c_proj.weight", (n * h, d)).reshape(n, h, d))
        p.set(dst + "self_attention/out/bias", p.read(src + "attn.c_proj.bias", (d,)))
        for kv_name, hf_name, shape in (("wi", "c_fc", (d, f)), ("wo", "c_proj", (f, d))):
            p.set(dst + f"ffn/{kv_name}/kernel", p.read(f"{src}mlp.{hf_name}.weight", shape))
            p.set(dst + f"ffn/{kv_name}/bias", p.read(f"{src}mlp.{hf_name}.bias", shape[1:]))
    tensors.layer_norm(p, prefix + "ln_f", "final_norm", d)
    tensors.unembed(c, p, "lm_head.weight")
    # Older GPT-2 files keep the causal mask as buffers; they hold no weights.
    return lambda name: name.endswith((".attn.bias", ".attn.masked_bias"))


def _gpt_bigcode(c: M.TransformerConfig, p: Params):
    d, n, k, h, f = c.d_model, c.num_heads, c.kv_heads, c.head_dim, c.d_ff
    p.set("embedder/embedding/embedding", p.read("transformer.wte.weight", (c.vocab_size, d)))
    p.set("embedder/position_embedding", p.read("transformer.wpe.weight", (c.max_len, d)))
    rows = (n + 2 * k) * h
    for i in range(c.num_decoder_layers):
        src, dst = f"transformer.h.{i}.", f"layers/{i}/"
        tensors.layer_norm(p, src + "ln_1", dst + "attention_block/norm", d)
        tensors.layer_norm(p, src + "ln_2", dst + "ffn_block/norm", d)
        # A torch Linear: with one kv head its rows are every query head, the key, the
        # value; with a kv head per query head, each head's q, k and v in turn.
        qkv, bias = (p.read(src + "attn.c_attn.weight", (rows, d)),
                     p.read(src + "attn.c_attn.bias", (rows,)))
        if k == n:
            qkv, bias = groups_apart(qkv, n, h), groups_apart(bias[:, None], n, h)[:, 0]
        p.set(dst + "self_attention/qkv/kernel", qkv.T.reshape(d, n + 2 * k, h))
        p.set(dst + "self_attention/qkv/bias", bias.reshape(n + 2 * k, h))
        tensors.output(p, src + "attn.c_proj", dst + "self_attention/out", c)
        tensors.dense(p, src + "mlp.c_fc", dst + "ffn/wi", (f, d), True)
        tensors.dense(p, src + "mlp.c_proj", dst + "ffn/wo", (d, f), True)
    tensors.layer_norm(p, "transformer.ln_f", "final_norm", d)
    tensors.unembed(c, p, "lm_head.weight")
    return lambda name: False


def _gpt_neo(c: M.TransformerConfig, p: Params):
    d, n, h, f = c.d_model, c.num_heads, c.head_dim, c.d_ff
    p.set("embedder/embedding/embedding", p.read("transformer.wte.weight", (c.vocab_size, d)))
    p.set("embedder/position_embedding", p.read("transformer.wpe.weight", (c.max_len, d)))
    for i in range(c.num_decoder_layers):
        src, dst = f"transformer.h.{i}.", f"layers/{i}/"
        tensors.layer_norm(p, src + "ln_1", dst + "attention_block/norm", d)
        tensors.layer_norm(p, src + "ln_2", dst + "ffn_block/norm", d)
        tensors.fused(p, dst + "self_attention/qkv", [
            tensors.linear(p, f"{src}attn.attention.{name}_proj", n, h, d, False)
            for name in ("q", "k", "v")])
        tensors.output(p, src + "attn.attention.out_proj", dst + "self_attention/out", c)
        tensors.dense(p, src + "mlp.c_fc", dst + "ffn/wi", (f, d), True)
        tensors.dense(p, src + "mlp.c_proj", dst + "ffn/wo", (d, f), True)
    tensors.layer_norm(p, "transformer.ln_f", "final_norm", d)
    tensors.unembed(c, p, "lm_head.weight")
    # Older files keep each layer's causal (or local) mask as buffers.
    return lambda name: name.endswith((".attn.attention.bias", ".attn.attention.masked_bias"))


def _gpt_neox(c: M.TransformerConfig, p: Params):
    p.set("embedder/embedding/embedding", p.read("gpt_neox.embed_in.weight",
                                                 (c.vocab_size, c.d_model)))
    for i in range(c.num_decoder_layers):
        _heads_in_turn_layer(c, p, f"gpt_neox.layers.{i}.", f"layers/{i}/", "attention")
    tensors.layer_norm(p, "gpt_neox.final_layer_norm", "final_norm", c.d_model)
    tensors.unembed(c, p, OUTPUT_TENSORS["gpt_neox"])
    # Older files keep the causal mask and RoPE's frequencies as buffers.
    return lambda name: name.endswith((".attention.bias", ".attention.masked_bias",
                                       ".rotary_emb.inv_freq"))


def _heads_in_turn_layer(c: M.TransformerConfig, p: Params, src: str, dst: str,
                         attention: str) -> None:
    """GPT-NeoX's and BLOOM's layer: input_layernorm, `attention`'s query_key_value (each
    head's q, k and v in turn; a bias where `qkv_bias`) and dense, post_attention_layernorm,
    the MLP's dense_h_to_4h and dense_4h_to_h."""
    d, n, h, f = c.d_model, c.num_heads, c.head_dim, c.d_ff
    tensors.layer_norm(p, src + "input_layernorm", dst + "attention_block/norm", d)
    tensors.layer_norm(p, src + "post_attention_layernorm", dst + "ffn_block/norm", d)
    qkv = p.read(f"{src}{attention}.query_key_value.weight", (3 * n * h, d))
    p.set(dst + "self_attention/qkv/kernel", groups_apart(qkv, n, h).T.reshape(d, 3 * n, h))
    if c.qkv_bias:
        bias = p.read(f"{src}{attention}.query_key_value.bias", (3 * n * h,))
        p.set(dst + "self_attention/qkv/bias", groups_apart(bias[:, None], n, h).reshape(
            3 * n, h))
    tensors.output(p, f"{src}{attention}.dense", dst + "self_attention/out", c)
    tensors.dense(p, src + "mlp.dense_h_to_4h", dst + "ffn/wi", (f, d), True)
    tensors.dense(p, src + "mlp.dense_4h_to_h", dst + "ffn/wo", (d, f), True)


def _falcon(c: M.TransformerConfig, p: Params):
    d, n, k, h, f = c.d_model, c.num_heads, c.kv_heads, c.head_dim, c.d_ff
    p.set("embedder/embedding/embedding", p.read("transformer.word_embeddings.weight",
                                                 (c.vocab_size, d)))
    rows = (n + 2 * k) * h
    norms = {"attention_block/norm": "input_layernorm"}  # one a layer, parallel (7B, Falcon 2)
    if c.parallel_residual and not c.shared_norm:  # the new architecture's two (40B)
        norms = {"attention_block/norm": "ln_attn", "ffn_block/norm": "ln_mlp"}
    elif not c.parallel_residual:  # one before each sublayer
        norms["ffn_block/norm"] = "post_attention_layernorm"
    for i in range(c.num_decoder_layers):
        src, dst = f"transformer.h.{i}.", f"layers/{i}/"
        for ours, theirs in norms.items():
            tensors.layer_norm(p, src + theirs, dst + ours, d)
        qkv = groups_apart(p.read(src + "self_attention.query_key_value.weight", (rows, d)), k, h)
        p.set(dst + "self_attention/qkv/kernel", qkv.T.reshape(d, n + 2 * k, h))
        if c.qkv_bias:
            bias = p.read(src + "self_attention.query_key_value.bias", (rows,))
            p.set(dst + "self_attention/qkv/bias", groups_apart(bias[:, None], k, h).reshape(
                n + 2 * k, h))
        tensors.output(p, src + "self_attention.dense", dst + "self_attention/out", c)
        tensors.dense(p, src + "mlp.dense_h_to_4h", dst + "ffn/wi", (f, d), c.ffn_bias)
        tensors.dense(p, src + "mlp.dense_4h_to_h", dst + "ffn/wo", (d, f), c.ffn_bias)
    tensors.layer_norm(p, "transformer.ln_f", "final_norm", d)
    tensors.unembed(c, p, "lm_head.weight")
    # The first releases' files keep RoPE's frequencies as buffers.
    return lambda name: name.endswith(".rotary_emb.inv_freq")


def _bloom(c: M.TransformerConfig, p: Params):
    # The releases' files were saved from BloomModel, without "transformer.".
    prefix = "transformer." if "transformer.word_embeddings.weight" in p.files else ""
    p.set("embedder/embedding/embedding", p.read(prefix + "word_embeddings.weight",
                                                 (c.vocab_size, c.d_model)))
    tensors.layer_norm(p, prefix + "word_embeddings_layernorm", "embedder/embedding_norm",
                       c.d_model)
    for i in range(c.num_decoder_layers):
        _heads_in_turn_layer(c, p, f"{prefix}h.{i}.", f"layers/{i}/", "self_attention")
    tensors.layer_norm(p, prefix + "ln_f", "final_norm", c.d_model)
    tensors.unembed(c, p, "lm_head.weight")
    return lambda name: False


def _mpt(c: M.TransformerConfig, p: Params):
    d, n, h, f = c.d_model, c.num_heads, c.head_dim, c.d_ff
    p.set("embedder/embedding/embedding", p.read("transformer.wte.weight", (c.vocab_size, d)))
    for i in range(c.num_decoder_layers):
        src, dst = f"transformer.blocks.{i}.", f"layers/{i}/"
        # LayerNorms without biases; Wqkv's rows every q head, then every k, then every v.
        tensors.layer_norm(p, src + "norm_1", dst + "attention_block/norm", d, bias=False)
        tensors.layer_norm(p, src + "norm_2", dst + "ffn_block/norm", d, bias=False)
        qkv = p.read(src + "attn.Wqkv.weight", (3 * n * h, d))
        p.set(dst + "self_attention/qkv/kernel", qkv.T.reshape(d, 3 * n, h))
        tensors.output(p, src + "attn.out_proj", dst + "self_attention/out", c)
        tensors.dense(p, src + "ffn.up_proj", dst + "ffn/wi", (f, d), False)
        tensors.dense(p, src + "ffn.down_proj", dst + "ffn/wo", (d, f), False)
    tensors.layer_norm(p, "transformer.norm_f", "final_norm", d, bias=False)
    tensors.unembed(c, p, "lm_head.weight")
    return lambda name: False


def _opt(c: M.TransformerConfig, p: Params):
    prefix = "model.decoder." if "model.decoder.embed_tokens.weight" in p.files else "decoder."
    d, f, n, h = c.d_model, c.d_ff, c.num_heads, c.head_dim
    e = c.embedding_dim or d
    p.set("embedder/embedding/embedding", p.read(prefix + "embed_tokens.weight",
                                                 (c.vocab_size, e)))
    if c.embedding_dim is not None:  # OPT-350m: a table narrower than the layers
        tensors.dense(p, prefix + "project_in", "embedder/project_in", (d, e), False)
        tensors.dense(p, prefix + "project_out", "embedder/project_out", (e, d), False)
    # Position i is the table's row i + 2 (OPT offsets the positions by two).
    p.set("embedder/position_embedding",
          p.read(prefix + "embed_positions.weight", (c.max_len + 2, d))[2:])
    for i in range(c.num_decoder_layers):
        src, dst = f"{prefix}layers.{i}.", f"layers/{i}/"
        tensors.layer_norm(p, src + "self_attn_layer_norm", dst + "attention_block/norm", d)
        tensors.fused(p, dst + "self_attention/qkv", [
            tensors.linear(p, f"{src}self_attn.{name}_proj", n, h, d, c.qkv_bias)
            for name in ("q", "k", "v")])
        tensors.output(p, src + "self_attn.out_proj", dst + "self_attention/out", c)
        tensors.layer_norm(p, src + "final_layer_norm", dst + "ffn_block/norm", d)
        tensors.dense(p, src + "fc1", dst + "ffn/wi", (f, d), c.ffn_bias)
        tensors.dense(p, src + "fc2", dst + "ffn/wo", (d, f), c.ffn_bias)
    if c.norm == "pre":  # post-LN layers (OPT-350m's) end normalised
        tensors.layer_norm(p, prefix + "final_layer_norm", "final_norm", d)
    tensors.unembed(c, p, "lm_head.weight")
    return lambda name: False


# The names of a parallel layer on one LayerNorm (`_one_norm_parallel`), Phi-2's and GPT-J's,
# and the ends of the names of buffers their older files keep (RoPE's frequencies, the
# causal mask), which hold no weights.
_PHI_NAMES = dict(embedding="model.embed_tokens", layers="model.layers",
                  norm="input_layernorm", attention="self_attn", out="dense", fc=("fc1", "fc2"),
                  final_norm="model.final_layernorm", qkv_bias=True,
                  buffers=(".rotary_emb.inv_freq",))
_GPTJ_NAMES = dict(embedding="transformer.wte", layers="transformer.h", norm="ln_1",
                   attention="attn", out="out_proj", fc=("fc_in", "fc_out"),
                   final_norm="transformer.ln_f", qkv_bias=False,
                   buffers=(".attn.bias", ".attn.masked_bias"))


def _one_norm_parallel(c: M.TransformerConfig, p: Params, names: dict, rope_order=None):
    """Phi-2's and GPT-J's layers: the attention and the FFN side by side on one LayerNorm,
    q, k and v projections of their own, a bias on the output layer. `rope_order` (GPT-J's
    RoPE over pairs): the order of each head's query and key columns in kvjax."""
    d, f, h = c.d_model, c.d_ff, c.head_dim
    p.set("embedder/embedding/embedding", p.read(names["embedding"] + ".weight",
                                                 (c.vocab_size, d)))
    for i in range(c.num_decoder_layers):
        src, dst = f"{names['layers']}.{i}.", f"layers/{i}/"
        tensors.layer_norm(p, src + names["norm"], dst + "attention_block/norm", d)
        parts = [tensors.linear(p, f"{src}{names['attention']}.{name}_proj", heads, h, d,
                                names["qkv_bias"])
                 for name, heads in (("q", c.num_heads), ("k", c.kv_heads), ("v", c.kv_heads))]
        if rope_order is not None:  # q's and k's kernels [D, heads, H] and biases [heads, H]
            order = rope_order(h, c.rotary_dims)
            parts[:2] = [tuple(None if x is None else x[..., order] for x in part)
                         for part in parts[:2]]
        tensors.fused(p, dst + "self_attention/qkv", parts)
        tensors.output(p, f"{src}{names['attention']}.{names['out']}",
                       dst + "self_attention/out", c)
        tensors.dense(p, f"{src}mlp.{names['fc'][0]}", dst + "ffn/wi", (f, d), True)
        tensors.dense(p, f"{src}mlp.{names['fc'][1]}", dst + "ffn/wo", (d, f), True)
    tensors.layer_norm(p, names["final_norm"], "final_norm", d)
    tensors.unembed(c, p, "lm_head.weight")
    p.set("embedder/logits_bias", p.read("lm_head.bias", (c.vocab_size,)))
    return lambda name: name.endswith(names["buffers"])


def _marian(c: M.TransformerConfig, p: Params):
    """Marian's, M2M100's and BART's tensors (M2M100 and mBART: pre-norm, with each stack's
    final LayerNorm; M2M100 with no bias on the logits; BART with each stack's positions and
    embedding LayerNorm)."""
    d, n, f = c.d_model, c.num_heads, c.d_ff
    _shared_embedding(p, c, "model.shared.weight")
    for part, stack, count in (("encoder", "encoder_layers", c.num_encoder_layers),
                               ("decoder", "decoder_layers", c.num_decoder_layers)):
        for i in range(count):
            src, dst = f"model.{part}.layers.{i}.", f"{stack}/{i}/"
            tensors.fused(p, dst + "self_attention/qkv", [
                tensors.linear(p, f"{src}self_attn.{name}_proj", n, c.head_dim, d, True)
                for name in ("q", "k", "v")])
            tensors.output(p, src + "self_attn.out_proj", dst + "self_attention/out", c)
            tensors.layer_norm(p, src + "self_attn_layer_norm", dst + "attention_block/norm", d)
            tensors.dense(p, src + "fc1", dst + "ffn/wi", (f, d), True)
            tensors.dense(p, src + "fc2", dst + "ffn/wo", (d, f), True)
            tensors.layer_norm(p, src + "final_layer_norm", dst + "ffn_block/norm", d)
            if part == "decoder":
                query, query_bias = tensors.linear(p, src + "encoder_attn.q_proj", n, c.head_dim, d,
                                            True)
                p.set(dst + "cross_attention/query/kernel", query)
                p.set(dst + "cross_attention/query/bias", query_bias)
                tensors.fused(p, f"cross_kv/{i}/kv", [
                    tensors.linear(p, f"{src}encoder_attn.{name}_proj", n, c.head_dim, d, True)
                    for name in ("k", "v")])
                tensors.output(p, src + "encoder_attn.out_proj", dst + "cross_attention/out", c)
                tensors.layer_norm(p, src + "encoder_attn_layer_norm", dst + "cross_block/norm", d)
    if c.logits_bias:  # files may leave out its zeros (transformers allows it)
        p.set("embedder/logits_bias", p.read("final_logits_bias", (1, c.vocab_size))[0]
              if "final_logits_bias" in p.files else np.zeros(c.vocab_size, np.float32))
    tensors.unembed(c, p, "lm_head.weight")
    for part in ("encoder", "decoder"):
        if c.norm == "pre":  # M2M100, mBART: a LayerNorm after each stack
            tensors.layer_norm(p, f"model.{part}.layer_norm", f"{part}_norm", d)
        positions = f"model.{part}.embed_positions.weight"
        if c.per_stack_embeddings:  # BART: rows 0 and 1 are an offset no position reads
            p.set(f"embedder/{part}_position_embedding",
                  p.read(positions, (c.max_len + 2, d))[2:])
            tensors.layer_norm(p, f"model.{part}.layernorm_embedding",
                               f"embedder/{part}_embedding_norm", d)
        else:
            _check_sinusoids(p, positions, c)
    return lambda name: False


def _t5(c: M.TransformerConfig, p: Params):
    d, n, h, f = c.d_model, c.num_heads, c.head_dim, c.d_ff
    _shared_embedding(p, c, "shared.weight")
    table = "0.SelfAttention.relative_attention_bias.weight"
    for part in ("encoder", "decoder"):
        if not c.relative_bias_per_layer:  # T5: each stack's table, held by its first layer
            p.set(f"{part}_position_bias", p.read(f"{part}.block.0.layer.{table}",
                                                  (c.relative_buckets, n)))
        tensors.norm(p, f"{part}.final_layer_norm", f"{part}_norm", c)
    for part, stack, count in (("encoder", "encoder_layers", c.num_encoder_layers),
                               ("decoder", "decoder_layers", c.num_decoder_layers)):
        for i in range(count):
            src, dst = f"{part}.block.{i}.layer.", f"{stack}/{i}/"
            if c.relative_bias_per_layer:  # UMT5: every layer's own
                p.set(dst + "self_attention/position_bias",
                      p.read(src + table, (c.relative_buckets, n)))
            tensors.norm(p, src + "0.layer_norm", dst + "attention_block/norm", c)
            tensors.fused(p, dst + "self_attention/qkv", [
                tensors.linear(p, f"{src}0.SelfAttention.{x}", n, h, d, False) for x in "qkv"])
            tensors.output(p, src + "0.SelfAttention.o", dst + "self_attention/out", c)
            ffn = src + "1."
            if part == "decoder":
                cross = src + "1.EncDecAttention."
                p.set(dst + "cross_attention/query/kernel",
                      tensors.linear(p, cross + "q", n, h, d, False)[0])
                tensors.fused(p, f"cross_kv/{i}/kv", [
                    tensors.linear(p, cross + x, n, h, d, False) for x in "kv"])
                tensors.output(p, cross + "o", dst + "cross_attention/out", c)
                tensors.norm(p, src + "1.layer_norm", dst + "cross_block/norm", c)
                ffn = src + "2."
            tensors.norm(p, ffn + "layer_norm", dst + "ffn_block/norm", c)
            gated = c.activation in GATED_ACTIVATIONS  # wi_0 activated, times wi_1
            for theirs, ours in (("wi_0", "wi"), ("wi_1", "wi_gate")) if gated else (("wi", "wi"),):
                tensors.dense(p, f"{ffn}DenseReluDense.{theirs}", dst + f"ffn/{ours}", (f, d),
                              False)
            tensors.dense(p, ffn + "DenseReluDense.wo", dst + "ffn/wo", (d, f), False)
    tensors.unembed(c, p, "lm_head.weight")
    return lambda name: False


def _shared_embedding(p: Params, c: M.TransformerConfig, name: str) -> None:
    """An encoder-decoder's one embedding table `name`, which files may repeat as the
    encoder's and the decoder's `embed_tokens` (refused where they differ)."""
    shared = p.read(name, (c.vocab_size, c.d_model))
    p.set("embedder/embedding/embedding", shared)
    prefix = name.removesuffix("shared.weight")
    for part in ("encoder", "decoder"):
        copy = f"{prefix}{part}.embed_tokens.weight"
        if copy in p.files and not np.array_equal(p.read(copy, shared.shape), shared):
            raise ValueError(f"{p.files.directory}: {copy} differs from {name}; kvjax's "
                             "encoder and decoder share one embedding table")


def _check_sinusoids(p: Params, name: str, c: M.TransformerConfig) -> None:
    """A stored table of static sinusoids must be the one kvjax computes."""
    if name not in p.files:
        return
    table = p.files.read(name).astype(np.float32)
    positions = np.arange(table.shape[0])[None]
    ours = np.asarray(sinusoidal(positions, c.d_model, c.sinusoid_layout))[0]
    if table.shape != ours.shape or not np.allclose(table, ours, atol=1e-4):
        raise ValueError(f"{p.files.directory}: {name} is not the sinusoid table kvjax "
                         f"computes ({c.sinusoid_layout} layout)")
    p.used.add(name)


READERS = {"gpt2": _gpt2, "gpt_bigcode": _gpt_bigcode, "gpt_neo": _gpt_neo,
           "gptj": functools.partial(_one_norm_parallel, names=_GPTJ_NAMES),
           "gpt_neox": _gpt_neox, "phi": functools.partial(_one_norm_parallel, names=_PHI_NAMES),
           "opt": _opt, "falcon": _falcon, "bloom": _bloom, "mpt": _mpt,
           "marian": _marian, "t5": _t5}
