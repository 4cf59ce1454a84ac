"""serve/constrained.py: the engine's constraint tables as requests come and go. Whatever
is placed, reused or dropped, every automaton some row follows stays in the tables and
behaves there as itself (the tokens each of its states allows, by the tables' transitions
and by their mask, and where each token leads), and every row's state still names the same
automaton and state, or -1 once its automaton was dropped."""

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvjax.decode import Choice, TokenAutomaton
from kvjax.decode.automaton import UNCONSTRAINED
from serve.constrained import TableKeeper

VOCAB = 70  # three words of bits, the last one partly past the vocabulary


@flax.struct.dataclass
class Rows:
    constraint_state: jax.Array


@flax.struct.dataclass
class State:
    """The parts of an `EngineState` the keeper reads and writes."""

    tables: object
    slots: Rows
    staged: Rows


def random_automaton(rng, num_states: int) -> TokenAutomaton:
    """States allowing from one token to nearly all (both ways of masking), each token
    leading to a random state."""
    counts = rng.integers(1, VOCAB - 2, num_states) if rng.random() < 0.5 else \
        rng.integers(1, 5, num_states)
    tokens = [np.sort(rng.choice(VOCAB, int(c), replace=False)) for c in counts]
    return TokenAutomaton(
        constraint=Choice([str(rng.random())]), end_id=int(tokens[0][0]), vocab_size=VOCAB,
        initial=int(rng.integers(num_states)),
        starts=np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32),
        counts=counts.astype(np.int32), tokens=np.concatenate(tokens).astype(np.int32),
        next_states=rng.integers(0, num_states, int(counts.sum())).astype(np.int32))


ROWS = 64  # states masked at once: one program per size of the tables


@jax.jit
def allowed_by(tables, states_R):
    return tables.replace(state=states_R).mask(jnp.zeros((states_R.shape[0], VOCAB)))


def at(keeper: TableKeeper, automaton: TokenAutomaton, own_state: int = 0) -> int:
    """The state in the keeper's tables of `automaton`'s state `own_state`."""
    return keeper.initial_state(automaton) - automaton.initial + own_state


def behaves_as(tables, first: int, automaton: TokenAutomaton) -> None:
    states = np.arange(automaton.num_states)
    starts, counts = np.asarray(tables.starts), np.asarray(tables.counts)
    tokens, next_states = np.asarray(tables.tokens), np.asarray(tables.next_states)
    masked = np.asarray(allowed_by(tables, np.pad(states + first, (0, ROWS - states.size),
                                                  constant_values=UNCONSTRAINED)))
    for s in states:
        g = first + s
        allowed = automaton.allowed(s)
        np.testing.assert_array_equal(tokens[starts[g]:starts[g] + counts[g]], allowed)
        np.testing.assert_array_equal(np.flatnonzero(masked[s] == 0), allowed)
        for place, token in enumerate(allowed):
            assert next_states[starts[g] + place] == first + automaton.next_state(s, token)


def test_rows_keep_their_automaton_and_state_while_automata_are_placed_and_dropped():
    rng = np.random.default_rng(0)
    pool = [random_automaton(rng, int(n)) for n in rng.integers(1, 40, 8)]
    keeper = TableKeeper()
    rows = np.full(10, UNCONSTRAINED)  # 6 slots, then 4 staged rows
    follows: list = [None] * 10  # each row's (automaton, its own state), or None
    state = State(None, Rows(jnp.asarray(rows[:6], jnp.int32)),
                  Rows(jnp.asarray(rows[6:], jnp.int32)))
    drops = moves = 0
    last_sizes = (0, 0, 0)
    for _ in range(40):
        placed = [a for a in pool if id(a) in keeper._first]
        for row in rng.choice(10, 3, replace=False):  # requests end and come
            if placed and rng.random() < 0.7:
                automaton = placed[rng.integers(len(placed))]
                follows[row] = (automaton, int(rng.integers(automaton.num_states)))
            else:
                follows[row] = None
        rows = np.array([UNCONSTRAINED if f is None else at(keeper, *f) for f in follows],
                        np.int32)
        state = state.replace(slots=Rows(jnp.asarray(rows[:6])),
                              staged=Rows(jnp.asarray(rows[6:])))
        in_use = [f[0] for f in follows if f is not None]
        firsts_before = dict(keeper._first)
        new = pool[rng.integers(len(pool))]
        after = keeper.place(new, in_use, state)
        if id(new) in firsts_before:
            assert after is state  # already placed: nothing to do
        got = np.concatenate([np.asarray(after.slots.constraint_state),
                              np.asarray(after.staged.constraint_state)])
        for row, f in enumerate(follows):
            if f is None:
                assert got[row] == UNCONSTRAINED
            else:  # in use, so never dropped, and still at its own state
                assert got[row] == at(keeper, *f)
        now_placed = [a for a in pool if id(a) in keeper._first]
        assert new in now_placed and all(a in now_placed for a in in_use)
        drops += len(set(firsts_before) - set(keeper._first))
        moves += sum(keeper._first.get(k, v) != v for k, v in firsts_before.items())
        sizes = (after.tables.starts.size, after.tables.tokens.size, after.tables.bits.shape[0])
        assert all(n & (n - 1) == 0 for n in sizes), sizes  # powers of two
        # The engine's programs compile again only when the tables grow: they never shrink.
        assert all(n >= m for n, m in zip(sizes, last_sizes, strict=True)), (sizes, last_sizes)
        last_sizes = sizes
        for automaton in now_placed:
            behaves_as(after.tables, at(keeper, automaton), automaton)
        state = after
    assert drops and moves  # both ways exercised


class Staging:
    """A ticket as `place_all` reads it: its request's constraint and its samples' state."""

    def __init__(self, automaton, at):
        self.request = type("Request", (), {"constraint": automaton})()
        self._at = at

    def automaton_state(self):
        return self._at


def test_each_ticket_starts_where_its_samples_stand_in_the_tables():
    rng = np.random.default_rng(1)
    a, b = random_automaton(rng, 5), random_automaton(rng, 9)
    keeper = TableKeeper()
    state = State(None, Rows(jnp.full(2, UNCONSTRAINED, jnp.int32)),
                  Rows(jnp.full(3, UNCONSTRAINED, jnp.int32)))
    tickets = [Staging(a, a.initial), Staging(None, 0), Staging(b, 7), Staging(a, 2)]
    state, starts = keeper.place_all(tickets, [None], state)
    first_a, first_b = at(keeper, a), at(keeper, b)
    assert starts == [first_a + a.initial, UNCONSTRAINED, first_b + 7, first_a + 2]
    behaves_as(state.tables, first_a, a)
    behaves_as(state.tables, first_b, b)
