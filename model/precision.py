"""A model in another precision for decoding: its params cast, its config told.

`with_precision(config, params, "bfloat16")` holds the params in bfloat16 and computes in it,
so the cache (which follows the compute dtype) is bfloat16 too; `cache_dtype="int8"` keeps
K and V as int8 with scales whatever the compute dtype (`model/quantize.py`), and
`kernel_dtype="int8"` holds the layers' self-attention, FFN and expert kernels as int8 with
a scale per output feature, and the embedding table with a scale per row
(`model/int8_base.py`): about half the weights' memory of bfloat16 (norms, biases, learned
positions, routers and cross-attention stay in `dtype`). Logits
and the attention softmax stay float32 either way (`Embedder.logits`, `model/attention.py`).
For training in bfloat16 set only the config's `dtype`: the params and the optimizer state
stay float32 (`kvjax train --dtype bfloat16`).
"""

from __future__ import annotations

from typing import Any

from . import int8_base
from .config import TransformerConfig
from .config_checks import CACHE_DTYPES, DTYPES, KERNEL_DTYPES
from .float32_params import cast_floats


def with_precision(config: TransformerConfig, params: Any, dtype: str | None = None,
                   cache_dtype: str | None = None, kernel_dtype: str | None = None
                   ) -> tuple[TransformerConfig, Any]:
    """`(config, params)` computing in `dtype` with params of `dtype` (None: as they are),
    a KV cache of `cache_dtype` (None: as the config says), and the layers' kernels in
    `kernel_dtype` (None: as they are; "int8" quantizes them as they are in `dtype`). The
    scales of int8 kernels and a router's selection bias stay float32 (`float32_params.py`)."""
    changes: dict[str, Any] = {}
    if dtype is not None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {DTYPES}")
        changes.update(dtype=dtype, param_dtype=dtype)
    if cache_dtype is not None:
        if cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype={cache_dtype!r} is not one of {CACHE_DTYPES}")
        changes["cache_dtype"] = cache_dtype
    if kernel_dtype is not None:
        if kernel_dtype not in KERNEL_DTYPES:
            raise ValueError(f"kernel_dtype={kernel_dtype!r} is not one of {KERNEL_DTYPES}")
        changes["kernel_dtype"] = kernel_dtype
    if dtype is not None:
        params = cast_floats(params, dtype)
    if kernel_dtype is not None and config.kernel_dtype is None:
        params = int8_base.quantize_for_decoding(params)
    return config.replace(**changes), params


def with_float_kernels(config: TransformerConfig, params: Any) -> tuple[TransformerConfig, Any]:
    """`(config, params)` of a model of int8 weights (`kernel_dtype="int8"`) as the float
    model of its dequantized weights, in its `param_dtype`, which computes what it computes
    (what training and merging adapters start from); any other model as it is."""
    if config.kernel_dtype is None:
        return config, params
    params = cast_floats(int8_base.dequantize_layers(params), config.weights_dtype)
    return config.replace(kernel_dtype=None), params

