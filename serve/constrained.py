"""The engine's constraint tables: the automata its samples follow (`decode.JsonSchema`,
`Regex`, `Choice` compiled by `decode.compile_constraint`), kept on the device between
programs.

Every automaton in use lies in one set of tables (`EngineState.tables`), numbered after the
one before it, as `decode.automaton` lays out a batch's; each row of the engine holds its
state in those tables (`SlotState.constraint_state`, -1: unconstrained). Requests come and
go, so the tables are kept by the host (`TableKeeper`): an automaton already placed is
reused by every request that asks for it; a new one is appended while it fits; when it does
not, the automata no sample follows any longer are dropped and the rest moved together (the
rows' states moved with them), in tables grown to the next power of two if they need more.
Sizes are powers of two (the search's steps follow the widest state, rounded up alike), so
the engine's programs compile again only when the tables grow. An engine whose requests
never asked for a constraint holds no tables, and its programs carry no masking at all.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.decode.automaton import (
    UNCONSTRAINED,
    build_tables,
    table_sizes,
    words_for,
)
from kvjax.decode.constraints import TokenAutomaton


class TableKeeper:
    """Places automata in the engine's tables (host side; the device holds the tables)."""

    def __init__(self):
        self._order: list[TokenAutomaton] = []  # as they lie in the tables
        self._first: dict[int, int] = {}  # id: its first state
        self._sizes: tuple[int, int, int] | None = None  # states, transitions, rows

    def place(self, automaton: TokenAutomaton, in_use: Iterable[TokenAutomaton], state):
        """`state` (an `slots.EngineState`) with `automaton` in its tables. When it does not
        fit, the automata not in `in_use` (those some sample staged or in a slot follows)
        are dropped and the others moved, every row's state with them."""
        if id(automaton) in self._first:
            return state
        order = self._order + [automaton]
        if self._sizes is not None and not self._fits(order):
            using = {id(a) for a in in_use}
            order = [a for a in self._order if id(a) in using] + [automaton]
        tables, firsts = build_tables(order, self._sizes or (16, 16, 1))
        old_first, old_order = self._first, self._order
        old_states = 16 if self._sizes is None else self._sizes[0]
        self._order, self._first = order, {id(a): f for a, f in zip(order, firsts, strict=True)}
        self._sizes = (tables.starts.size, tables.tokens.size, tables.bits.shape[0])
        state = state.replace(tables=tables)
        if all(self._first.get(id(a)) == old_first[id(a)] for a in old_order):
            return state  # nothing moved
        moved = np.full(old_states, UNCONSTRAINED, np.int32)
        for one in old_order:
            if id(one) in self._first:
                first = old_first[id(one)]
                moved[first:first + one.num_states] = (np.arange(one.num_states)
                                                       + self._first[id(one)])
        return _move_rows(state, moved)

    def _fits(self, order: list[TokenAutomaton]) -> bool:
        words = max(words_for(a.vocab_size) for a in order)
        return all(need <= have for need, have in zip(table_sizes(order, words), self._sizes,
                                                      strict=True))

    def place_all(self, tickets, in_use: Iterable[TokenAutomaton | None], state):
        """(`state` with every ticket's automaton placed, each ticket's first state in the
        tables (-1: unconstrained)): where its samples start, a preempted one's
        (`output.Continuation`) where its tokens led. The automata in `in_use` (those the
        samples on the device follow) and the tickets' stay."""
        staging = [t.request.constraint for t in tickets if t.request.constraint is not None]
        in_use = staging + [a for a in in_use if a is not None]
        for automaton in staging:
            state = self.place(automaton, in_use, state)
        # Read after all are placed: placing one can move those placed before it.
        return state, [-1 if t.request.constraint is None else self._first[
            id(t.request.constraint)] + t.automaton_state() for t in tickets]

    def initial_state(self, automaton: TokenAutomaton) -> int:
        """Where `automaton` (placed) starts in the tables."""
        return self._first[id(automaton)] + automaton.initial


@functools.partial(jax.jit, donate_argnums=0)
def _move_rows(state, moved_N):
    """Every row's constraint state s at `moved[s]` (N: the states the old tables held);
    unconstrained rows, and rows whose automaton was dropped, at -1."""
    def move(state_B):
        inside_B = (state_B >= 0) & (state_B < moved_N.shape[0])
        return jnp.where(inside_B, moved_N[jnp.clip(state_B, 0, moved_N.shape[0] - 1)],
                         UNCONSTRAINED)

    return state.replace(
        slots=state.slots.replace(constraint_state=move(state.slots.constraint_state)),
        staged=state.staged.replace(constraint_state=move(state.staged.constraint_state)))
