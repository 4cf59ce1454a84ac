"""Weights of a Hugging Face directory (safetensors) as kvjax params: `load_params`.

Names and layouts are mapped per model type (`LAYOUTS`): torch's `Linear` stores [out, in]
and is transposed, GPT-2's `Conv1D` already stores [in, out]; q/k/v projections are fused
into kvjax's one [D, N + 2K, H] kernel. Every param the model needs must come from exactly one
tensor of the right shape, and every tensor of the files must be used (or be a known buffer
that holds no weights), so a mismatch is an error naming the tensor, never a silently random
layer (`tensors.py` reads them). Llama's layout and its kin are read here, GPT-2's
descendants and Marian in `gpt_weights.py`.
"""

from __future__ import annotations

import functools
import re

import numpy as np

from kvjax import model as M
from kvjax.model.feed_forward import XIELU_BETA, XIELU_EPS

from . import gpt_weights, latent_weights, mxfp4, tensors
from .errors import UnsupportedModelError
from .tensors import Params, WeightFiles

# How each model type's files name and lay out its tensors: "llama" (Llama and its kin: q_proj,
# k_proj, v_proj, gate_proj, up_proj, down_proj under model.layers.i), "fused" (Phi-3: qkv_proj
# and gate_up_proj), "glm" (Llama's attention, its RoPE turning pairs of dimensions, and Phi-3's
# gate_up_proj; GLM-4-0414's norms on the sublayers' outputs), "gpt2" (Conv1D's c_attn, c_proj,
# c_fc under transformer.h.i), "gpt_bigcode" (the same names as torch Linears, one kv head in
# c_attn or each head's q, k, v in turn), "gpt_neo" (GPT-2's names with q_proj, k_proj, v_proj,
# out_proj under attn.attention), "gptj" (q_proj to out_proj under attn, fc_in and fc_out, one
# LayerNorm a layer, RoPE over pairs), "gpt_neox" (query_key_value, each head's q, k and v in
# turn, under gpt_neox.layers.i), "phi" (Phi-2: q_proj, k_proj, v_proj, dense, fc1, fc2, one norm
# a layer), "opt" (q_proj, k_proj, v_proj, out_proj, fc1, fc2 under model.decoder.layers.i),
# "plain_mlp" (Llama's attention, an FFN of c_fc and c_proj: StarCoder2), "mixtral" (Llama's
# attention, experts of w1, w3 and w2 under block_sparse_moe), "granitemoe" (every expert in one
# input_linear and one output_linear), "granite_shared" (Granite 4.0's and GraniteMoeShared's
# shared_mlp, its gate and up projections in one input_linear, beside GraniteMoE's experts),
# "gpt_oss" (Llama's attention with sinks, every expert's interleaved gate and up projections in
# one gate_up_proj, with biases) and "marian" (an encoder
# and a decoder; M2M100's, BART's and mBART's too), "llama_pairs" (Llama's names, its RoPE turning
# pairs of dimensions: Helium, ERNIE 4.5), "cohere" (as "llama_pairs", one bias-free LayerNorm a
# layer), "up_down_mlp" (Llama's attention, an FFN of up_proj and down_proj: Arcee), "nemotron"
# (the same with LayerNorm1P, whose weight + 1 is the scale) and "nanochat" (Llama's attention,
# its RoPE turning the other way, an FFN of fc1 and fc2, no norm weights), "falcon"
# (query_key_value by kv-head group, dense, dense_h_to_4h, dense_4h_to_h under transformer.h.i),
# "bloom" (Falcon's names, each head's q, k and v in turn, and a word_embeddings_layernorm), "mpt"
# (Wqkv, out_proj, up_proj, down_proj, norm_1 and norm_2 under transformer.blocks.i), "t5" (an
# encoder's and a decoder's blocks of SelfAttention, EncDecAttention and DenseReluDense layers,
# each stack's relative_attention_bias in its first block). Llama's layout holds experts too:
# gate_proj, up_proj and down_proj under mlp (and a shared expert of the same three beside them,
# with its gate: Qwen2-MoE); "vaultgemma" is Llama's with Gemma 2's norm before the FFN
# (pre_feedforward_layernorm) and none on the sublayers' outputs; "hunyuan_moe" is HunYuan's
# (query_layernorm, key_layernorm) with Llama's experts, their router gate.wg, a shared_mlp.
LAYOUTS = {"gpt2": "gpt2", "gpt_bigcode": "gpt_bigcode", "gpt_neo": "gpt_neo", "gptj": "gptj",
           "phi3": "fused", "marian": "marian", "m2m_100": "marian", "bart": "marian",
           "mbart": "marian", "gpt_neox": "gpt_neox",
           "phi": "phi", "opt": "opt", "starcoder2": "plain_mlp", "mixtral": "mixtral",
           "granitemoe": "granitemoe", "granitemoeshared": "granite_shared",
           "granitemoehybrid": "granite_shared", "hyperclovax": "hyperclovax",
           "jais2": "up_down_mlp", "gpt_oss": "gpt_oss", "glm": "glm", "glm4": "glm",
           "helium": "llama_pairs", "ernie4_5": "llama_pairs", "ernie4_5_moe": "ernie_moe",
           "glm4_moe": "deepseek_moe", "dots1": "deepseek_moe",
           "deepseek_v3": "deepseek_latent", "glm4_moe_lite": "deepseek_latent",
           "deepseek_v2": "deepseek_latent",
           "cohere": "cohere",
           "cohere2": "cohere", "arcee": "up_down_mlp", "nemotron": "nemotron",
           "apertus": "apertus", "nanochat": "nanochat", "falcon": "falcon", "bloom": "bloom",
           "mpt": "mpt", "t5": "t5", "mt5": "t5", "umt5": "t5",
           **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "smollm3", "granite",
                            "gemma2", "gemma3_text", "olmo2", "olmo3", "stablelm", "gemma",
                            "qwen3_moe", "olmoe", "qwen2_moe", "seed_oss", "ministral",
                            "ministral3", "exaone4", "olmo", "exaone", "internlm3",
                            "flex_olmo", "iquestcoder"), "llama"),
           "hunyuan_v1_dense": "hunyuan", "hunyuan_v1_moe": "hunyuan_moe", "phimoe": "mixtral",
           "vaultgemma": "vaultgemma"}


# EXAONE 3's releases name their tensors as GPT-2's layers (transformer.h.i.attn.attention,
# mlp.c_fc_0, ...): renamed in turn into Llama's, which transformers runs it as (its
# conversion mapping); files it saved already hold Llama's names.
EXAONE_NAMES = ((r"^transformer\.wte\.", "model.embed_tokens."),
                (r"^transformer\.h\.", "model.layers."), (r"^transformer\.ln_f\.", "model.norm."),
                (r"\.attn\.attention\.", ".self_attn."),
                (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
                (r"\.ln_1\.", ".input_layernorm."), (r"\.ln_2\.", ".post_attention_layernorm."),
                (r"\.mlp\.c_fc_0\.", ".mlp.gate_proj."), (r"\.mlp\.c_fc_1\.", ".mlp.up_proj."),
                (r"\.mlp\.c_proj\.", ".mlp.down_proj."))


def ties_embeddings(model_type: str, files: WeightFiles) -> bool:
    """Whether the model's output layer is its embedding table: its files hold no output
    layer of their own."""
    output = gpt_weights.OUTPUT_TENSORS.get(LAYOUTS.get(model_type), "lm_head.weight")
    return output not in files


def load_params(config: M.TransformerConfig, model_type: str, files: WeightFiles,
                dtype=np.float32) -> dict:
    """kvjax params (unrolled layers, NumPy arrays of `dtype`) from the files of a model of
    `model_type` described by `config` (`kvjax.hf.config.to_kvjax_config`)."""
    if config.scan_layers:
        raise ValueError("load_params builds unrolled layers; convert with "
                         "model.with_layer_layout")
    if model_type == "exaone":
        files = tensors.RenamedFiles(files, EXAONE_NAMES)
    params = Params(config, files, dtype)
    # DeepSeek's layers and their kin; the multi-token-prediction layers stored after the
    # last are left unread.
    deepseek = functools.partial(
        _llama_like, ffn=functools.partial(_dense_or_mixture_ffn, selection_bias="gate.",
                                           bias_as_row=False),
        unread=lambda name: _layer_number(name) >= config.num_decoder_layers)
    hunyuan = functools.partial(_llama_like, qk_norm_names=("query_layernorm", "key_layernorm"))
    mapper = {"llama": _llama_like, "fused": functools.partial(_llama_like, fused=True),
              "plain_mlp": functools.partial(_llama_like, plain_mlp=("c_fc", "c_proj")),
              "up_down_mlp": functools.partial(_llama_like, plain_mlp=("up_proj", "down_proj")),
              "nemotron": functools.partial(_llama_like, plain_mlp=("up_proj", "down_proj"),
                                            fold_unit_offset=True),
              "apertus": functools.partial(_llama_like, plain_mlp=("up_proj", "down_proj"),
                                           norms=_APERTUS_NORMS),
              "vaultgemma": functools.partial(_llama_like, norms=_PRE_FEEDFORWARD_NORMS),
              "hunyuan": hunyuan,
              "hunyuan_moe": functools.partial(hunyuan, experts=functools.partial(
                  _experts_apart, router="gate.wg.", shared="shared_mlp.")),
              "mixtral": functools.partial(_llama_like, experts=functools.partial(
                  _experts_apart, under="block_sparse_moe.", names=("w1", "w3", "w2"))),
              "granitemoe": functools.partial(_llama_like, experts=_experts_stacked),
              "granite_shared": functools.partial(_llama_like, ffn=_granite_shared_mlp),
              "gpt_oss": functools.partial(_llama_like, experts=_experts_interleaved),
              "glm": functools.partial(_llama_like, fused_mlp=True,
                                       norms=_GLM4_NORMS if config.sandwich_norms else None),
              "llama_pairs": _llama_like,
              # transformers leaves unread every tensor whose name holds "mtp" (ERNIE's
              # multi-token-prediction layers).
              "ernie_moe": functools.partial(_llama_like, ffn=_dense_or_mixture_ffn,
                                             unread=lambda name: "mtp" in name),
              "deepseek_moe": deepseek,
              "deepseek_latent": functools.partial(
                  deepseek, attention=latent_weights.read_latent_attention),
              "hyperclovax": functools.partial(
                  _llama_like, norms=_PERI_NORMS if config.sandwich_norms else None),
              "cohere": functools.partial(_llama_like, norm_bias=False),
              "nanochat": functools.partial(_llama_like, plain_mlp=("fc1", "fc2")),
              **gpt_weights.READERS}[LAYOUTS[model_type]]
    if LAYOUTS[model_type] in ROPE_ORDERS:
        mapper = functools.partial(mapper, rope_order=ROPE_ORDERS[LAYOUTS[model_type]])
    ignorable = mapper(config, params)
    return params.tree(ignorable)


# kvjax's norm -> the file's, per layer. Llama's "post_attention_layernorm" is the norm before
# the FFN; Gemma's is the one on the attention's output.
_NORMS = {"attention_block/norm": "input_layernorm", "ffn_block/norm": "post_attention_layernorm"}


# VaultGemma's: Gemma 2's before each sublayer, none on the outputs.
_PRE_FEEDFORWARD_NORMS = {"attention_block/norm": "input_layernorm",
                          "ffn_block/norm": "pre_feedforward_layernorm"}


_SANDWICH_NORMS = {"attention_block/norm": "input_layernorm",
                   "attention_block/post_norm": "post_attention_layernorm",
                   "ffn_block/norm": "pre_feedforward_layernorm",
                   "ffn_block/post_norm": "post_feedforward_layernorm"}


_OUTPUT_NORMS = {"attention_block/norm": "post_attention_layernorm",
                 "ffn_block/norm": "post_feedforward_layernorm"}  # OLMo's, on each output


_SHARED_NORM = {"attention_block/norm": "input_layernorm"}  # Cohere's parallel layer


_APERTUS_NORMS = {"attention_block/norm": "attention_layernorm",
                  "ffn_block/norm": "feedforward_layernorm"}


# HyperCLOVA X's Peri-LN: a norm before and after each sublayer.
_PERI_NORMS = {"attention_block/norm": "input_layernorm", "attention_block/post_norm": "post_norm1",
               "ffn_block/norm": "post_attention_layernorm", "ffn_block/post_norm": "post_norm2"}
_GLM4_NORMS = {"attention_block/norm": "input_layernorm",
               "attention_block/post_norm": "post_self_attn_layernorm",
               "ffn_block/norm": "post_attention_layernorm",
               "ffn_block/post_norm": "post_mlp_layernorm"}


def rope_halves_order(head_dim: int, rotary_dim: int) -> np.ndarray:
    """[H]: the order of a head's query or key dimensions that puts those RoPE turns in pairs
    (x[2i], x[2i + 1]) where kvjax turns halves (x[i], x[i + r/2]): the even ones first, then
    the odd ones, then those RoPE does not turn. Queries and keys reordered alike give the
    same products."""
    return np.concatenate([np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2),
                           np.arange(rotary_dim, head_dim)])


def swapped_halves_order(head_dim: int, rotary_dim: int) -> np.ndarray:
    """[H]: the order of a head's dimensions with the two halves RoPE turns swapped. RoPE
    turning each pair (x[i], x[i + r/2]) the other way (nanochat's) gives what kvjax's turn
    of (x[i + r/2], x[i]) gives, its two results swapped; queries and keys swapped alike,
    and normalised over the head as nanochat does after RoPE, give the same products."""
    half = rotary_dim // 2
    return np.concatenate([np.arange(half, rotary_dim), np.arange(half),
                           np.arange(rotary_dim, head_dim)])


# Layouts whose query and key rows kvjax holds in another order of each head's dimensions,
# where their RoPE turns pairs of them (GLM, Helium, ERNIE, Cohere, GPT-J) or turns the other way
# (nanochat): their rows are reordered as they are read (`rope_rows_in_kvjax_order`), and so
# are the rows of adapters of them (`peft.py`).
ROPE_ORDERS = {"glm": rope_halves_order, "llama_pairs": rope_halves_order,
               "ernie_moe": rope_halves_order,
               "cohere": rope_halves_order, "gptj": rope_halves_order,
               "nanochat": swapped_halves_order}


def rope_rows_in_kvjax_order(rows_OX: np.ndarray, heads: int, head_dim: int, rotary_dim: int,
                             layout: str, inverse: bool = False) -> np.ndarray:
    """A query or key projection's output rows [heads · H, X] with each head's reordered by
    the layout's `ROPE_ORDERS` (`inverse`: put back)."""
    order = ROPE_ORDERS[layout](head_dim, rotary_dim)
    if inverse:
        order = np.argsort(order)
    return rows_OX.reshape(heads, head_dim, -1)[:, order].reshape(rows_OX.shape)


def _llama_like(c: M.TransformerConfig, p: Params, fused: bool = False,
                plain_mlp: tuple[str, str] | None = None, experts=None,
                fused_mlp: bool = False, rope_order=None, norm_bias: bool = True,
                fold_unit_offset: bool = False, norms: dict[str, str] | None = None,
                qk_norm_names: tuple[str, str] = ("q_norm", "k_norm"), ffn=None,
                unread=lambda name: False, attention=None):
    """Llama and its kin, Gemma's, OLMo's and GLM-4's norms and StableLM's LayerNorms
    included. `fused` (Phi-3): q, k and v are rows of one `qkv_proj`, and the gate and up
    projections the two halves of one `gate_up_proj`; `fused_mlp` (GLM): the latter alone.
    `rope_order(head_dim, rotary_dim)` (GLM, nanochat): the order each head's query and key
    dimensions are put in here (`ROPE_ORDERS`). `norm_bias` False (Cohere): LayerNorms
    without a bias; with `shared_norm` the attention and the FFN read the input's one norm.
    `fold_unit_offset` (Nemotron): LayerNorms that scale by 1 + their weight, folded into
    the scale as it loads. `norms`: kvjax's norms and the file's names of them, where the
    config's layout does not say them (Apertus). `qk_norm_names`: the file's names of the
    norms over each head's query and key (HunYuan's `query_layernorm`, `key_layernorm`).
    `plain_mlp`: an FFN without a gate, its two projections' names (StarCoder2: `c_fc` then
    `c_proj`; Nemotron, Arcee: `up_proj` then `down_proj`). `experts(p, layer, dst, c)` reads
    a layer's mixture of experts (None: `_experts_apart` as Qwen3-MoE and OLMoE name
    them); `ffn(p, layer, dst, c)`, where given, reads every layer's FFN in their place, and
    `attention(p, layer, dst, c)` its attention (latent attention: `latent_weights.py`).
    `unread(name)`: the file's tensors that are left unread, as transformers leaves them."""
    d = c.d_model
    p.set("embedder/embedding/embedding", p.read("model.embed_tokens.weight",
                                                 (c.vocab_size, d)))
    for i in range(c.num_decoder_layers):
        src, dst = f"model.layers.{i}.", f"layers/{i}/"
        layer_norms = {} if not c.norm_params else norms or (
            _SANDWICH_NORMS if c.sandwich_norms else _OUTPUT_NORMS if c.norm == "output" else
            _SHARED_NORM if c.shared_norm else _NORMS)
        for kvjax_name, hf_name in layer_norms.items():
            tensors.norm(p, f"{src}{hf_name}", f"{dst}{kvjax_name}", c, norm_bias,
                         fold_unit_offset)
        (attention or functools.partial(_attention, fused=fused, rope_order=rope_order,
                                        qk_norm_names=qk_norm_names))(
            p, src, dst + "self_attention/", c)
        if ffn is not None:
            ffn(p, src, dst + "ffn/", c)
        elif c.num_experts:
            (experts or _experts_apart)(p, src, dst + "ffn/", c)
        else:
            _feed_forward(p, src + "mlp.", dst + "ffn/", c, fused or fused_mlp, plain_mlp)
    if c.norm_params:
        tensors.norm(p, "model.norm", "final_norm", c, norm_bias, fold_unit_offset)
    tensors.unembed(c, p, "lm_head.weight")
    if c.logits_bias:  # Phi-3.5-MoE's output layer
        p.set("embedder/logits_bias", p.read("lm_head.bias", (c.vocab_size,)))
    # Some files keep RoPE's frequencies as a buffer; kvjax computes them from config.json.
    return lambda name: name.endswith(".rotary_emb.inv_freq") or unread(name)


def _attention(p: Params, src: str, dst: str, c: M.TransformerConfig, fused: bool,
               rope_order, qk_norm_names: tuple[str, str]) -> None:
    """A layer's attention as `_llama_like` describes it (`dst`: its self_attention/)."""
    d, h = c.d_model, c.head_dim
    if fused:  # rows: the q heads, then the k heads, then the v heads
        heads = c.num_heads + 2 * c.kv_heads
        p.set(dst + "qkv/kernel", p.read(
            src + "self_attn.qkv_proj.weight", (heads * h, d)).T.reshape(d, heads, h))
    else:
        parts = [tensors.linear(p, f"{src}self_attn.{name}_proj", heads, h, d, c.qkv_bias)
                 for name, heads in (("q", c.num_heads), ("k", c.kv_heads),
                                     ("v", c.kv_heads))]
        if rope_order:  # q's and k's kernels [D, heads, H] and biases [heads, H]
            order = rope_order(h, c.rotary_dims)
            parts[:2] = [tuple(None if x is None else x[..., order] for x in part)
                         for part in parts[:2]]
        tensors.fused(p, dst + "qkv", parts)
    if c.qk_norm and c.norm_params:
        for name, file_name, heads in zip(("q_norm", "k_norm"), qk_norm_names,
                                          (c.num_heads, c.kv_heads), strict=True):
            width = heads * h if c.qk_norm_across_heads else h
            p.set(f"{dst}{name}/scale",
                  p.read(f"{src}self_attn.{file_name}.weight", (width,)))
    if c.attention_sinks:
        p.set(dst + "sinks", p.read(src + "self_attn.sinks", (c.num_heads,)))
    tensors.output(p, src + "self_attn.o_proj", dst + "out", c)


def _feed_forward(p: Params, src: str, dst: str, c: M.TransformerConfig, fused: bool,
                  plain_mlp: tuple[str, str] | None) -> None:
    d, f = c.d_model, c.d_ff
    if plain_mlp:
        up, down = plain_mlp
        tensors.dense(p, src + up, dst + "wi", (f, d), c.ffn_bias)
        tensors.dense(p, src + down, dst + "wo", (d, f), c.ffn_bias)
        if c.activation == "xielu":
            _xielu(p, src + "act_fn.", dst)
        return
    if fused:  # the gate's rows, then the up projection's
        gate_up = p.read(src + "gate_up_proj.weight", (2 * f, d))
        p.set(dst + "wi/kernel", gate_up[:f].T)
        p.set(dst + "wi_gate/kernel", gate_up[f:].T)
    else:
        tensors.dense(p, src + "gate_proj", dst + "wi", (f, d), c.ffn_bias)
        tensors.dense(p, src + "up_proj", dst + "wi_gate", (f, d), c.ffn_bias)
    tensors.dense(p, src + "down_proj", dst + "wo", (d, f), c.ffn_bias)


def _experts_apart(p: Params, layer: str, dst: str, c: M.TransformerConfig,
                   under: str = "mlp.", names=("gate_proj", "up_proj", "down_proj"),
                   shared: str = "shared_expert.", router: str = "gate.") -> None:
    """The router (`router` [E, D]) and each expert's gate, up and down projections
    (`names`), a tensor each, stacked on kvjax's experts axis; all `under` the layer's
    prefix. A shared expert is an FFN of Llama's names (`shared_expert.gate_proj`, ...), its
    gate `shared_expert_gate` [1, D]."""
    d, f, count = c.d_model, c.d_ff, c.num_experts
    src = layer + under
    p.set(dst + "router/kernel", p.read(src + router + "weight", (count, d)).T)
    for name, hf_name, shape, axis in zip(("wi", "wi_gate", "wo"), names,
                                          ((f, d), (f, d), (d, f)), (1, 1, 0), strict=True):
        p.set(dst + "experts/" + name, np.stack([
            p.read(f"{src}experts.{e}.{hf_name}.weight", shape).T for e in range(count)],
            axis=axis))
    if c.shared_expert_d_ff:
        _feed_forward(p, src + shared, dst + "shared_expert/",
                      c.replace(d_ff=c.shared_expert_d_ff), fused=False, plain_mlp=None)
    if c.shared_expert_gate:
        p.set(dst + "shared_expert_gate/kernel", p.read(src + "shared_expert_gate.weight",
                                                        (1, d)).T)


def _dense_or_mixture_ffn(p: Params, layer: str, dst: str, c: M.TransformerConfig,
                          selection_bias: str = "moe_statics.", bias_as_row: bool = True
                          ) -> None:
    """ERNIE 4.5's, GLM-4.5's and dots.llm1's: Llama's FFN in the dense layers; in the others
    the experts as Qwen3-MoE names them, the shared FFN under `shared_experts`, and each
    expert's bias of the choice `e_score_correction_bias` under `mlp.` + `selection_bias`
    (ERNIE's one row [1, E], `bias_as_row`; the others' [E])."""
    if int(layer.split(".")[-2]) in c.dense_ffn_layers:
        _feed_forward(p, layer + "mlp.", dst, c.replace(d_ff=c.dense_d_ff), fused=False,
                      plain_mlp=None)
        return
    _experts_apart(p, layer, dst, c, shared="shared_experts.")
    if not c.router_selection_bias:  # DeepSeek-V2's router has none
        return
    shape = (1, c.num_experts) if bias_as_row else (c.num_experts,)
    p.set(dst + "selection_bias", p.read(
        f"{layer}mlp.{selection_bias}e_score_correction_bias", shape).reshape(c.num_experts))


def _layer_number(name: str) -> int:
    """The layer a tensor's name puts it in (`model.layers.i.`...), -1 outside the layers."""
    match = re.match(r"model\.layers\.(\d+)\.", name)
    return int(match.group(1)) if match else -1


def _experts_stacked(p: Params, layer: str, dst: str, c: M.TransformerConfig) -> None:
    """GraniteMoE's: the router `router.layer` [E, D], every expert's gate and up projections
    in `input_linear` [E, 2F, D] (the gate's rows first), the down ones in `output_linear`
    [E, D, F]."""
    d, f, count = c.d_model, c.d_ff, c.num_experts
    src = layer + "block_sparse_moe."
    p.set(dst + "router/kernel", p.read(src + "router.layer.weight", (count, d)).T)
    gate_up = p.read(src + "input_linear.weight", (count, 2 * f, d)).transpose(2, 0, 1)
    p.set(dst + "experts/wi", gate_up[..., :f])
    p.set(dst + "experts/wi_gate", gate_up[..., f:])
    p.set(dst + "experts/wo", p.read(src + "output_linear.weight", (count, d, f)).transpose(
        0, 2, 1))


def _granite_shared_mlp(p: Params, layer: str, dst: str, c: M.TransformerConfig) -> None:
    """Granite's `shared_mlp`: its gate and up projections in `input_linear` [2F, D] (the
    gate's rows first), the down one in `output_linear` [D, F]; the layer's FFN, or its shared
    expert beside GraniteMoE's experts (`_experts_stacked`)."""
    if c.num_experts:
        _experts_stacked(p, layer, dst, c)
    f = c.shared_expert_d_ff if c.num_experts else c.d_ff
    if not f:
        return
    dst += "shared_expert/" if c.num_experts else ""
    gate_up = p.read(layer + "shared_mlp.input_linear.weight", (2 * f, c.d_model))
    p.set(dst + "wi/kernel", gate_up[:f].T)
    p.set(dst + "wi_gate/kernel", gate_up[f:].T)
    p.set(dst + "wo/kernel", p.read(layer + "shared_mlp.output_linear.weight",
                                    (c.d_model, f)).T)


def _experts_interleaved(p: Params, layer: str, dst: str, c: M.TransformerConfig) -> None:
    """gpt-oss's: the router `router` [E, D] with its bias [E]; every expert's gate and up
    projections in `experts.gate_up_proj` [E, D, 2F], a gate column then an up column in
    turn, their biases likewise in `gate_up_proj_bias` [E, 2F]; the down ones in `down_proj`
    [E, F, D] with `down_proj_bias` [E, D]. The releases hold both projections as MXFP4
    (`_blocks` and `_scales`, `mxfp4.py`), unpacked here."""
    d, f, count = c.d_model, c.d_ff, c.num_experts
    src = layer + "mlp."
    p.set(dst + "router/kernel", p.read(src + "router.weight", (count, d)).T)
    p.set(dst + "router/bias", p.read(src + "router.bias", (count,)))

    def experts(name, inputs, outputs):  # [E, inputs, outputs]
        if name + "_blocks" not in p.files:
            return p.read(name, (count, inputs, outputs))
        groups = -(-inputs // mxfp4.BLOCK)
        return mxfp4.unpack(p.read(name + "_blocks", (count, outputs, groups, 16)),
                            p.read(name + "_scales", (count, outputs, groups)))[:, :inputs]

    gate_up = experts(src + "experts.gate_up_proj", d, 2 * f)
    p.set(dst + "experts/wi", gate_up[..., 0::2].transpose(1, 0, 2))
    p.set(dst + "experts/wi_gate", gate_up[..., 1::2].transpose(1, 0, 2))
    gate_up_bias = p.read(src + "experts.gate_up_proj_bias", (count, 2 * f))
    p.set(dst + "experts/bi", gate_up_bias[:, 0::2])
    p.set(dst + "experts/bi_gate", gate_up_bias[:, 1::2])
    p.set(dst + "experts/wo", experts(src + "experts.down_proj", f, d))
    p.set(dst + "experts/bo", p.read(src + "experts.down_proj_bias", (count, d)))


def _xielu(p: Params, src: str, dst: str) -> None:
    """A layer's xIELU: its learned coefficients, and its fixed ones (buffers in the file),
    which must be those kvjax computes with."""
    for side in ("p", "n"):
        p.set(f"{dst}xielu_alpha_{side}", p.read(f"{src}alpha_{side}", (1,))[0])
    for name, value in (("beta", XIELU_BETA), ("eps", XIELU_EPS)):
        if f"{src}{name}" in p.files:
            held = float(p.read(f"{src}{name}", ()))
            if not np.isclose(held, value, rtol=1e-2, atol=0):
                raise UnsupportedModelError(f"{p.files.directory}: {src}{name} is {held}; "
                                            f"kvjax's xIELU takes {name} = {value}")
