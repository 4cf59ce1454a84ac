"""The position-wise feed-forward network, and the activation a config names: of one
projection (`activation_function`), or of two for the gated ones (`gated_units`), or xIELU
(Apertus), whose two coefficients each layer learns (`xielu`)."""

from __future__ import annotations

import math
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
        elif c.activation == "xielu":
            alphas = [self.param(f"xielu_alpha_{side}", nn.initializers.constant(
                XIELU_INIT[side]), (), c.weights_dtype) for side in ("p", "n")]
            h = xielu(h, *alphas)
        else:
            h = activation_function(c.activation)(h)
        return adapted(c.d_model, "wo", h)


# xIELU's fixed coefficients and, for a model drawn at random, its learned ones as Apertus
# starts them: softplus(alpha_p) = 0.8 and beta + softplus(alpha_n) = 0.8.
XIELU_BETA, XIELU_EPS = 0.5, -1e-6
XIELU_INIT = {"p": math.log(math.expm1(0.8)), "n": math.log(math.expm1(0.8 - XIELU_BETA))}


def xielu(x, alpha_p, alpha_n):
    """xIELU (arXiv 2411.13010): a_p x² + beta x for x > 0, and a_n (e^min(x, eps) - 1 - x)
    + beta x elsewhere, with a_p = softplus(alpha_p) and a_n = beta + softplus(alpha_n)."""
    a_p = jax.nn.softplus(alpha_p).astype(x.dtype)
    a_n = (XIELU_BETA + jax.nn.softplus(alpha_n)).astype(x.dtype)
    negative = (jnp.expm1(jnp.minimum(x, XIELU_EPS)) - x) * a_n
    return jnp.where(x > 0, a_p * x * x, negative) + XIELU_BETA * x


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
