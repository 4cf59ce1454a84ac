"""Token automata inside the compiled loop: the tables of a batch's constraints
(`constraints.py`) as traced arrays, and each row's state.

Every distinct automaton of a batch goes into one table, its states numbered after the
previous one's; a row holds its state in that table, or -1 without a constraint. A step
masks the logits of each constrained row to the tokens its state allows and then moves the
row along the token it took: a gather of at most `width` allowed tokens per row and a
scatter into the vocabulary, no dense states x vocabulary mask and no host round trip.
Table sizes are rounded up to powers of two, so another constraint of similar size
compiles nothing new. Shape letters: B batch, V vocab, Y tokens a state allows (the
bucketed `width`); the tables are one-dimensional, over states or over transitions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from .constraints import TokenAutomaton

UNCONSTRAINED = -1


@flax.struct.dataclass
class RowConstraints:
    """state: [B] int32 each row's state (-1: unconstrained); starts, counts: int32 per
    state; tokens, next_states: int32 per transition (see `TokenAutomaton`); width: the
    most tokens a state allows, rounded up (static)."""

    state: jax.Array
    starts: jax.Array
    counts: jax.Array
    tokens: jax.Array
    next_states: jax.Array
    width: int = flax.struct.field(pytree_node=False)

    def allowed(self) -> Allowed:
        """The tokens each row's state allows, which `mask` and `advance` both read: one
        gather per step."""
        state_B = jnp.maximum(self.state, 0)
        slot_Y = jnp.arange(self.width)
        place_BY = self.starts[state_B][:, None] + slot_Y
        real_BY = slot_Y < self.counts[state_B][:, None]
        place_BY = jnp.minimum(place_BY, self.tokens.shape[0] - 1)
        return Allowed(self.tokens[place_BY], place_BY, real_BY)

    def mask(self, logits_BV: jax.Array, allowed: Allowed) -> jax.Array:
        """-inf on every token a constrained row's state does not allow."""
        batch, vocab = logits_BV.shape
        allowed_BV = jnp.zeros((batch, vocab), bool).at[
            jnp.arange(batch)[:, None], jnp.where(allowed.real_BY, allowed.tokens_BY, vocab)
        ].set(True, mode="drop")
        banned_BV = (self.state >= 0)[:, None] & ~allowed_BV
        return jnp.where(banned_BV, -jnp.inf, logits_BV)

    def advance(self, token_B: jax.Array, moved_B: jax.Array,
                allowed: Allowed) -> RowConstraints:
        """Each constrained row in `moved_B` [B] bool after taking `token_B`."""
        match_BY = allowed.real_BY & (allowed.tokens_BY == token_B[:, None])
        place_B = jnp.take_along_axis(allowed.place_BY,
                                      jnp.argmax(match_BY, axis=1)[:, None], axis=1)[:, 0]
        moves_B = moved_B & (self.state >= 0) & jnp.any(match_BY, axis=1)
        return self.replace(state=jnp.where(moves_B, self.next_states[place_B], self.state))

    # Speculative decoding: a verifying call's T = J + 1 positions, each masked by the state
    # the drafts before it lead to.

    def along(self, drafts_BJ: jax.Array) -> jax.Array:
        """[B, T] each row's state before each position: after its first t drafts. A draft
        its state does not allow leaves the state as it was; the masked model never accepts
        that draft, so nothing after it is kept."""
        states, rows = [self.state], self
        for j in range(drafts_BJ.shape[1]):
            rows = rows.advance(drafts_BJ[:, j], jnp.ones_like(self.state, bool),
                                rows.allowed())
            states.append(rows.state)
        return jnp.stack(states, axis=1)

    def mask_each(self, logits_BTV: jax.Array, states_BT: jax.Array) -> jax.Array:
        """`logits_BTV` masked at each position by the state `states_BT` there."""
        batch, num_tokens, vocab = logits_BTV.shape
        at = self.replace(state=states_BT.reshape(-1))
        return at.mask(logits_BTV.reshape(-1, vocab), at.allowed()).reshape(
            batch, num_tokens, vocab)

    def after(self, states_BT: jax.Array, tokens_BT: jax.Array, accepted_B: jax.Array,
              moved_B: jax.Array) -> RowConstraints:
        """The rows after a verifying call kept their first `accepted` drafts (`states_BT`
        from `along`) and then the model's token, `tokens_BT[:, accepted]`."""
        at = self.replace(state=jnp.take_along_axis(states_BT, accepted_B[:, None], 1)[:, 0])
        token_B = jnp.take_along_axis(tokens_BT, accepted_B[:, None], axis=1)[:, 0]
        return at.advance(token_B, moved_B, at.allowed())


class Allowed(NamedTuple):
    """tokens_BY: the allowed token ids; place_BY: their places in the tables; real_BY:
    which of the `width` places are the state's (the rest pad)."""

    tokens_BY: jax.Array
    place_BY: jax.Array
    real_BY: jax.Array


def power_of_two(n: int, least: int = 1) -> int:
    return max(least, 1 << max(n - 1, 0).bit_length())


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
    starts = np.zeros(power_of_two(states, 16), np.int32)
    counts = np.zeros_like(starts)
    tokens = np.zeros(power_of_two(edges, 16), np.int32)
    next_states = np.zeros_like(tokens)
    for key, automaton in distinct.items():
        s, e = first_state[key], first_edge[key]
        starts[s:s + automaton.num_states] = automaton.starts + e
        counts[s:s + automaton.num_states] = automaton.counts
        tokens[e:e + automaton.tokens.size] = automaton.tokens
        next_states[e:e + automaton.tokens.size] = automaton.next_states + s
    state = np.array([UNCONSTRAINED if a is None else first_state[id(a)] + a.initial
                      for a in automata], np.int32)
    return RowConstraints(jnp.asarray(state), jnp.asarray(starts), jnp.asarray(counts),
                          jnp.asarray(tokens), jnp.asarray(next_states),
                          width=power_of_two(int(counts.max()), 8))
