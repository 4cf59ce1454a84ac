"""The position-wise feed-forward network, and the activation function a config names."""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax

from .config import TransformerConfig
from .config_checks import GATED_ACTIVATIONS

_FUNCTIONS = {
    "relu": nn.relu,
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

        width = self.d_ff or c.d_ff
        h = activation_function(c.activation)(dense(width, "wi")(x_BTD))
        if c.activation in GATED_ACTIVATIONS:
            h = h * dense(width, "wi_gate")(x_BTD)
        return dense(c.d_model, "wo")(h)


def activation_function(name: str) -> Callable[[jax.Array], jax.Array]:
    """The function of `config.activation` `name`: of W1 x alone for a gated activation, whose
    product with W3 x the caller takes."""
    return _FUNCTIONS[name]
