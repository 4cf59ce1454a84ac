"""Token automata inside the compiled loop: the tables of a batch's constraints
(`constraints.py`) as traced arrays, and each row's state.

Every distinct automaton of a batch goes into one set of tables, its states numbered after
the previous one's; a row holds its state in those tables, or -1 without a constraint. A
step masks the logits of each constrained row to the tokens its state allows and then
moves the row along the token it took, with no host round trip:
  - the mask reads the state's row of `allowed_bits` (one bit per token, V/32 words) and
    spreads it over the vocabulary with shifts: no scatter, and no states x vocabulary
    table of booleans;
  - the move finds the token among the state's transitions (sorted by token) by binary
    search: a few scalar reads per row, however many tokens the state allows.
Table sizes are rounded up to powers of two, so another constraint of similar size
compiles nothing new. Shape letters: B batch, V vocab, Y words of 32 tokens' bits (V/32,
rounded up), T positions of a verifying call; the tables are over states or transitions.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from .constraints import TokenAutomaton

UNCONSTRAINED = -1
BITS = 32  # tokens per word of `allowed_bits`


@flax.struct.dataclass
class RowConstraints:
    """state: [B] int32 each row's state (-1: unconstrained); starts, counts: int32 per
    state; tokens, next_states: int32 per transition, each state's sorted by token (see
    `TokenAutomaton`); allowed_bits: [states, Y] uint32, bit v % 32 of word v // 32 set
    where the state allows token v; search_steps: the binary search's steps, enough for
    the state with the most transitions (static)."""

    state: jax.Array
    starts: jax.Array
    counts: jax.Array
    tokens: jax.Array
    next_states: jax.Array
    allowed_bits: jax.Array
    search_steps: int = flax.struct.field(pytree_node=False)

    def mask(self, logits_BV: jax.Array) -> jax.Array:
        """-inf on every token a constrained row's state does not allow."""
        batch, vocab = logits_BV.shape
        words_BY = self.allowed_bits[jnp.maximum(self.state, 0)]
        shifts = jnp.arange(BITS, dtype=jnp.uint32)
        bits_BV = ((words_BY[:, :, None] >> shifts) & 1).reshape(batch, -1)
        if bits_BV.shape[1] < vocab:  # ids past the automaton's vocabulary: never allowed
            bits_BV = jnp.pad(bits_BV, ((0, 0), (0, vocab - bits_BV.shape[1])))
        banned_BV = (self.state >= 0)[:, None] & (bits_BV[:, :vocab] == 0)
        return jnp.where(banned_BV, -jnp.inf, logits_BV)

    def next_state(self, state_N: jax.Array, token_N: jax.Array) -> jax.Array:
        """[N] the state after `token_N` from `state_N` (any shape N); unchanged where the
        state is -1 or does not allow the token."""
        safe_N = jnp.maximum(state_N, 0)
        low_N, end_N = self.starts[safe_N], self.starts[safe_N] + self.counts[safe_N]
        high_N = end_N
        last = self.tokens.shape[0] - 1
        for _ in range(self.search_steps):  # the first place whose token is not below
            middle_N = (low_N + high_N) // 2
            below_N = self.tokens[jnp.minimum(middle_N, last)] < token_N
            searching_N = low_N < high_N
            low_N = jnp.where(searching_N & below_N, middle_N + 1, low_N)
            high_N = jnp.where(searching_N & ~below_N, middle_N, high_N)
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


def power_of_two(n: int, least: int = 1) -> int:
    return max(least, 1 << max(n - 1, 0).bit_length())


def search_steps(max_count: int) -> int:
    """Binary search steps that find a token among `max_count` (rounded up to a power of
    two, so that similar automata compile alike)."""
    return power_of_two(max(max_count, 1) + 1, 2).bit_length()


def allowed_bits(automaton: TokenAutomaton, words: int) -> np.ndarray:
    """[states, words] uint32: bit v % 32 of word v // 32 set where a state allows token v."""
    rows = np.repeat(np.arange(automaton.num_states), automaton.counts)
    bits = np.zeros((automaton.num_states, words * BITS), bool)
    bits[rows, automaton.tokens] = True
    return np.packbits(bits.reshape(automaton.num_states, words, BITS), axis=-1,
                       bitorder="little").view(np.uint32).reshape(automaton.num_states, words)


def words_for(vocab_size: int) -> int:
    return -(-vocab_size // BITS)


def for_rows(automata: Sequence[TokenAutomaton | None]) -> RowConstraints | None:
    """The tables of every row's automaton (None: unconstrained) and each row's initial
    state; None when no row has one, so an unconstrained batch carries nothing."""
    distinct: dict[int, TokenAutomaton] = {}
    for automaton in automata:
        if automaton is not None:
            distinct.setdefault(id(automaton), automaton)
    if not distinct:
        return None
    first_state, first_edge, states, edges = {}, {}, 0, 0
    for key, automaton in distinct.items():
        first_state[key], first_edge[key] = states, edges
        states += automaton.num_states
        edges += automaton.tokens.size
    words = max(words_for(a.vocab_size) for a in distinct.values())
    starts = np.zeros(power_of_two(states, 16), np.int32)
    counts = np.zeros_like(starts)
    bits = np.zeros((starts.size, words), np.uint32)
    tokens = np.zeros(power_of_two(edges, 16), np.int32)
    next_states = np.zeros_like(tokens)
    for key, automaton in distinct.items():
        s, e = first_state[key], first_edge[key]
        starts[s:s + automaton.num_states] = automaton.starts + e
        counts[s:s + automaton.num_states] = automaton.counts
        bits[s:s + automaton.num_states] = allowed_bits(automaton, words)
        tokens[e:e + automaton.tokens.size] = automaton.tokens
        next_states[e:e + automaton.tokens.size] = automaton.next_states + s
    state = np.array([UNCONSTRAINED if a is None else first_state[id(a)] + a.initial
                      for a in automata], np.int32)
    return RowConstraints(jnp.asarray(state), jnp.asarray(starts), jnp.asarray(counts),
                          jnp.asarray(tokens), jnp.asarray(next_states), jnp.asarray(bits),
                          search_steps=search_steps(int(counts.max())))
