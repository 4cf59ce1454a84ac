"""Flax Transformer models with an explicit, immutable KV cache."""

from .attention import attend
from .cache import KVCache, init_cache
from .cache_size import CacheSize, cache_size_bytes, generate_cache_bytes, paged_cache_bytes
from .config import PRESETS, SPEED_ONLY_FIELDS, TransformerConfig, preset
from .float32_params import cast_floats
from .interface import (
    build_model,
    check_prompt_length,
    hidden_logits,
    init_params,
    param_shapes,
    prefill,
    prompt_is_source,
    prompt_slots,
    row_cache,
    rows_in_rings,
    step_fn,
    target_start,
    teacher_forced_hidden,
    teacher_forced_logits,
)
from .layers import stack_layer_params, unstack_layer_params, with_layer_layout
from .lora import LoRA
from .paged import NO_PAGE, init_paged_cache
from .positional import PositionBias, alibi_slopes
from .precision import with_float_kernels, with_precision
from .transformer import DecoderOnlyLM, EncoderDecoder

__all__ = [
    "PRESETS", "SPEED_ONLY_FIELDS", "CacheSize", "DecoderOnlyLM", "EncoderDecoder", "KVCache",
    "LoRA", "PositionBias", "TransformerConfig",
    "NO_PAGE", "alibi_slopes", "attend", "build_model", "cache_size_bytes", "cast_floats",
    "check_prompt_length", "generate_cache_bytes", "init_cache", "init_paged_cache",
    "init_params", "paged_cache_bytes", "param_shapes", "prefill", "preset", "prompt_is_source",
    "prompt_slots", "row_cache", "rows_in_rings", "step_fn",
    "target_start", "teacher_forced_logits", "teacher_forced_hidden", "hidden_logits",
    "stack_layer_params", "unstack_layer_params", "with_float_kernels", "with_layer_layout",
    "with_precision",
]
