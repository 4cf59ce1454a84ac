"""Flax Transformer models with an explicit, immutable KV cache."""

import functools

import jax
import jax.numpy as jnp

from model.attention import attend
from model.cache import KVCache, init_cache
from model.config import PRESETS, CacheSize, TransformerConfig, cache_size_bytes, preset
from model.transformer import DecoderOnlyLM, EncoderDecoder, unstack_layer_params


def build_model(config: TransformerConfig) -> DecoderOnlyLM | EncoderDecoder:
    """The variant the config describes: an encoder-decoder iff `num_encoder_layers > 0`."""
    return EncoderDecoder(config) if config.is_encoder_decoder else DecoderOnlyLM(config)


@functools.partial(jax.jit, static_argnums=0)
def init_params(config: TransformerConfig, rng: jax.Array) -> dict:
    """Randomly initialised params (a pytree) for `build_model(config)`.

    Jitted: tracing Flax's init eagerly is slower than compiling it."""
    model = build_model(config)
    tokens = jnp.zeros((1, 1), jnp.int32)
    args = (tokens, tokens) if config.is_encoder_decoder else (tokens,)
    return model.init(rng, *args)["params"]


__all__ = [
    "PRESETS", "CacheSize", "DecoderOnlyLM", "EncoderDecoder", "KVCache", "TransformerConfig",
    "attend", "build_model", "cache_size_bytes", "init_cache", "init_params", "preset",
    "unstack_layer_params",
]
