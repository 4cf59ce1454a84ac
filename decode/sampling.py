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
    top_k: keep the k most likely tokens, and any tied with the k-th (0 = no limit;
           1 = greedy).
    top_p: keep the smallest set of most likely tokens whose probability reaches p: the token
           whose cumulative probability crosses p is kept, and so is the argmax (1 = no limit).
    min_p: keep the tokens whose probability is at least min_p times the most likely
           token's (after temperature; 0 = no limit).
    repetition_penalty: for tokens already in the row's context (prompt and output), positive
           logits are divided by it and negative ones multiplied (1 = off). See processors.py.
    presence_penalty: subtracted from the logit of every token the row has output so far
           (0 = off). See processors.py.
    frequency_penalty: times the number of times the row has output a token, subtracted from
           its logit (0 = off). See processors.py.
    min_tokens: the row's stop ids are held back until it has output this many tokens
           (0 = none). See processors.py.
    no_repeat_ngram_size: n > 0 bans every token that would repeat an n-gram of the row's
           context (0 = off). See processors.py.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    no_repeat_ngram_size: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    min_tokens: jax.Array

    @classmethod
    def make(cls, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
             no_repeat_ngram_size=0, presence_penalty=0.0, frequency_penalty=0.0,
             min_tokens=0, batch: int | None = None) -> SamplingParams:
        """Scalars or [B] arrays; with `batch`, every field is broadcast to [batch], so that
        scalar and per-row settings share one compiled program."""

        def field(value, dtype):
            value = jnp.asarray(value, dtype)
            return value if batch is None else jnp.broadcast_to(value, (batch,))

        return cls(field(temperature, jnp.float32), field(top_k, jnp.int32),
                   field(top_p, jnp.float32), field(min_p, jnp.float32),
                   field(repetition_penalty, jnp.float32),
                   field(no_repeat_ngram_size, jnp.int32),
                   field(presence_penalty, jnp.float32), field(frequency_penalty, jnp.float32),
                   field(min_tokens, jnp.int32))

    def rows(self, batch: int) -> SamplingParams:
        """Every field as a [batch] array."""
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (batch,)), self)

    @property
    def is_greedy(self) -> jax.Array:
        """Per row (the shape of the fields): whether the row takes the argmax."""
        return (self.temperature == 0) | (self.top_k == 1)


def filter_logits(logits_BV: jax.Array, params: SamplingParams) -> jax.Array:
    """Temperature-scaled logits with the tokens outside top-k, top-p and min-p set to -inf.

    Top-k keeps the tokens at or above the k-th largest value (ties kept, as transformers'
    warper keeps them); top-p then keeps, of those, the most likely tokens while the mass
    before them is below p (the token that crosses p is kept, and so is the argmax); min-p
    keeps the tokens with at least min_p times the largest probability. On a CPU, where XLA
    sorts a large vocabulary far more slowly than it scans it a few dozen times, the
    thresholds are found by a search over the values (`_threshold_by_search`); elsewhere they
    are read off the sorted logits (`_threshold_by_sort`). Both keep the same tokens."""
    batch, _ = logits_BV.shape
    params = params.rows(batch)
    logits_BV = logits_BV.astype(jnp.float32) / jnp.maximum(params.temperature, 1e-6)[:, None]
    threshold_B = jax.lax.platform_dependent(logits_BV, params, cpu=_threshold_by_search,
                                             default=_threshold_by_sort)
    return jnp.where(logits_BV >= threshold_B[:, None], logits_BV, -jnp.inf)


def _threshold_by_sort(logits_BV: jax.Array, params: SamplingParams) -> jax.Array:
    """The smallest value each row keeps [B], from its logits sorted."""
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    k_B = _top_k_count(params, logits_BV.shape[1])
    kth_largest_B = jnp.take_along_axis(sorted_BV, k_B[:, None] - 1, axis=-1)[:, 0]
    # Nucleus over the top-k survivors: keep a sorted token while the probability mass
    # before it is still below p, so the token that crosses p is kept and the first always is.
    in_top_k_BV = sorted_BV >= kth_largest_B[:, None]
    sorted_BV = jnp.where(in_top_k_BV, sorted_BV, -jnp.inf)
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    # top_p = 1 keeps everything: in float32 the running sum can reach 1 before the tail.
    keep_BV = ((mass_before_BV < params.top_p[:, None]) | (params.top_p[:, None] >= 1)
               ) & in_top_k_BV
    smallest_kept_B = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1)
    return jnp.maximum(jnp.maximum(kth_largest_B, smallest_kept_B),
                       _min_p_floor(sorted_BV[:, 0], params))


def _threshold_by_search(logits_BV: jax.Array, params: SamplingParams) -> jax.Array:
    """The smallest value each row keeps [B], each threshold found by bisection over the
    float32 values in order (32 halvings of the 2**32 bit patterns, each a pass over the
    row): the k-th largest value is the largest t with at least k values >= t; the token
    that crosses p is the largest t whose values >= t hold at least p of the top-k mass.
    Where no row limits top-k or top-p (a temperature alone, the API's default), the
    searches are skipped: a CPU waits for no host to take the branch."""
    k_B = _top_k_count(params, logits_BV.shape[1])
    min_p_floor_B = _min_p_floor(jnp.max(logits_BV, axis=-1), params)

    def searched():
        keys_BV = _ordered_keys(logits_BV)
        kth_key_B = _largest_key_where(
            lambda t_B: jnp.sum(keys_BV >= t_B[:, None], axis=-1) >= k_B, logits_BV.shape[0])
        in_top_k_BV = keys_BV >= kth_key_B[:, None]
        probs_BV = jax.nn.softmax(jnp.where(in_top_k_BV, logits_BV, -jnp.inf), axis=-1)
        crossing_key_B = _largest_key_where(
            lambda t_B: jnp.sum(jnp.where(keys_BV >= t_B[:, None], probs_BV, 0), axis=-1)
            >= params.top_p, logits_BV.shape[0])
        crossing_key_B = jnp.where(params.top_p >= 1, _NEG_INF_KEY, crossing_key_B)
        return jnp.maximum(jnp.maximum(_value_of_key(kth_key_B), _value_of_key(crossing_key_B)),
                           min_p_floor_B)

    limited = jnp.any(k_B < logits_BV.shape[1]) | jnp.any(params.top_p < 1)
    return jax.lax.cond(limited, searched, lambda: min_p_floor_B)


def _top_k_count(params: SamplingParams, vocab: int) -> jax.Array:
    """k per row [B], the whole vocabulary where top-k is off (0) or larger."""
    return jnp.where(params.top_k > 0, jnp.minimum(params.top_k, vocab), vocab)


def _min_p_floor(largest_B: jax.Array, params: SamplingParams) -> jax.Array:
    # p / p_max >= min_p  <=>  logit >= max logit + log(min_p); log(0) = -inf keeps all.
    return largest_B + jnp.log(params.min_p)


# float32 bit patterns as uint32 keys in the order of their values: -inf is the lowest
# (below it lie only NaNs), +inf the highest.
_NEG_INF_KEY = np.uint32(0x007FFFFF)
_SIGN = np.uint32(0x80000000)


def _ordered_keys(x: jax.Array) -> jax.Array:
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >= _SIGN, ~bits, bits | _SIGN)


def _value_of_key(key: jax.Array) -> jax.Array:
    bits = jnp.where(key >= _SIGN, key & ~_SIGN, ~key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _largest_key_where(holds, batch: int) -> jax.Array:
    """Per row, the largest key t >= key(-inf) with `holds(t)` [B] true, for a condition
    that holds at key(-inf) and, once false, stays false for every larger key."""
    def halve(_, bounds):
        low, high = bounds
        middle = low + ((high - low) >> 1) + (low < high).astype(jnp.uint32)
        held = holds(middle)
        return jnp.where(held, middle, low), jnp.where(held, high, middle - 1)

    low = jnp.full((batch,), _NEG_INF_KEY, jnp.uint32)
    high = jnp.full((batch,), np.uint32(0xFFFFFFFF), jnp.uint32)
    return jax.lax.fori_loop(0, 32, halve, (low, high))[0]


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
