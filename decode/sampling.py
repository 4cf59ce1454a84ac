"""Choosing the next token from logits: greedy, temperature, top-k and top-p, combinable.

Every setting is a traced value, so changing it never recompiles. Filtering and sampling run
in float32. Shapes: B batch, V vocab.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class SamplingParams:
    """Scalars shared by every row.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k: keep the k most likely tokens (0 = no limit; 1 = greedy).
    top_p: keep the smallest set of most likely tokens whose probability reaches p: the token
           whose cumulative probability crosses p is kept, and so is the argmax (1 = no limit).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array

    @classmethod
    def make(cls, temperature=0.0, top_k=0, top_p=1.0) -> SamplingParams:
        return cls(jnp.asarray(temperature, jnp.float32), jnp.asarray(top_k, jnp.int32),
                   jnp.asarray(top_p, jnp.float32))

    @property
    def is_greedy(self) -> jax.Array:
        return (self.temperature == 0) | (self.top_k == 1)


def filter_logits(logits_BV: jax.Array, params: SamplingParams) -> jax.Array:
    """Temperature-scaled logits with the tokens outside top-k and top-p set to -inf."""
    logits_BV = logits_BV.astype(jnp.float32) / jnp.maximum(params.temperature, 1e-6)
    vocab = logits_BV.shape[-1]
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    k = jnp.where(params.top_k > 0, jnp.minimum(params.top_k, vocab), vocab)
    kth_largest_B = sorted_BV[:, k - 1]
    # Nucleus over the top-k survivors: keep a sorted token while the probability mass
    # before it is still below p, so the token that crosses p is kept and the first always is.
    sorted_BV = jnp.where(jnp.arange(vocab) < k, sorted_BV, -jnp.inf)
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    keep_BV = (mass_before_BV < params.top_p) & (jnp.arange(vocab) < k)
    smallest_kept_B = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1)
    threshold_B = jnp.maximum(kth_largest_B, smallest_kept_B)
    return jnp.where(logits_BV >= threshold_B[:, None], logits_BV, -jnp.inf)


def sample(logits_BV: jax.Array, rng: jax.Array, params: SamplingParams) -> jax.Array:
    """Next token ids [B]. Greedy settings skip the sort and the random draw altogether."""

    def draw(logits):
        return jax.random.categorical(rng, filter_logits(logits, params), axis=-1)

    def argmax(logits):
        return jnp.argmax(logits, axis=-1)

    return jax.lax.cond(params.is_greedy, argmax, draw, logits_BV).astype(jnp.int32)
