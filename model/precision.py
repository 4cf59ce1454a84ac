"""A model in another precision for decoding: its params cast, its config told.

`with_precision(config, params, "bfloat16")` holds the params in bfloat16 and computes in it,
so the cache (which follows the compute dtype) is bfloat16 too; `cache_dtype="int8"` keeps
K and V as int8 with scales whatever the compute dtype (`model/quantize.py`). Logits and the
attention softmax stay float32 either way (`Embedder.logits`, `model/attention.py`).
For training in bfloat16 set only the config's `dtype`: the params and the optimizer state
stay float32 (`kvjax train --dtype bfloat16`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .config import TransformerConfig
from .config_checks import CACHE_DTYPES, DTYPES


def with_precision(config: TransformerConfig, params: Any, dtype: str | None = None,
                   cache_dtype: str | None = None) -> tuple[TransformerConfig, Any]:
    """`(config, params)` computing in `dtype` with params of `dtype` (None: as they are)
    and a KV cache of `cache_dtype` (None: as the config says)."""
    changes: dict[str, Any] = {}
    if dtype is not None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {DTYPES}")
        changes.update(dtype=dtype, param_dtype=dtype)
        params = jax.tree.map(
            lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    if cache_dtype is not None:
        if cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype={cache_dtype!r} is not one of {CACHE_DTYPES}")
        changes["cache_dtype"] = cache_dtype
    return config.replace(**changes), params
