"""Token automata inside the compiled loop: the tables of a batch's constraints
(`constraints.py`) as traced arrays, and each row's state.

Every distinct automaton of a batch goes into one set of tables, its states numbered after
the previous one's; a row holds its state in those tables, or -1 without a constraint. A
step masks the logits of each constrained row to the tokens its state allows and then
moves the row along the token it took, with no host round trip:
  - a state's allowed tokens are a row of bits, V/32 words, which the mask spreads over
    the vocabulary with shifts, no scatter. States that allow the same tokens share a row,
    and the rows are kept only while they take no more memory than the transitions: no
    states x vocabulary table. Past that, only wide states (at least V/32 tokens, such as
    the inside of a JSON string, whose row is smaller than its transitions) keep theirs;
  - the other (narrow) states' few tokens are read from their transitions and scattered;
  - the move finds the token among the state's transitions (sorted by token) by binary
    search: a few scalar reads per row, however many tokens the state allows.
Table sizes are rounded up to powers of two, so another constraint of similar size
compiles nothing new. Shape letters: B batch, V vocab, Y words of 32 tokens' bits (V/32,
rounded up), Z tokens a narrow state allows (bucketed), T positions of a verifying call;
the tables are over states, transitions or rows of bits.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from .buckets import power_of_two
from .constraints import TokenAutomaton

UNCONSTRAINED = -1
BITS = 32  # tokens per word of `allowed_bits`


@flax.struct.dataclass
class RowConstraints:
    """state: [B] int32 each row's state (-1: unconstrained); starts, counts, bit_row: int32
    per state; tokens, next_states: int32 per transition, each state's sorted by token (see
    `TokenAutomaton`); bits: [rows, Y] uint32, bit v % 32 of word v // 32 set where the
    states of row `bit_row[s]` allow token v (-1: a narrow state); static: narrow_width,
    the most tokens a narrow state allows, rounded up (0: none); search_steps, the binary
    search's steps, enough for the state with the most transitions. given: bool per state,
    whether its one token is given rather than chosen (`TokenAutomaton.given`): a beam
    search adds 0 for it to a beam's score."""

    state: jax.Array
    starts: jax.Array
    counts: jax.Array
    tokens: jax.Array
    next_states: jax.Array
    bit_row: jax.Array
    bits: jax.Array
    given: jax.Array
    narrow_width: int = flax.struct.field(pytree_node=False)
    search_steps: int = flax.struct.field(pytree_node=False)

    # Every row reads every table (`parallel.constrain_rows` holds them whole on each device).
    SHARED_BY_ROWS = ("starts", "counts", "tokens", "next_states", "bit_row", "bits",
                      "given")

    def is_given(self) -> jax.Array:
        """[B] bool: whether each row's token now is given, not chosen (`given`)."""
        return (self.state >= 0) & self.given[jnp.maximum(self.state, 0)]

    def mask(self, logits_BV: jax.Array) -> jax.Array:
        """-inf on every token a constrained row's state does not allow."""
        batch, vocab = logits_BV.shape
        state_B = jnp.maximum(self.state, 0)
        row_B = self.bit_row[state_B]
        words_BY = self.bits[jnp.maximum(row_B, 0)]
        shifts = jnp.arange(BITS, dtype=jnp.uint32)
        bits_BV = ((words_BY[:, :, None] >> shifts) & 1).reshape(batch, -1) == 1
        if bits_BV.shape[1] < vocab:  # ids past the automaton's vocabulary: never allowed
            bits_BV = jnp.pad(bits_BV, ((0, 0), (0, vocab - bits_BV.shape[1])))
        allowed_BV = bits_BV[:, :vocab]
        if self.narrow_width:  # some states are masked from their transitions
            slot_Z = jnp.arange(self.narrow_width)
            place_BZ = jnp.minimum(self.starts[state_B][:, None] + slot_Z,
                                   self.tokens.shape[0] - 1)
            real_BZ = (slot_Z < self.counts[state_B][:, None]) & (row_B < 0)[:, None]
            narrow_BV = jnp.zeros((batch, vocab), bool).at[
                jnp.arange(batch)[:, None], jnp.where(real_BZ, self.tokens[place_BZ], vocab)
            ].set(True, mode="drop")
            allowed_BV = jnp.where((row_B >= 0)[:, None], allowed_BV, narrow_BV)
        return jnp.where((self.state >= 0)[:, None] & ~allowed_BV, -jnp.inf, logits_BV)

    def next_state(self, state_N: jax.Array, token_N: jax.Array) -> jax.Array:
        """[N] the state after `token_N` from `state_N` (any shape N); unchanged where the
        state is -1 or does not allow the token."""
        safe_N = jnp.maximum(state_N, 0)
        low_N, end_N = self.starts[safe_N], self.starts[safe_N] + self.counts[safe_N]
        last = self.tokens.shape[0] - 1

        def halve(_, bounds):  # towards the first place whose token is not below
            low_N, high_N = bounds
            middle_N = (low_N + high_N) // 2
            below_N = self.tokens[jnp.minimum(middle_N, last)] < token_N
            searching_N = low_N < high_N
            return (jnp.where(searching_N & below_N, middle_N + 1, low_N),
                    jnp.where(searching_N & ~below_N, middle_N, high_N))

        # A fixed-count loop: unrolled, XLA's compile time grows steeply with a large table.
        low_N, _ = jax.lax.fori_loop(0, self.search_steps, halve, (low_N, end_N))
        place_N = jnp.minimum(low_N, last)
        found_N = (state_N >= 0) & (low_N < end_N) & (self.tokens[place_N] == token_N)
        return jnp.where(found_N, self.next_states[place_N], state_N)

    def advance(self, token_B: jax.Array, moved_B: jax.Array) -> RowConstraints:
        """Each constrained row in `moved_B` [B] bool after taking `token_B`."""
        return self.replace(state=jnp.where(moved_B, self.next_state(self.state, token_B),
                                            self.state))

    # Speculative decoding: a verifying call's T = J + 1 positions, each masked by the state
    # the drafts before it lead to.

    def along(self, drafts_BJ: jax.Array) -> jax.Array:
        """[B, T] each row's state before each position: after its first t drafts. A draft
        its state does not allow leaves the state as it was; the masked model never accepts
        that draft, so nothing after it is kept."""
        states = [self.state]
        for j in range(drafts_BJ.shape[1]):
            states.append(self.next_state(states[-1], drafts_BJ[:, j]))
        return jnp.stack(states, axis=1)

    def mask_each(self, logits_BTV: jax.Array, states_BT: jax.Array) -> jax.Array:
        """`logits_BTV` masked at each position by the state `states_BT` there."""
        batch, num_tokens, vocab = logits_BTV.shape
        at = self.replace(state=states_BT.reshape(-1))
        return at.mask(logits_BTV.reshape(-1, vocab)).reshape(batch, num_tokens, vocab)

    def after(self, states_BT: jax.Array, tokens_BT: jax.Array, accepted_B: jax.Array,
              moved_B: jax.Array) -> RowConstraints:
        """The rows after a verifying call kept their first `accepted` drafts (`states_BT`
        from `along`) and then the model's token, `tokens_BT[:, accepted]`."""
        at = self.replace(state=jnp.take_along_axis(states_BT, accepted_B[:, None], 1)[:, 0])
        token_B = jnp.take_along_axis(tokens_BT, accepted_B[:, None], axis=1)[:, 0]
        return at.advance(token_B, moved_B)


def search_steps(max_count: int) -> int:
    """Binary search steps that find a token among `max_count` (rounded up to a power of
    two, so that similar automata compile alike)."""
    return power_of_two(max(max_count, 1) + 1, 2).bit_length()


def wide_bits(automaton: TokenAutomaton, words: int) -> tuple[np.ndarray, np.ndarray]:
    """(bit_row [states] int32, bits [rows, words] uint32) of `automaton`: its states'
    allowed tokens as bits (bit v % 32 of word v // 32), one row per distinct set of
    tokens. Every state gets a row while the rows take no more memory than the transitions
    (states share few distinct sets: a JSON Schema's hundreds of states, a few dozen);
    otherwise only the wide states (at least `words` tokens) do, and the others (row -1)
    are masked from their transitions."""
    keys = [automaton.allowed(state).tobytes() for state in range(automaton.num_states)]
    every = len(set(keys)) * words <= max(automaton.tokens.size, 16 * words)
    bit_row = np.full(automaton.num_states, -1, np.int32)
    row_of: dict[bytes, int] = {}
    for state, key in enumerate(keys):
        if every or automaton.counts[state] >= words:
            bit_row[state] = row_of.setdefault(key, len(row_of))
    flags = np.zeros((len(row_of), words * BITS), bool)
    for key, row in row_of.items():
        flags[row, np.frombuffer(key, np.int32)] = True
    packed = np.packbits(flags.reshape(len(row_of), words, BITS), axis=-1, bitorder="little")
    return bit_row, np.ascontiguousarray(packed).view("<u4").reshape(
        len(row_of), words).astype(np.uint32)


def words_for(vocab_size: int) -> int:
    return -(-vocab_size // BITS)


def narrow_width(automaton: TokenAutomaton, words: int) -> int:
    """The most tokens a state of `automaton` without a row of bits allows, rounded up (0:
    every state has one)."""
    narrow = automaton.counts[_wide_bits_cached(automaton, words)[0] < 0]
    return power_of_two(int(narrow.max()), 8) if narrow.size else 0


def table_sizes(automata: Sequence[TokenAutomaton], words: int) -> tuple[int, int, int]:
    """(states, transitions, rows of bits) that `automata` take in one set of tables."""
    return (sum(a.num_states for a in automata), sum(a.tokens.size for a in automata),
            sum(len(_wide_bits_cached(a, words)[1]) for a in automata))


def build_tables(automata: Sequence[TokenAutomaton], least: tuple[int, int, int] = (16, 16, 1)
                 ) -> tuple[RowConstraints, list[int]]:
    """(tables holding `automata` one after another, with no rows yet; the first state of
    each), every size a power of two and at least `least` (states, transitions, rows)."""
    words = max(words_for(a.vocab_size) for a in automata)
    states, edges, rows = (power_of_two(n, floor) for n, floor in zip(
        table_sizes(automata, words), least, strict=True))
    starts = np.zeros(states, np.int32)
    counts = np.zeros_like(starts)
    bit_row = np.full_like(starts, -1)
    given = np.zeros(states, bool)
    tokens = np.zeros(edges, np.int32)
    next_states = np.zeros_like(tokens)
    bits = np.zeros((rows, words), np.uint32)
    firsts, s, e, r = [], 0, 0, 0
    for automaton in automata:
        firsts.append(s)
        own_rows, own_bits = _wide_bits_cached(automaton, words)
        starts[s:s + automaton.num_states] = automaton.starts + e
        counts[s:s + automaton.num_states] = automaton.counts
        bit_row[s:s + automaton.num_states] = np.where(own_rows >= 0, own_rows + r, -1)
        given[s:s + automaton.num_states] = automaton.given
        bits[r:r + len(own_bits)] = own_bits
        tokens[e:e + automaton.tokens.size] = automaton.tokens
        next_states[e:e + automaton.tokens.size] = automaton.next_states + s
        s, e, r = s + automaton.num_states, e + automaton.tokens.size, r + len(own_bits)
    tables = RowConstraints(
        jnp.zeros((0,), jnp.int32), jnp.asarray(starts), jnp.asarray(counts),
        jnp.asarray(tokens), jnp.asarray(next_states), jnp.asarray(bit_row), jnp.asarray(bits),
        jnp.asarray(given), narrow_width=max(narrow_width(a, words) for a in automata),
        search_steps=search_steps(int(counts.max())))
    return tables, firsts


_wide_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _wide_bits_cached(automaton: TokenAutomaton, words: int):
    per_words = _wide_cache.setdefault(automaton, {})
    if words not in per_words:
        per_words[words] = wide_bits(automaton, words)
    return per_words[words]


def for_rows(automata: Sequence[TokenAutomaton | None]) -> RowConstraints | None:
    """The tables of every row's automaton (None: unconstrained) and each row's initial
    state; None when no row has one, so an unconstrained batch carries nothing."""
    distinct: dict[int, TokenAutomaton] = {}
    for automaton in automata:
        if automaton is not None:
            distinct.setdefault(id(automaton), automaton)
    if not distinct:
        return None
    tables, firsts = build_tables(list(distinct.values()))
    first = dict(zip(distinct, firsts, strict=True))
    state = np.array([UNCONSTRAINED if a is None else first[id(a)] + a.initial
                      for a in automata], np.int32)
    return tables.replace(state=jnp.asarray(state))
