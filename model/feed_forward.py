"""The position-wise feed-forward network, and the activation a config names: of one
projection (`activation_function`), or of two for the gated ones (`gated_units`)."""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from . import lora_rows
from .config import TransformerConfig
from .config_checks import GATED_ACTIVATIONS

_FUNCTIONS = {
    "relu": nn.relu,
    "relu2": lambda x: jnp.square(nn.relu(x)),
    "gelu": lambda x: nn.gelu(x, approximate=True),
    "gelu_exact": lambda x: nn.gelu(x, approximate=False),
    "silu": nn.silu,
    "swiglu": nn.silu,  # of W1 x, gated by W3 x
    "geglu": lambda x: nn.gelu(x, approximate=True),  # of W1 x, gated by W3 x
}


class FeedForward(nn.Module):
    """Position-wise FFN: W2 act(W1 x), or W2 (act(W1 x) * W3 x) for the gated ones (SwiGLU,
    GeGLU), of `d_ff` hidden units (the config's unless given). [B,T,D]->[B,T,D]."""

    config: TransformerConfig
    d_ff: int | None = None

    @nn.compact
    def __call__(self, x_BTD):
        c = self.config

        def dense(features, name):
            return nn.Dense(features, use_bias=c.ffn_bias, dtype=c.compute_dtype,
                            param_dtype=c.weights_dtype, name=name)

        def adapted(features, name, x):  # with each row's adapter, where served so
            return lora_rows.add_update(self, name, x, dense(features, name)(x))

        width = self.d_ff or c.d_ff
        h = adapted(width, "wi", x_BTD)
        if c.activation in GATED_ACTIVATIONS:
            h = gated_units(c)(h, adapted(width, "wi_gate", x_BTD))
        else:
            h = activation_function(c.activation)(h)
        return adapted(c.d_model, "wo", h)


def activation_function(name: str) -> Callable[[jax.Array], jax.Array]:
    """The function of an ungated `config.activation` `name`."""
    return _FUNCTIONS[name]


def gated_units(config: TransformerConfig) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The hidden units of a gated activation from W1 x and W3 x: act(W1 x) · W3 x, or for
    "clamped_swiglu" (gpt-oss) g · σ(alpha · g) · (clip(W3 x, ±limit) + 1) with
    g = min(W1 x, limit)."""
    if config.activation != "clamped_swiglu":
        act = _FUNCTIONS[config.activation]
        return lambda gate, linear: act(gate) * linear
    alpha, limit = config.swiglu_alpha, config.swiglu_limit

    def clamped(gate, linear):
        gate = jnp.minimum(gate, limit)
        return gate * jax.nn.sigmoid(alpha * gate) * (jnp.clip(linear, -limit, limit) + 1)

    return clamped
