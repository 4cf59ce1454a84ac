"""The engine's constraint tables: the automata its samples follow (`decode.JsonSchema`,
`Regex`, `Choice` compiled by `decode.compile_constraint`), kept on the device between
programs.

Every automaton in use lies in one set of tables (`ConstraintTables`), numbered after the
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

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvjax.decode.automaton import (
    UNCONSTRAINED,
    RowConstraints,
    allowed_bits,
    power_of_two,
    search_steps,
    words_for,
)
from kvjax.decode.constraints import TokenAutomaton


@flax.struct.dataclass
class ConstraintTables:
    """The tables of `decode.automaton.RowConstraints`, without the rows' states."""

    starts: jax.Array
    counts: jax.Array
    tokens: jax.Array
    next_states: jax.Array
    allowed_bits: jax.Array
    search_steps: int = flax.struct.field(pytree_node=False)

    def for_rows(self, state_B: jax.Array) -> RowConstraints:
        """The rows' constraints, each row in state `state_B` [B]."""
        return RowConstraints(state_B, self.starts, self.counts, self.tokens,
                              self.next_states, self.allowed_bits,
                              search_steps=self.search_steps)


class TableKeeper:
    """Places automata in the engine's tables (host side; the device holds a copy)."""

    def __init__(self):
        self._placed: dict[int, tuple[TokenAutomaton, int, int]] = {}  # id: (a, state, edge)
        self._states = self._edges = 0  # used
        self._host: dict[str, np.ndarray] | None = None
        self._steps = self._words = 0

    def place(self, automaton: TokenAutomaton, in_use: Iterable[TokenAutomaton], state):
        """`state` (an `slots.EngineState`) with `automaton` in its tables. When it does not
        fit, the automata not in `in_use` (those some sample staged or in a slot follows)
        are dropped and the others moved, every row's state with them."""
        if id(automaton) in self._placed:
            return state
        steps = max(self._steps, search_steps(int(automaton.counts.max(initial=1))))
        words = max(self._words, words_for(automaton.vocab_size))
        if (self._host is not None and self._fits([automaton]) and steps == self._steps
                and words == self._words):
            self._append(automaton)
            return state.replace(tables=self._upload())
        keep = {id(a): a for a in in_use if id(a) in self._placed}
        kept = list(keep.values()) + [automaton]
        old = dict(self._placed)
        old_states = 16 if self._host is None else self._host["starts"].size
        states = sum(a.num_states for a in kept)
        edges = sum(a.tokens.size for a in kept)
        size_states = power_of_two(states, 16)
        size_edges = power_of_two(edges, 16)
        if self._host is not None:  # never shrink: the programs keep their shapes
            size_states = max(size_states, self._host["starts"].size)
            size_edges = max(size_edges, self._host["tokens"].size)
        self._host = {"starts": np.zeros(size_states, np.int32),
                      "counts": np.zeros(size_states, np.int32),
                      "tokens": np.zeros(size_edges, np.int32),
                      "next_states": np.zeros(size_edges, np.int32),
                      "allowed_bits": np.zeros((size_states, words), np.uint32)}
        self._placed, self._states, self._edges = {}, 0, 0
        self._steps, self._words = steps, words
        for one in kept:
            self._append(one)
        moved = np.full(old_states, UNCONSTRAINED, np.int32)
        for key, (one, first, _) in old.items():
            if key in self._placed:
                moved[first:first + one.num_states] = (
                    np.arange(one.num_states) + self._placed[key][1])
        return _move_rows(state.replace(tables=self._upload()), moved)

    def _fits(self, automata: list[TokenAutomaton]) -> bool:
        return (self._states + sum(a.num_states for a in automata) <= self._host["starts"].size
                and self._edges + sum(a.tokens.size for a in automata)
                <= self._host["tokens"].size)

    def _append(self, automaton: TokenAutomaton) -> None:
        s, e, host = self._states, self._edges, self._host
        host["starts"][s:s + automaton.num_states] = automaton.starts + e
        host["counts"][s:s + automaton.num_states] = automaton.counts
        host["tokens"][e:e + automaton.tokens.size] = automaton.tokens
        host["next_states"][e:e + automaton.tokens.size] = automaton.next_states + s
        host["allowed_bits"][s:s + automaton.num_states] = allowed_bits(automaton,
                                                                        self._words)
        self._placed[id(automaton)] = (automaton, s, e)
        self._states += automaton.num_states
        self._edges += automaton.tokens.size

    def initial_state(self, automaton: TokenAutomaton) -> int:
        """Where `automaton` (placed) starts in the tables."""
        return self._placed[id(automaton)][1] + automaton.initial

    def _upload(self) -> ConstraintTables:
        return ConstraintTables(**{k: jnp.asarray(v) for k, v in self._host.items()},
                                search_steps=self._steps)


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
