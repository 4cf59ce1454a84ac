"""Weights of a Hugging Face directory (safetensors) as kvjax params.

The files are read tensor by tensor (`model.safetensors`, or the shards a
`model.safetensors.index.json` names), so a model is never held twice in memory. Names and
layouts are mapped per model type: torch's `Linear` stores [out, in] and is transposed,
GPT-2's `Conv1D` already stores [in, out]; q/k/v projections are fused into kvjax's one
[D, N + 2K, H] kernel. Every param the model needs must come from exactly one tensor of the
right shape, and every tensor of the files must be used (or be a known buffer that holds no
weights), so a mismatch is an error naming the tensor, never a silently random layer.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors import SafetensorError, safe_open

from kvjax import model as M
from kvjax.model.positional import sinusoidal

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# How each model type's files name and lay out its tensors: "llama" (Llama and its kin:
# q_proj, k_proj, v_proj, gate_proj, up_proj, down_proj under model.layers.i), "fused"
# (Phi-3: qkv_proj and gate_up_proj), "gpt2" (Conv1D's c_attn, c_proj, c_fc under
# transformer.h.i), "gpt_neox" (query_key_value, each head's q, k and v in turn, under
# gpt_neox.layers.i), "phi" (Phi-2: q_proj, k_proj, v_proj, dense, fc1, fc2, one norm a
# layer), "opt" (q_proj, k_proj, v_proj, out_proj, fc1, fc2 under model.decoder.layers.i),
# "plain_mlp" (Llama's attention, an FFN of c_fc and c_proj: StarCoder2), "mixtral" (Llama's
# attention, experts of w1, w3 and w2 under block_sparse_moe) and "marian" (an encoder and a
# decoder). Llama's layout holds experts too: gate_proj, up_proj and down_proj under mlp.
LAYOUTS = {"gpt2": "gpt2", "phi3": "fused", "marian": "marian", "gpt_neox": "gpt_neox",
           "phi": "phi", "opt": "opt", "starcoder2": "plain_mlp", "mixtral": "mixtral",
           **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "smollm3", "granite",
                            "gemma2", "gemma3_text", "olmo2", "olmo3", "stablelm", "gemma",
                            "qwen3_moe", "olmoe"), "llama")}
# The output layer's tensor, where it is not lm_head.weight.
_OUTPUT_TENSORS = {"gpt_neox": "embed_out.weight"}


def ties_embeddings(model_type: str, files: WeightFiles) -> bool:
    """Whether the model's output layer is its embedding table: its files hold no output
    layer of their own."""
    return _OUTPUT_TENSORS.get(LAYOUTS.get(model_type), "lm_head.weight") not in files


def heads_apart(rows_OX: np.ndarray, num_heads: int, head_dim: int) -> np.ndarray:
    """GPT-NeoX's query_key_value rows [N·3·H, X], each head's q, k and v in turn, in kvjax's
    order [3·N·H, X]: every q head, then every k head, then every v head."""
    return rows_OX.reshape(num_heads, 3, head_dim, -1).transpose(1, 0, 2, 3).reshape(
        3 * num_heads * head_dim, -1)


class WeightFiles:
    """The tensors in a directory's safetensors files, read one at a time as NumPy arrays
    (bfloat16 through ml_dtypes)."""

    def __init__(self, directory: str | os.PathLike, single_file: str = SINGLE_FILE):
        self.directory = Path(directory)
        self._file_of: dict[str, Path] = {}
        self._handles: dict[Path, Any] = {}  # one open file each, its header parsed once
        index = self.directory / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{index} is not a safetensors index ({e})") from None
            files = sorted(set(weight_map.values()))
            for name in files:
                if not (self.directory / name).is_file():
                    raise FileNotFoundError(f"{index} names the shard {name}, which is missing "
                                            f"from {self.directory}")
        elif (self.directory / single_file).is_file():
            files = [single_file]
        else:
            extra = (" (pytorch_model.bin is a pickle, which kvjax does not load: convert it to "
                     "safetensors)") if (self.directory / "pytorch_model.bin").exists() else ""
            raise FileNotFoundError(f"{self.directory} has no {single_file} or {INDEX_FILE}"
                                    f"{extra}")
        for name in files:
            path = self.directory / name
            for key in self._open(path).keys():
                self._file_of[key] = path

    def _open(self, path: Path):
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="flax")
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{path} is not a readable safetensors file (truncated or "
                                 f"damaged?): {e}") from None
        return self._handles[path]

    def names(self) -> set[str]:
        return set(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def read(self, name: str) -> np.ndarray:
        if name not in self._file_of:
            raise ValueError(f"{self.directory}: tensor {name} is missing")
        # On the host: the tensor is reshaped and transposed here before it goes to devices.
        with jax.default_device(jax.devices("cpu")[0]):
            return np.asarray(self._open(self._file_of[name]).get_tensor(name))


class _Params:
    """Builds a params tree leaf by leaf against the shapes the model needs."""

    def __init__(self, config: M.TransformerConfig, files: WeightFiles, dtype):
        shapes = jax.eval_shape(lambda: M.init_params(config, jax.random.key(0)))
        self.wanted = {_path(p): leaf.shape for p, leaf in
                       jax.tree_util.tree_leaves_with_path(shapes)}
        self.files, self.dtype = files, np.dtype(dtype)
        self.values: dict[tuple[str, ...], np.ndarray] = {}
        self.used: set[str] = set()

    def read(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        array = self.files.read(name)
        if array.shape != tuple(shape):
            raise ValueError(f"{self.files.directory}: tensor {name} has shape "
                             f"{list(array.shape)}, the config needs {list(shape)}")
        self.used.add(name)
        return array

    def set(self, path: str, value: np.ndarray) -> None:
        key = tuple(path.split("/"))
        if key not in self.wanted:
            raise AssertionError(f"kvjax has no param {path}")
        assert value.shape == self.wanted[key], (path, value.shape, self.wanted[key])
        self.values[key] = value.astype(self.dtype)

    def tree(self, ignorable: Callable[[str], bool]) -> dict:
        missing = sorted("/".join(k) for k in self.wanted if k not in self.values)
        if missing:
            raise AssertionError(f"params not filled: {missing}")
        unused = sorted(n for n in self.files.names() - self.used if not ignorable(n))
        if unused:
            raise ValueError(f"{self.files.directory}: tensors {unused[:5]} "
                             f"{'and more ' if len(unused) > 5 else ''}are not part of the "
                             "model kvjax builds from config.json")
        tree: dict[str, Any] = {}
        for key, value in self.values.items():
            node = tree
            for part in key[:-1]:
                node = node.setdefault(part, {})
            node[key[-1]] = value
        return tree


def _path(keys) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in keys)


def load_params(config: M.TransformerConfig, model_type: str, files: WeightFiles,
                dtype=np.float32) -> dict:
    """kvjax params (unrolled layers, NumPy arrays of `dtype`) from the files of a model of
    `model_type` described by `config` (`kvjax.hf.config.to_kvjax_config`)."""
    if config.scan_layers:
        raise ValueError("load_params builds unrolled layers; convert with "
                         "model.with_layer_layout")
    params = _Params(config, files, dtype)
    mapper = {"gpt2": _gpt2, "llama": _llama_like, "fused": functools.partial(
        _llama_like, fused=True), "plain_mlp": functools.partial(_llama_like, plain_mlp=True),
        "mixtral": functools.partial(_llama_like, experts=("block_sparse_moe.", "w1", "w3",
                                                           "w2")),
        "gpt_neox": _gpt_neox, "phi": _phi,
        "opt": _opt, "marian": _marian}[LAYOUTS[model_type]]
    ignorable = mapper(config, params)
    return params.tree(ignorable)


def _unembed(c: M.TransformerConfig, p: _Params, name: str) -> None:
    if not c.tie_embeddings:
        p.set("embedder/unembed/kernel", p.read(name, (c.vocab_size, c.d_model)).T)


def _gpt2(c: M.TransformerConfig, p: _Params):
    prefix = "transformer." if "transformer.wte.weight" in p.files else ""
    d, n, h, f = c.d_model, c.num_heads, c.head_dim, c.d_ff
    p.set("embedder/embedding/embedding", p.read(prefix + "wte.weight", (c.vocab_size, d)))
    p.set("embedder/position_embedding", p.read(prefix + "wpe.weight", (c.max_len, d)))
    for i in range(c.num_decoder_layers):
        src, dst = f"{prefix}h.{i}.", f"layers/{i}/"
        _layer_norm(p, src + "ln_1", dst + "attention_block/norm", d)
        _layer_norm(p, src + "ln_2", dst + "ffn_block/norm", d)
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
    _layer_norm(p, prefix + "ln_f", "final_norm", d)
    _unembed(c, p, "lm_head.weight")
    # Older GPT-2 files keep the causal mask as buffers; they hold no weights.
    return lambda name: name.endswith((".attn.bias", ".attn.masked_bias"))


def _norm(p: _Params, src: str, dst: str, c: M.TransformerConfig) -> None:
    """An RMSNorm's scale, or a LayerNorm's scale and bias (StableLM, StarCoder2)."""
    if c.norm_type == "layernorm":
        _layer_norm(p, src, dst, c.d_model)
    else:
        p.set(dst + "/scale", p.read(src + ".weight", (c.d_model,)))


def _layer_norm(p: _Params, src: str, dst: str, width: int) -> None:
    p.set(dst + "/scale", p.read(src + ".weight", (width,)))
    p.set(dst + "/bias", p.read(src + ".bias", (width,)))


def _linear(p: _Params, name: str, heads: int, head_dim: int, d_model: int, bias: bool):
    """A torch Linear to heads: kernel [D, heads, H] and bias [heads, H] (or None)."""
    kernel = p.read(name + ".weight", (heads * head_dim, d_model)).T.reshape(
        d_model, heads, head_dim)
    return kernel, p.read(name + ".bias", (heads * head_dim,)).reshape(heads, head_dim) \
        if bias else None


def _fused(p: _Params, dst: str, parts) -> None:
    """Projections [(kernel, bias), ...] to heads, fused along the heads axis."""
    p.set(dst + "/kernel", np.concatenate([k for k, _ in parts], axis=1))
    if parts[0][1] is not None:
        p.set(dst + "/bias", np.concatenate([b for _, b in parts], axis=0))


def _output(p: _Params, name: str, dst: str, c: M.TransformerConfig) -> None:
    """A torch Linear from heads back to D: kernel [N, H, D] (and bias [D])."""
    weight = p.read(name + ".weight", (c.d_model, c.num_heads * c.head_dim))
    p.set(dst + "/kernel", weight.T.reshape(c.num_heads, c.head_dim, c.d_model))
    if c.out_bias:
        p.set(dst + "/bias", p.read(name + ".bias", (c.d_model,)))


def _dense(p: _Params, name: str, dst: str, shape_out_in, bias: bool) -> None:
    p.set(dst + "/kernel", p.read(name + ".weight", shape_out_in).T)
    if bias:
        p.set(dst + "/bias", p.read(name + ".bias", shape_out_in[:1]))


# kvjax's norm -> the file's, per layer. Llama's "post_attention_layernorm" is the norm before
# the FFN; Gemma's is the one on the attention's output.
_NORMS = {"attention_block/norm": "input_layernorm", "ffn_block/norm": "post_attention_layernorm"}
_SANDWICH_NORMS = {"attention_block/norm": "input_layernorm",
                   "attention_block/post_norm": "post_attention_layernorm",
                   "ffn_block/norm": "pre_feedforward_layernorm",
                   "ffn_block/post_norm": "post_feedforward_layernorm"}
_OUTPUT_NORMS = {"attention_block/norm": "post_attention_layernorm",
                 "ffn_block/norm": "post_feedforward_layernorm"}  # OLMo's, on each output


def _llama_like(c: M.TransformerConfig, p: _Params, fused: bool = False,
                plain_mlp: bool = False, experts=("mlp.", "gate_proj", "up_proj", "down_proj")):
    """Llama and its kin, Gemma's and OLMo's norms and StableLM's LayerNorms included.
    `fused` (Phi-3): q, k and v are rows of one `qkv_proj`, and the gate and up projections
    the two halves of one `gate_up_proj`. `plain_mlp` (StarCoder2): an FFN without a gate,
    `c_fc` then `c_proj`. `experts`: where a mixture of experts lies in a layer and its
    experts' gate, up and down projections' names."""
    d, h = c.d_model, c.head_dim
    p.set("embedder/embedding/embedding", p.read("model.embed_tokens.weight",
                                                 (c.vocab_size, d)))
    for i in range(c.num_decoder_layers):
        src, dst = f"model.layers.{i}.", f"layers/{i}/"
        norms = (_SANDWICH_NORMS if c.sandwich_norms else
                 _OUTPUT_NORMS if c.norm == "output" else _NORMS)
        for kvjax_name, hf_name in norms.items():
            _norm(p, f"{src}{hf_name}", f"{dst}{kvjax_name}", c)
        if fused:  # rows: the q heads, then the k heads, then the v heads
            heads = c.num_heads + 2 * c.kv_heads
            p.set(dst + "self_attention/qkv/kernel", p.read(
                src + "self_attn.qkv_proj.weight", (heads * h, d)).T.reshape(d, heads, h))
        else:
            _fused(p, dst + "self_attention/qkv", [
                _linear(p, f"{src}self_attn.{name}_proj", heads, h, d, c.qkv_bias)
                for name, heads in (("q", c.num_heads), ("k", c.kv_heads),
                                    ("v", c.kv_heads))])
        if c.qk_norm:
            for name, heads in (("q_norm", c.num_heads), ("k_norm", c.kv_heads)):
                width = heads * h if c.qk_norm_across_heads else h
                p.set(f"{dst}self_attention/{name}/scale",
                      p.read(f"{src}self_attn.{name}.weight", (width,)))
        _output(p, src + "self_attn.o_proj", dst + "self_attention/out", c)
        if c.num_experts:
            _experts(p, src + experts[0], dst + "ffn/", c, experts[1:])
        else:
            _feed_forward(p, src + "mlp.", dst + "ffn/", c, fused, plain_mlp)
    _norm(p, "model.norm", "final_norm", c)
    _unembed(c, p, "lm_head.weight")
    # Some files keep RoPE's frequencies as a buffer; kvjax computes them from config.json.
    return lambda name: name.endswith(".rotary_emb.inv_freq")


def _feed_forward(p: _Params, src: str, dst: str, c: M.TransformerConfig, fused: bool,
                  plain_mlp: bool) -> None:
    d, f = c.d_model, c.d_ff
    if plain_mlp:
        _dense(p, src + "c_fc", dst + "wi", (f, d), c.ffn_bias)
        _dense(p, src + "c_proj", dst + "wo", (d, f), c.ffn_bias)
        return
    if fused:  # the gate's rows, then the up projection's
        gate_up = p.read(src + "gate_up_proj.weight", (2 * f, d))
        p.set(dst + "wi/kernel", gate_up[:f].T)
        p.set(dst + "wi_gate/kernel", gate_up[f:].T)
    else:
        _dense(p, src + "gate_proj", dst + "wi", (f, d), c.ffn_bias)
        _dense(p, src + "up_proj", dst + "wi_gate", (f, d), c.ffn_bias)
    _dense(p, src + "down_proj", dst + "wo", (d, f), c.ffn_bias)


def _experts(p: _Params, src: str, dst: str, c: M.TransformerConfig, names) -> None:
    """The router (`gate` [E, D]) and each expert's gate, up and down projections, stacked."""
    d, f, count = c.d_model, c.d_ff, c.num_experts
    p.set(dst + "router/kernel", p.read(src + "gate.weight", (count, d)).T)
    for name, hf_name, shape in zip(("wi", "wi_gate", "wo"), names, ((f, d), (f, d), (d, f)),
                                    strict=True):
        p.set(dst + "experts/" + name, np.stack([
            p.read(f"{src}experts.{e}.{hf_name}.weight", shape).T for e in range(count)]))


def _gpt_neox(c: M.TransformerConfig, p: _Params):
    d, n, h, f = c.d_model, c.num_heads, c.head_dim, c.d_ff
    p.set("embedder/embedding/embedding", p.read("gpt_neox.embed_in.weight", (c.vocab_size, d)))
    for i in range(c.num_decoder_layers):
        src, dst = f"gpt_neox.layers.{i}.", f"layers/{i}/"
        _layer_norm(p, src + "input_layernorm", dst + "attention_block/norm", d)
        _layer_norm(p, src + "post_attention_layernorm", dst + "ffn_block/norm", d)
        qkv = p.read(src + "attention.query_key_value.weight", (3 * n * h, d))
        p.set(dst + "self_attention/qkv/kernel", heads_apart(qkv, n, h).T.reshape(d, 3 * n, h))
        if c.qkv_bias:
            bias = p.read(src + "attention.query_key_value.bias", (3 * n * h,))
            p.set(dst + "self_attention/qkv/bias", heads_apart(bias, n, h).reshape(3 * n, h))
        _output(p, src + "attention.dense", dst + "self_attention/out", c)
        _dense(p, src + "mlp.dense_h_to_4h", dst + "ffn/wi", (f, d), True)
        _dense(p, src + "mlp.dense_4h_to_h", dst + "ffn/wo", (d, f), True)
    _layer_norm(p, "gpt_neox.final_layer_norm", "final_norm", d)
    _unembed(c, p, _OUTPUT_TENSORS["gpt_neox"])
    # Older files keep the causal mask and RoPE's frequencies as buffers.
    return lambda name: name.endswith((".attention.bias", ".attention.masked_bias",
                                       ".rotary_emb.inv_freq"))


def _opt(c: M.TransformerConfig, p: _Params):
    prefix = "model.decoder." if "model.decoder.embed_tokens.weight" in p.files else "decoder."
    d, f, n, h = c.d_model, c.d_ff, c.num_heads, c.head_dim
    p.set("embedder/embedding/embedding", p.read(prefix + "embed_tokens.weight",
                                                 (c.vocab_size, d)))
    # Position i is the table's row i + 2 (OPT offsets the positions by two).
    p.set("embedder/position_embedding",
          p.read(prefix + "embed_positions.weight", (c.max_len + 2, d))[2:])
    for i in range(c.num_decoder_layers):
        src, dst = f"{prefix}layers.{i}.", f"layers/{i}/"
        _layer_norm(p, src + "self_attn_layer_norm", dst + "attention_block/norm", d)
        _fused(p, dst + "self_attention/qkv", [
            _linear(p, f"{src}self_attn.{name}_proj", n, h, d, c.qkv_bias)
            for name in ("q", "k", "v")])
        _output(p, src + "self_attn.out_proj", dst + "self_attention/out", c)
        _layer_norm(p, src + "final_layer_norm", dst + "ffn_block/norm", d)
        _dense(p, src + "fc1", dst + "ffn/wi", (f, d), c.ffn_bias)
        _dense(p, src + "fc2", dst + "ffn/wo", (d, f), c.ffn_bias)
    _layer_norm(p, prefix + "final_layer_norm", "final_norm", d)
    _unembed(c, p, "lm_head.weight")
    return lambda name: False


def _phi(c: M.TransformerConfig, p: _Params):
    d, f = c.d_model, c.d_ff
    p.set("embedder/embedding/embedding", p.read("model.embed_tokens.weight",
                                                 (c.vocab_size, d)))
    for i in range(c.num_decoder_layers):
        src, dst = f"model.layers.{i}.", f"layers/{i}/"
        _layer_norm(p, src + "input_layernorm", dst + "attention_block/norm", d)
        _fused(p, dst + "self_attention/qkv", [
            _linear(p, f"{src}self_attn.{name}_proj", heads, c.head_dim, d, True)
            for name, heads in (("q", c.num_heads), ("k", c.kv_heads), ("v", c.kv_heads))])
        _output(p, src + "self_attn.dense", dst + "self_attention/out", c)
        _dense(p, src + "mlp.fc1", dst + "ffn/wi", (f, d), True)
        _dense(p, src + "mlp.fc2", dst + "ffn/wo", (d, f), True)
    _layer_norm(p, "model.final_layernorm", "final_norm", d)
    _unembed(c, p, "lm_head.weight")
    p.set("embedder/logits_bias", p.read("lm_head.bias", (c.vocab_size,)))
    return lambda name: name.endswith(".rotary_emb.inv_freq")


def _marian(c: M.TransformerConfig, p: _Params):
    d, n, f = c.d_model, c.num_heads, c.d_ff
    shared = p.read("model.shared.weight", (c.vocab_size, d))
    p.set("embedder/embedding/embedding", shared)
    for part in ("encoder", "decoder"):
        name = f"model.{part}.embed_tokens.weight"
        if name in p.files and not np.array_equal(p.read(name, shared.shape), shared):
            raise ValueError(f"{p.files.directory}: {name} differs from model.shared.weight; "
                             "kvjax's encoder and decoder share one embedding table")
    for part, stack, count in (("encoder", "encoder_layers", c.num_encoder_layers),
                               ("decoder", "decoder_layers", c.num_decoder_layers)):
        for i in range(count):
            src, dst = f"model.{part}.layers.{i}.", f"{stack}/{i}/"
            _fused(p, dst + "self_attention/qkv", [
                _linear(p, f"{src}self_attn.{name}_proj", n, c.head_dim, d, True)
                for name in ("q", "k", "v")])
            _output(p, src + "self_attn.out_proj", dst + "self_attention/out", c)
            _layer_norm(p, src + "self_attn_layer_norm", dst + "attention_block/norm", d)
            _dense(p, src + "fc1", dst + "ffn/wi", (f, d), True)
            _dense(p, src + "fc2", dst + "ffn/wo", (d, f), True)
            _layer_norm(p, src + "final_layer_norm", dst + "ffn_block/norm", d)
            if part == "decoder":
                query, query_bias = _linear(p, src + "encoder_attn.q_proj", n, c.head_dim, d,
                                            True)
                p.set(dst + "cross_attention/query/kernel", query)
                p.set(dst + "cross_attention/query/bias", query_bias)
                _fused(p, f"cross_kv/{i}/kv", [
                    _linear(p, f"{src}encoder_attn.{name}_proj", n, c.head_dim, d, True)
                    for name in ("k", "v")])
                _output(p, src + "encoder_attn.out_proj", dst + "cross_attention/out", c)
                _layer_norm(p, src + "encoder_attn_layer_norm", dst + "cross_block/norm", d)
    p.set("embedder/logits_bias", p.read("final_logits_bias", (1, c.vocab_size))[0])
    _unembed(c, p, "lm_head.weight")
    for part in ("encoder", "decoder"):
        _check_sinusoids(p, f"model.{part}.embed_positions.weight", c)
    return lambda name: False


def _check_sinusoids(p: _Params, name: str, c: M.TransformerConfig) -> None:
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
