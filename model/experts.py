"""A mixture of experts in place of a decoder layer's dense FFN (`num_experts` > 0).

A router (a kernel [D, experts]) scores every expert for each token; the token goes through
the `experts_per_token` experts of highest softmax probability, and its output is theirs
summed, each weighted by its probability (divided by the chosen ones' sum under
`normalize_expert_weights`). An expert is an FFN like `FeedForward`'s, without biases:
W2 act(W1 x), or W2 (act(W1 x) * W3 x) for the gated activations. Params, beside the
router's: `experts/wi` and `experts/wi_gate` [experts, D, d_ff], `experts/wo` [experts,
d_ff, D].

Two ways to run the chosen experts compute the same sums; the shapes pick one while tracing:
- few pairs of a token and a chosen expert (decoding): each pair is multiplied by the
  weights of its expert, gathered, so a step reads only the chosen experts' weights, which
  is what a memory-bound step pays for;
- more pairs than experts (a prompt, training): the pairs sorted by expert and multiplied a
  group at a time (`jax.lax.ragged_dot`), each expert's weights read once for all its
  tokens; the backend decides how (grouped matmuls on GPUs and TPUs, every expert masked on
  the CPU).

The experts and the chosen experts have no shape letters of their own (docs/shapes.md has
none left): arrays are named for what they hold, their shapes given in brackets, where
`tokens` are the B·T rows of the call side by side and `pairs` are tokens × experts_per_token.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from .config import TransformerConfig
from .config_checks import GATED_ACTIVATIONS


def route(router_logits: jax.Array, experts_per_token: int, normalize: bool
          ) -> tuple[jax.Array, jax.Array]:
    """(weights [tokens, k] float32, experts [tokens, k] int32) of the k most probable experts
    of each token under a softmax over `router_logits` [tokens, experts], the weights divided
    by their sum when `normalize`."""
    probabilities = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probabilities, experts_per_token)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


class Experts(nn.Module):
    """The experts' FFNs, each pair of a token and a chosen expert through its expert."""

    config: TransformerConfig
    activation: Callable[[jax.Array], jax.Array]

    @nn.compact
    def __call__(self, x_BTD, weights, experts):
        """x_BTD's tokens through their chosen `experts` [tokens, k], summed with `weights`
        [tokens, k]: [B, T, D]."""
        c = self.config
        shape_in, shape_out = (c.num_experts, c.d_model, c.d_ff), (c.num_experts, c.d_ff,
                                                                   c.d_model)

        def kernel(name, shape):
            init = nn.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))
            return self.param(name, init, shape, c.weights_dtype).astype(c.compute_dtype)

        wi, wo = kernel("wi", shape_in), kernel("wo", shape_out)
        wi_gate = kernel("wi_gate", shape_in) if c.activation in GATED_ACTIVATIONS else None
        tokens = x_BTD.reshape(-1, c.d_model).astype(c.compute_dtype)
        k = c.experts_per_token
        pair_experts = experts.reshape(-1)  # [pairs], token-major
        if pair_experts.shape[0] < c.num_experts:
            pair_out = self._gathered(tokens, pair_experts, wi, wi_gate, wo)
        else:
            pair_out = self._grouped(tokens, pair_experts, wi, wi_gate, wo)
        pair_out = pair_out.reshape(tokens.shape[0], k, c.d_model).astype(jnp.float32)
        out = jnp.sum(pair_out * weights[..., None], axis=1)
        return out.astype(c.compute_dtype).reshape(x_BTD.shape)

    def _hidden(self, up, gate):
        h = self.activation(up)
        return h if gate is None else h * gate

    def _gathered(self, tokens, pair_experts, wi, wi_gate, wo):
        """[pairs, D]: each pair through its own expert's gathered weights."""
        x = jnp.repeat(tokens, self.config.experts_per_token, axis=0)[:, None, :]
        up = (x @ wi[pair_experts])
        gate = None if wi_gate is None else x @ wi_gate[pair_experts]
        return (self._hidden(up, gate) @ wo[pair_experts])[:, 0]

    def _grouped(self, tokens, pair_experts, wi, wi_gate, wo):
        """[pairs, D]: the pairs sorted by expert, each expert's group multiplied at once."""
        order = jnp.argsort(pair_experts, stable=True)
        sizes = jnp.bincount(pair_experts, length=self.config.num_experts).astype(jnp.int32)
        x = tokens[order // self.config.experts_per_token]
        up = jax.lax.ragged_dot(x, wi, sizes)
        gate = None if wi_gate is None else jax.lax.ragged_dot(x, wi_gate, sizes)
        sorted_out = jax.lax.ragged_dot(self._hidden(up, gate), wo, sizes)
        return jnp.zeros_like(sorted_out).at[order].set(sorted_out, unique_indices=True)


class MixtureOfExperts(nn.Module):
    """The router and the experts: [B, T, D] -> [B, T, D]. `activation` is the experts' (as
    `FeedForward` takes it from the config)."""

    config: TransformerConfig
    activation: Callable[[jax.Array], jax.Array]

    @nn.compact
    def __call__(self, x_BTD):
        c = self.config
        router = nn.Dense(c.num_experts, use_bias=False, dtype=c.compute_dtype,
                          param_dtype=c.weights_dtype, name="router")
        router_logits = router(x_BTD).reshape(-1, c.num_experts)
        weights, experts = route(router_logits, c.experts_per_token,
                                 c.normalize_expert_weights)
        return Experts(c, self.activation, name="experts")(x_BTD, weights, experts)
