"""Choosing the next token from logits: greedy, temperature, top-k, top-p and min-p, combinable.

Every setting is a traced value with one entry per row, so changing it (or mixing greedy and
sampled rows in one batch) never recompiles. Filtering and sampling run in float32.

Each row draws with a key of its own (`row_keys`): the t-th token of a row is drawn with
`fold_in(row key, t)`, so what a row samples depends on its key, its logits and its settings,
never on the other rows of its batch. `generate` and the server's engine draw the same way:
a request served with seed s makes the tokens `generate` makes with `rng=[seed_key(s)]`.
Shapes: B batch, V vocab, P prompts.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class SamplingParams:
    """Per-row settings, each [B] (a scalar is broadcast to every row).

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k: keep the k most likely tokens (0 = no limit; 1 = greedy).
    top_p: keep the smallest set of most likely tokens whose probability reaches p: the token
           whose cumulative probability crosses p is kept, and so is the argmax (1 = no limit).
    min_p: keep the tokens whose probability is at least min_p times the most likely
           token's (after temperature; 0 = no limit).
    repetition_penalty: for tokens already in the row's context (prompt and output), positive
           logits are divided by it and negative ones multiplied (1 = off). See processors.py.
    no_repeat_ngram_size: n > 0 bans every token that would repeat an n-gram of the row's
           context (0 = off). See processors.py.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    no_repeat_ngram_size: jax.Array

    @classmethod
    def make(cls, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
             no_repeat_ngram_size=0, batch: int | None = None) -> SamplingParams:
        """Scalars or [B] arrays; with `batch`, every field is broadcast to [batch], so that
        scalar and per-row settings share one compiled program."""

        def field(value, dtype):
            value = jnp.asarray(value, dtype)
            return value if batch is None else jnp.broadcast_to(value, (batch,))

        return cls(field(temperature, jnp.float32), field(top_k, jnp.int32),
                   field(top_p, jnp.float32), field(min_p, jnp.float32),
                   field(repetition_penalty, jnp.float32),
                   field(no_repeat_ngram_size, jnp.int32))

    def rows(self, batch: int) -> SamplingParams:
        """Every field as a [batch] array."""
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (batch,)), self)

    @property
    def is_greedy(self) -> jax.Array:
        """Per row (the shape of the fields): whether the row takes the argmax."""
        return (self.temperature == 0) | (self.top_k == 1)


def filter_logits(logits_BV: jax.Array, params: SamplingParams) -> jax.Array:
    """Temperature-scaled logits with the tokens outside top-k, top-p and min-p set to -inf."""
    batch, vocab = logits_BV.shape
    params = params.rows(batch)
    logits_BV = logits_BV.astype(jnp.float32) / jnp.maximum(params.temperature, 1e-6)[:, None]
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    k_B = jnp.where(params.top_k > 0, jnp.minimum(params.top_k, vocab), vocab)
    in_top_k_BV = jnp.arange(vocab)[None] < k_B[:, None]
    kth_largest_B = jnp.take_along_axis(sorted_BV, k_B[:, None] - 1, axis=-1)[:, 0]
    # Nucleus over the top-k survivors: keep a sorted token while the probability mass
    # before it is still below p, so the token that crosses p is kept and the first always is.
    sorted_BV = jnp.where(in_top_k_BV, sorted_BV, -jnp.inf)
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    # top_p = 1 keeps everything: in float32 the running sum can reach 1 before the tail.
    keep_BV = ((mass_before_BV < params.top_p[:, None]) | (params.top_p[:, None] >= 1)
               ) & in_top_k_BV
    smallest_kept_B = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1)
    # min-p: p / p_max >= min_p  <=>  logit >= max logit + log(min_p); log(0) = -inf keeps all.
    min_p_floor_B = sorted_BV[:, 0] + jnp.log(params.min_p)
    threshold_B = jnp.maximum(jnp.maximum(kth_largest_B, smallest_kept_B), min_p_floor_B)
    return jnp.where(logits_BV >= threshold_B[:, None], logits_BV, -jnp.inf)


def sample(logits_BV: jax.Array, keys_B: jax.Array, params: SamplingParams,
           some_sampled: bool | None = None, position=None) -> jax.Array:
    """Next token ids [B]: row b draws with `keys_B[b]`, this token's key, or with
    `fold_in(keys_B[b], position)` when `position` is given (`token_keys`). Greedy rows take
    the argmax; when every row is greedy, the sort, the keys and the random draw are skipped
    altogether: as the device finds at every call, or as `some_sampled` (known to the host,
    see `plan.py`) says."""
    greedy_B = jnp.broadcast_to(params.is_greedy, logits_BV.shape[:1])

    def draw(logits):
        keys = keys_B if position is None else token_keys(keys_B, position)
        drawn_B = jax.vmap(jax.random.categorical)(keys, filter_logits(logits, params))
        return jnp.where(greedy_B, jnp.argmax(logits, axis=-1), drawn_B)

    def argmax(logits):
        return jnp.argmax(logits, axis=-1)

    if some_sampled is not None:
        return (draw if some_sampled else argmax)(logits_BV).astype(jnp.int32)
    return jax.lax.cond(jnp.all(greedy_B), argmax, draw, logits_BV).astype(jnp.int32)


# Keys ------------------------------------------------------------------------------------


def seed_key(seed: int) -> np.ndarray:
    """The key data [2] uint32 of a 64-bit `seed` (`jax.random.wrap_key_data` makes it a
    key): both halves count, where `jax.random.key` with 64-bit types off keeps only the low
    32 bits, so seeds 5 and 2**32 + 5 would coincide. For seeds below 2**31 it is the data
    of `jax.random.key(seed)`."""
    return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)


def sample_key(prompt_key: jax.Array, sample: jax.Array) -> jax.Array:
    """The key of sample `sample` (0, 1, ...) of a prompt drawn with `prompt_key`."""
    return jax.random.fold_in(prompt_key, sample)


def row_keys(rng: jax.Array, num_prompts: int, num_samples: int = 1) -> jax.Array:
    """Each row's key [P * N], prompt-major (row p * N + n is sample n of prompt p).

    `rng` is one key per prompt [P], or one key [] for all: prompt p then draws with
    `fold_in(rng, p)`, so its tokens depend on its index but not on the other prompts."""
    if rng.ndim == 0:
        rng = jax.vmap(jax.random.fold_in, (None, 0))(rng, jnp.arange(num_prompts))
    per_sample = jax.vmap(jax.vmap(sample_key, (None, 0)), (0, None))(
        rng, jnp.arange(num_samples))
    return per_sample.reshape(-1)


def token_keys(keys_B: jax.Array, position) -> jax.Array:
    """The keys [B] each row draws its token number `position` (a scalar or [B]) with."""
    return jax.vmap(jax.random.fold_in)(keys_B, jnp.broadcast_to(position, keys_B.shape))


def as_keys(rng, num_prompts: int) -> jax.Array:
    """`rng` (None: key 0) as typed keys, one [] or one per prompt [P]: raw uint32 key data
    is wrapped. A ValueError names any other shape."""
    if rng is None:
        return jax.random.key(0)
    rng = jnp.asarray(rng) if not isinstance(rng, jax.Array) else rng
    if not jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
        if rng.dtype != jnp.uint32 or rng.ndim not in (1, 2):
            raise ValueError(f"rng must be a jax.random key, or one per prompt; got an array "
                             f"of {rng.dtype} with shape {rng.shape}")
        rng = jax.random.wrap_key_data(rng)
    if rng.shape not in ((), (num_prompts,)):
        raise ValueError(f"rng holds keys of shape {rng.shape}: give one key, or one per "
                         f"prompt ({num_prompts},)")
    return rng
