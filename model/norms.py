"""The normalisations: LayerNorm (flax's) or RMSNorm, as `config.norm_type` names them, with
learned parameters unless `config.norm_params` is off."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from .config import TransformerConfig


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x²) + eps) * scale over the last axis, normalised in float32 and cast
    back before the scale (as Llama does). With `norm_unit_offset` it multiplies by
    (1 + scale) instead, the scale starting at 0, and casts after (as Gemma does); without
    `norm_params` there is no scale."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x):
        c = self.config
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True)
                                     + c.layer_norm_eps)
        if not c.norm_params:
            return normed.astype(c.compute_dtype)
        init = nn.initializers.zeros_init() if c.norm_unit_offset else nn.initializers.ones_init()
        scale = self.param("scale", init, (x.shape[-1],), c.weights_dtype)
        if c.norm_unit_offset:
            return (normed * (1.0 + scale.astype(jnp.float32))).astype(c.compute_dtype)
        return normed.astype(c.compute_dtype) * scale.astype(c.compute_dtype)


def make_norm(config: TransformerConfig, name: str) -> nn.Module:
    """The normalisation `config.norm_type` names: LayerNorm (scale and bias) or RMSNorm."""
    if config.norm_type == "rmsnorm":
        return RMSNorm(config, name=name)
    return nn.LayerNorm(epsilon=config.layer_norm_eps, dtype=config.compute_dtype,
                        param_dtype=config.weights_dtype, use_bias=config.norm_params,
                        use_scale=config.norm_params, name=name)
