"""Argument checks for the generation API, run in Python before anything is compiled.

Each returns the value in the one type the compiled code takes, or raises a ValueError that
names the argument, the bad value and what was expected. Nothing is rounded or truncated:
5.0 is not a token id, 2.5 is not a top_k, True is not a count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import model as M

_PROMPTS = "prompts must be a list of token-id lists or an int array [batch, length]"


INT32_MAX = 2**31 - 1  # the largest value of an int32, the dtype of counts on the device


class InvalidValue(ValueError):
    """A ValueError about one argument, named in `name` (e.g. "top_k" or "top_p[1]")."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


def is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def integer(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """`value` as an int; it must be an int (not a float or bool) in [minimum, maximum]."""
    if not is_int(value):
        raise InvalidValue(name, f"{name}={value!r} must be an int, not a "
                                 f"{type(value).__name__}")
    if value < minimum:
        raise InvalidValue(name, f"{name}={value} must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise InvalidValue(name, f"{name}={value} must be <= {maximum}")
    return int(value)


def real(name: str, value: Any, ok: Callable[[float], bool], expected: str,
         stored_as: Any = None) -> float:
    """`value` as a float; it must be a finite real number for which `ok` holds (`expected`
    says which, e.g. "in (0, 1]"; NaN and infinity are refused whatever `ok` says). With
    `stored_as` (a dtype such as float32, that of the compiled code), the value rounded to
    it must pass too: 1e-50 is > 0, but 0 in float32."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.integer |
                                                             np.floating):
        raise InvalidValue(name, f"{name}={value!r} must be a real number, not a "
                                 f"{type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise InvalidValue(name, f"{name}={value} must be finite")
    if not ok(value):
        raise InvalidValue(name, f"{name}={value} must be {expected}")
    if stored_as is not None:
        with np.errstate(over="ignore", under="ignore"):
            stored = float(np.asarray(value, stored_as))
        if not (math.isfinite(stored) and ok(stored)):
            raise InvalidValue(name, f"{name}={value} is {stored} as "
                                     f"{np.dtype(stored_as).name}, the dtype it is used in, "
                                     f"where it must be {expected} too")
    return value


def token_ids(name: str, values: Any) -> tuple[int, ...]:
    """A sequence of int token ids (e.g. eos_ids) as a tuple."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence | np.ndarray):
        raise ValueError(f"{name} must be a sequence of int token ids, got {values!r}")
    for value in values:
        if not is_int(value):
            raise ValueError(f"{name}: {value!r} is not an int token id")
    return tuple(int(v) for v in values)


def prompt_array(prompts: Any, lengths: Any) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int64 [B, P], lengths int64 [B]) from a list of token-id lists or an int array
    [B, P] with optional `lengths` [B]. Empty prompts are left to `validate`, which names them."""
    if isinstance(prompts, np.ndarray | jax.Array):
        return _from_array(np.asarray(prompts), lengths)
    if lengths is not None:
        raise ValueError("lengths are only given with an array of prompts, not token lists")
    if isinstance(prompts, str | bytes):
        raise ValueError(f"{_PROMPTS}, not a {type(prompts).__name__}: encode the text first")
    if not isinstance(prompts, Sequence):
        raise ValueError(f"{_PROMPTS}, not a {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    if all(is_int(p) for p in prompts):
        raise ValueError(f"{_PROMPTS}, not a flat list of ints (a batch of one prompt is "
                         f"written [{list(prompts)!r:.60}])")
    rows = []
    for i, row in enumerate(prompts):
        if isinstance(row, np.ndarray | jax.Array):
            row = np.asarray(row)
            if row.ndim != 1 or not (np.issubdtype(row.dtype, np.integer) or row.size == 0):
                raise ValueError(f"prompt {i} must be a 1-D int array, got dtype {row.dtype} "
                                 f"and shape {row.shape}")
            row = row.tolist()
        elif isinstance(row, str | bytes) or not isinstance(row, Sequence):
            raise ValueError(f"prompt {i} must be a list of int token ids, got {row!r:.60}")
        for j, token in enumerate(row):
            if not is_int(token):
                raise ValueError(f"prompt {i}, position {j}: {token!r} is not an int token id")
        rows.append([int(t) for t in row])
    lengths = np.array([len(r) for r in rows], np.int64)
    tokens = np.zeros((len(rows), max(1, int(lengths.max()))), np.int64)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = row
    return tokens, lengths


def _from_array(tokens: np.ndarray, lengths: Any) -> tuple[np.ndarray, np.ndarray]:
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"prompts must be an int array [batch, length], got dtype "
                         f"{tokens.dtype} and shape {tokens.shape}")
    if tokens.shape[0] == 0:  # rows without tokens are named by `validate`
        raise ValueError(f"prompts is empty (shape {tokens.shape}): give at least one prompt")
    if lengths is None:
        lengths = np.full(tokens.shape[0], tokens.shape[1])
    lengths = np.asarray(lengths)
    if not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"lengths must be ints, got dtype {lengths.dtype}")
    lengths = lengths.astype(np.int64)
    if lengths.shape != (tokens.shape[0],) or (lengths > tokens.shape[1]).any():
        raise ValueError(f"lengths {lengths.tolist()} do not fit prompts of shape "
                         f"{tokens.shape}")
    return tokens, lengths


def check_params(config: M.TransformerConfig, params) -> None:
    """Raises a ValueError naming the first param whose presence, shape or dtype differs."""
    want = dict(jax.tree_util.tree_leaves_with_path(M.param_shapes(config)))
    have = dict(jax.tree_util.tree_leaves_with_path(params))
    for path in sorted(set(want) | set(have), key=jax.tree_util.keystr):
        name = jax.tree_util.keystr(path)
        if path not in have:
            raise ValueError(f"params do not match the model: {name} is missing")
        if path not in want:
            raise ValueError(f"params do not match the model: unexpected {name}")
        w, h = want[path], have[path]
        if tuple(h.shape) != w.shape or jnp.dtype(h.dtype) != w.dtype:
            raise ValueError(f"params do not match the model: {name} has shape {tuple(h.shape)} "
                             f"{jnp.dtype(h.dtype)}, the model needs {w.shape} {w.dtype}")
