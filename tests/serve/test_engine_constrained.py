"""Constrained requests in the continuous-batching engine: a greedy request under a
constraint gets exactly what `decode.generate` makes for it alone under the same automaton,
while other constraints join, leave and are moved in the engine's tables, and unconstrained
requests beside them are untouched; sampled outputs that end validate against their schema;
a schema already placed compiles nothing."""

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from test_engine import Collector
from test_pages import preemptions

from kvjax import decode, text
from kvjax.decode.tracing import trace_count
from kvjax.serve import Engine, GenerationRequest
from kvjax.serve.constrained import TableKeeper
from kvjax.serve.metrics import ServeMetrics

CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "python-docs-lm"
ITEM = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "kind": {"enum": ["list", "dict", None]},
    "sizes": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}},
    "required": ["name", "kind"]}


@pytest.fixture(scope="module")
def lm():
    return text.load(CHECKPOINT)


@pytest.fixture(scope="module")
def engine(lm):
    return Engine(lm.config, lm.params, tokenizer=lm.tokenizer, max_slots=4, chunk_size=4,
                  max_len=128, prefill_batch=2)


def request(lm, words, automaton=None, max_tokens=40, **kwargs):
    ids = tuple(lm.tokenizer.document_prefix) + tuple(lm.tokenizer.encode(words))
    return GenerationRequest(ids, max_tokens=max_tokens, constraint=automaton,
                             stop_ids=tuple(lm.tokenizer.stop_ids), **kwargs)


def each_alone(lm, requests):
    """What `decode.generate` makes for each request: one call whose rows are each what
    the row makes alone (`tests/decode/test_generate.py`), each cut at its token budget (a
    greedy row's first n tokens are its n-token run)."""
    out = decode.generate(lm.net, lm.params, [list(r.prompt) for r in requests],
                          max_new_tokens=max(r.max_tokens for r in requests),
                          eos_ids=requests[0].stop_ids,
                          constraint=[r.constraint for r in requests])
    return [row[:r.max_tokens] for row, r in zip(out.token_lists(), requests, strict=True)]


def test_constrained_samples_preempted_for_pages_go_on_in_their_constraint(lm):
    """Three slots grow in a pool of one slot's pages: preempted samples go on from the
    state their tokens led their automaton to, and make what `generate` makes alone."""
    tok = lm.tokenizer
    number = decode.compile_constraint(decode.Regex("[0-9]{24}"), tok)
    choice = decode.compile_constraint(decode.Choice(["for", "while", "with"]), tok)
    requests = [request(lm, "n = ", number, max_tokens=30),
                request(lm, "x = ", number, max_tokens=30),
                request(lm, "A loop", choice, max_tokens=8),
                request(lm, "The list type", max_tokens=30)]
    metrics = ServeMetrics()
    engine = Engine(lm.config, lm.params, tokenizer=tok, max_slots=3, chunk_size=4,
                    max_len=48, page_size=8, num_pages=6, prefill_batch=2, metrics=metrics)
    collectors = [Collector() for _ in requests]
    for r, collector in zip(requests, collectors, strict=True):
        engine.submit(r, collector)
    engine.run_until_idle()
    assert preemptions(metrics) > 0
    assert [c.tokens() for c in collectors] == each_alone(lm, requests)


def test_greedy_constrained_requests_equal_generate_alone_as_tables_change(lm, engine):
    tok = lm.tokenizer
    digits = decode.compile_constraint(decode.Regex("[0-9]{2}"), tok)
    number = decode.compile_constraint(decode.Regex("[0-9]{30}"), tok)
    item = decode.compile_constraint(decode.JsonSchema(ITEM), tok)
    choice = decode.compile_constraint(decode.Choice(["for", "while", "with"]), tok)
    # `digits` ends at once and leaves its place; `number` is placed after it and runs on
    # while `item`, too big for the tables, makes them drop `digits` and move `number`.
    first = [request(lm, "x = ", digits, max_tokens=8),
             request(lm, "n = ", number, max_tokens=40),
             request(lm, "The list type")]
    later = [request(lm, "The for statement", item), request(lm, "A loop", choice),
             request(lm, "def f(x):", max_tokens=12)]
    expected = each_alone(lm, first + later)
    collectors = [Collector() for _ in expected]
    for r, collector in zip(first, collectors[:3], strict=True):
        engine.submit(r, collector)
    engine.step()
    engine.step()
    assert collectors[0].finish() == "stop" and not collectors[1].deltas[-1].finish_reason
    before = engine._tables.initial_state(number)  # noqa: SLF001 - where it lies
    for r, collector in zip(later, collectors[3:], strict=True):
        engine.submit(r, collector)
    engine.step()
    assert engine._tables.initial_state(number) < before  # noqa: SLF001 - it moved
    engine.run_until_idle()
    assert [c.tokens() for c in collectors] == expected
    assert len(collectors[1].text()) == 30 and collectors[1].text().isdigit()
    assert tok.decode(collectors[4].tokens()[:-1]) in ("for", "while", "with")
    jsonschema.validate(json.loads(collectors[3].text()), ITEM)


def test_sampled_outputs_that_end_validate_and_a_placed_schema_compiles_nothing(lm, engine):
    automaton = decode.compile_constraint(decode.JsonSchema(ITEM), lm.tokenizer)
    collectors = [Collector() for _ in range(3)]
    for seed, collector in enumerate(collectors):
        engine.submit(request(lm, ("The", "import json", "Return")[seed], automaton,
                              max_tokens=80, n=3, seed=seed,
                              sampling=decode.Sampling(temperature=1.0, top_p=0.95)),
                      collector)
    engine.run_until_idle()  # compiles for tables holding ITEM's automaton
    before = {name: trace_count(name)
              for name in ("serve_insert", "serve_first_tokens", "serve_chunk")}
    again = Collector()
    engine.submit(request(lm, "The", automaton, max_tokens=80, n=3, seed=0,
                          sampling=decode.Sampling(temperature=1.0, top_p=0.95)), again)
    engine.run_until_idle()
    assert {name: trace_count(name) for name in before} == before
    assert [again.tokens(i) for i in range(3)] == [collectors[0].tokens(i) for i in range(3)]
    ended = 0
    for collector in collectors:
        for index in range(3):
            if collector.finish(index) == "stop":
                jsonschema.validate(json.loads(collector.text(index)), ITEM)
                ended += 1
    assert ended >= 7  # of 9: a sample may run out of tokens inside a long string


def test_bad_constraints_are_refused_before_they_are_queued(lm, engine):
    automaton = decode.compile_constraint(decode.Regex("a+"), lm.tokenizer)
    with pytest.raises(ValueError, match="not among stop_ids"):
        engine.check(GenerationRequest((1, 2), constraint=automaton))
    with pytest.raises(ValueError, match="must be a TokenAutomaton"):
        engine.check(GenerationRequest((1, 2), constraint="a+",
                                       stop_ids=tuple(lm.tokenizer.stop_ids)))
    # min_tokens would hold back the end id the automaton allows only where the text ends.
    with pytest.raises(ValueError, match="min_tokens=2 would hold back the end id"):
        engine.check(GenerationRequest((1, 2), constraint=automaton, sampling=decode.Sampling(
            min_tokens=2), stop_ids=tuple(lm.tokenizer.stop_ids)))


class _Rows:
    """The part of an engine state the keeper reads and writes."""

    def __init__(self, states):
        import jax.numpy as jnp

        from kvjax.serve.slots import EngineState, SlotState

        def rows(values):
            fields = {name: None for name in SlotState.__dataclass_fields__}
            return SlotState(**{**fields, "constraint_state": jnp.asarray(values, jnp.int32)})

        self.state = EngineState(slots=rows(states), staged=rows([-1]),
                                 last_admitted=jnp.zeros((), jnp.int32))


def test_the_keeper_reuses_appends_and_moves_rows_when_it_drops_an_automaton(lm):
    tok = lm.tokenizer
    a, b = (decode.compile_constraint(decode.Regex(r), tok) for r in ("[0-9]{2}", "(yes|no)"))
    keeper = TableKeeper()
    state = keeper.place(a, [a], _Rows([-1]).state)
    state = keeper.place(b, [a, b], state)
    assert keeper.initial_state(b) == a.num_states + b.initial
    assert keeper.place(b, [b], state) is state  # placed: nothing to do
    # Rows: one in b's second state, one unconstrained, one in a (about to be dropped).
    state = state.replace(slots=state.slots.replace(constraint_state=np.array(
        [a.num_states + 1, -1, 0], np.int32)))
    big = decode.compile_constraint(decode.Regex("[a-f]{40}"), tok)
    state = keeper.place(big, [b], state)
    assert keeper.initial_state(b) == b.initial  # moved to the front
    assert np.asarray(state.slots.constraint_state).tolist() == [1, -1, -1]
    tables = state.tables
    np.testing.assert_array_equal(
        np.asarray(tables.tokens)[tables.starts[1]:tables.starts[1] + tables.counts[1]],
        b.allowed(1))
