"""The tensors of a Hugging Face directory's safetensors files, read into kvjax params.

The files are read tensor by tensor (`model.safetensors`, or the shards a
`model.safetensors.index.json` names), so a model is never held twice in memory. `Params`
builds the params tree leaf by leaf against the shapes the model needs: every param must come
from exactly one tensor of the right shape, and every tensor of the files must be used (or be
a known buffer that holds no weights). The helpers map torch's modules, which store a
`Linear` as [out, in], to kvjax's kernels; the families' readers (`weights.py`,
`gpt_weights.py`) call them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors import SafetensorError, safe_open

from kvjax import model as M
from kvjax.model.float32_params import keeps_float32

INDEX_FILE = "model.safetensors.index.json"


SINGLE_FILE = "model.safetensors"


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


class RenamedFiles:
    """`WeightFiles` whose tensors go by other names: each of `renames` (a pattern and its
    replacement) applied in turn to every name, as transformers renames a family's older
    files as it loads them. Two tensors renamed alike are refused."""

    def __init__(self, files: WeightFiles, renames: tuple[tuple[str, str], ...]):
        self.directory, self._files = files.directory, files
        self._original: dict[str, str] = {}
        for name in sorted(files.names()):
            new = name
            for pattern, replacement in renames:
                new = re.sub(pattern, replacement, new)
            if new in self._original:
                raise ValueError(f"{self.directory}: tensors {self._original[new]} and {name} "
                                 f"are both {new}")
            self._original[new] = name

    def names(self) -> set[str]:
        return set(self._original)

    def __contains__(self, name: str) -> bool:
        return name in self._original

    def read(self, name: str) -> np.ndarray:
        if name not in self._original:
            raise ValueError(f"{self.directory}: tensor {name} is missing")
        return self._files.read(self._original[name])


class Params:
    """Builds a params tree leaf by leaf against the shapes the model needs."""

    def __init__(self, config: M.TransformerConfig, files: WeightFiles, dtype):
        shapes = M.param_shapes(config)
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
        self.values[key] = value.astype(np.float32 if keeps_float32(key[-1]) else self.dtype)

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

def unembed(c: M.TransformerConfig, p: Params, name: str) -> None:
    if not c.tie_embeddings:
        p.set("embedder/unembed/kernel",
              p.read(name, (c.vocab_size, c.embedding_dim or c.d_model)).T)

def norm(p: Params, src: str, dst: str, c: M.TransformerConfig, bias: bool = True,
         fold_unit_offset: bool = False) -> None:
    """An RMSNorm's scale, or a LayerNorm's scale and bias (StableLM, StarCoder2; a bias of
    zeros where the file's LayerNorm has none, `bias` False: Cohere's; a scale of 1 + the
    file's weight, `fold_unit_offset`: Nemotron's LayerNorm1P)."""
    if c.norm_type == "layernorm":
        layer_norm(p, src, dst, c.d_model, bias, fold_unit_offset)
    else:
        p.set(dst + "/scale", p.read(src + ".weight", (c.d_model,)))

def layer_norm(p: Params, src: str, dst: str, width: int, bias: bool = True,
               fold_unit_offset: bool = False) -> None:
    scale = p.read(src + ".weight", (width,))
    p.set(dst + "/scale", scale + 1 if fold_unit_offset else scale)
    p.set(dst + "/bias", p.read(src + ".bias", (width,)) if bias else np.zeros_like(scale))

def linear(p: Params, name: str, heads: int, head_dim: int, d_model: int, bias: bool):
    """A torch Linear to heads: kernel [D, heads, H] and bias [heads, H] (or None)."""
    kernel = p.read(name + ".weight", (heads * head_dim, d_model)).T.reshape(
        d_model, heads, head_dim)
    return kernel, p.read(name + ".bias", (heads * head_dim,)).reshape(heads, head_dim) \
        if bias else None

def fused(p: Params, dst: str, parts) -> None:
    """Projections [(kernel, bias), ...] to heads, fused along the heads axis."""
    p.set(dst + "/kernel", np.concatenate([k for k, _ in parts], axis=1))
    if parts[0][1] is not None:
        p.set(dst + "/bias", np.concatenate([b for _, b in parts], axis=0))

def output(p: Params, name: str, dst: str, c: M.TransformerConfig) -> None:
    """A torch Linear from heads back to D: kernel [N, H, D] (and bias [D])."""
    weight = p.read(name + ".weight", (c.d_model, c.num_heads * c.head_dim))
    p.set(dst + "/kernel", weight.T.reshape(c.num_heads, c.head_dim, c.d_model))
    if c.out_bias:
        p.set(dst + "/bias", p.read(name + ".bias", (c.d_model,)))

def dense(p: Params, name: str, dst: str, shape_out_in, bias: bool) -> None:
    p.set(dst + "/kernel", p.read(name + ".weight", shape_out_in).T)
    if bias:
        p.set(dst + "/bias", p.read(name + ".bias", shape_out_in[:1]))
