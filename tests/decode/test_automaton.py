"""decode/automaton.py: the traced tables of a batch's constraints mask and move each row as
its own automaton does."""

import jax.numpy as jnp
import numpy as np

from kvjax import decode
from kvjax.decode import automaton as A


def test_the_traced_tables_mask_and_move_rows_as_the_automata_do(docs_tokenizer):
    words = [f"{w}_{n}" for n, w in enumerate(("alpha beta gamma delta epsilon zeta eta "
                                               "theta iota kappa lambda sigma").split())]
    automata = [decode.compile_constraint(c, docs_tokenizer) for c in (
        decode.Regex("[0-9]{2,5}"), decode.Choice(words),  # many distinct, narrow states
        decode.JsonSchema({"type": "object", "properties": {"a": {"type": "string"}}}))]
    rows = A.for_rows([automata[0], None, automata[1], automata[2], automata[0]])
    bit_row = np.asarray(rows.bit_row)[:sum(a.num_states for a in automata)]
    assert rows.narrow_width > 0 and (bit_row < 0).any() and (bit_row >= 0).any()
    first = {id(a): int(rows.state[i]) - a.initial for i, a in zip(
        (0, 2, 3), automata, strict=True)}
    rng = np.random.default_rng(0)
    vocab = docs_tokenizer.vocab_size + 40  # a model's padded vocabulary: the rest never allowed
    for _ in range(12):
        chosen = [None if i == 1 else automata[rng.integers(3)] for i in range(5)]
        local = [None if a is None else int(rng.integers(a.num_states)) for a in chosen]
        state = np.array([-1 if a is None else first[id(a)] + s
                          for a, s in zip(chosen, local, strict=True)], np.int32)
        at = rows.replace(state=jnp.asarray(state))
        masked = np.asarray(at.mask(jnp.zeros((5, vocab))))
        tokens = []
        for b, (a, s) in enumerate(zip(chosen, local, strict=True)):
            expected = np.zeros(vocab, bool) if a is not None else np.ones(vocab, bool)
            if a is not None:
                expected[a.allowed(s)] = True
            np.testing.assert_array_equal(masked[b] == 0, expected)
            options = a.allowed(s) if a is not None and a.counts[s] else [3]
            tokens.append(int(rng.choice(options)) if b % 2 == 0 else 7)  # some not allowed
        moved = np.asarray(at.next_state(jnp.asarray(state), jnp.asarray(tokens)))
        for b, (a, s) in enumerate(zip(chosen, local, strict=True)):
            if a is None or tokens[b] not in a.allowed(s):
                assert moved[b] == state[b]
            else:
                assert moved[b] == first[id(a)] + a.next_state(s, tokens[b])
