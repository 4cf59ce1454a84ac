"""serve/between_chunks.py: a beam search request (vLLM's `use_beam_search`) through the
engine makes what `decode.beam_search` makes alone, while other requests decode between its
chunks; through the official `openai` client too; cancelled, queued or between chunks, it
ends and says so."""

import dataclasses

import openai
import pytest
from conftest import SERVED_MODEL, FakeTokenizer, openai_client, serve_app
from test_engine import CHUNK, SLOTS, Collector, alone, prompt

from kvjax import decode
from kvjax.serve import Engine, GenerationRequest
from kvjax.serve.server import build_app


def searched(tiny_lm, request):
    """(tokens, finish reason) of each of `request`'s n best hypotheses, alone."""
    config, net, params = tiny_lm
    out = decode.beam_search(net, params, [list(request.prompt)], num_beams=request.n,
                             num_return_sequences=request.n, max_new_tokens=request.max_tokens,
                             eos_ids=request.stop_ids, length_penalty=request.length_penalty,
                             bad_words=request.bad_words)
    return [(tokens, "stop" if reason == decode.StopReason.EOS else "length")
            for tokens, reason in zip(out.token_lists(), out.stop_reason, strict=True)]


def test_a_beam_search_request_makes_what_beam_search_makes_alone_beside_others(tiny_lm):
    config, _, params = tiny_lm
    engine = Engine(config, params, max_slots=SLOTS, chunk_size=CHUNK, max_queue=8,
                    prefill_batch=4, tokenizer=FakeTokenizer())
    greedy = [GenerationRequest(prompt(160 + i, 4), max_tokens=12) for i in range(2)]
    first_token = alone(tiny_lm, GenerationRequest(prompt(162, 6), max_tokens=3))
    beams = [GenerationRequest(prompt(162, 6), max_tokens=8, n=3, beam_search=True,
                               length_penalty=0.5, stop_ids=(first_token[2],)),
             GenerationRequest(prompt(163, 3), max_tokens=6, n=2, beam_search=True)]
    # A generation config's bad words (`kvjax serve` adds them): the best hypothesis's first
    # two tokens, which the search then never makes together.
    best = searched(tiny_lm, beams[1])[0][0]
    beams.append(dataclasses.replace(beams[1], bad_words=(tuple(best[:2]),)))
    collectors = [Collector() for _ in greedy + beams]
    engine.submit(greedy[0], collectors[0])
    engine.step()  # a beam search waits for no slot: it runs between chunks
    for request, collector in zip(greedy[1:] + beams, collectors[1:], strict=True):
        engine.submit(request, collector)
    made = len(collectors[0].tokens())
    engine.step()  # each search runs one chunk of CHUNK steps, the slots one chunk after it
    assert not collectors[2].deltas and not collectors[3].deltas  # neither search is done
    assert len(collectors[0].tokens()) == made + CHUNK
    engine.run_until_idle()
    assert [c.tokens() for c in collectors[:2]] == [alone(tiny_lm, r) for r in greedy]
    assert collectors[4].tokens() != best
    for request, collector in zip(beams, collectors[2:], strict=True):
        got = [(collector.tokens(i), collector.finish(i)) for i in range(request.n)]
        assert got == searched(tiny_lm, request)
        for i, (tokens, finish) in enumerate(got):
            shown = tokens[:-1] if finish == "stop" else tokens
            assert collector.text(i) == FakeTokenizer.decode(shown)
    assert {f for c in collectors[2:3] for f in (c.finish(i) for i in range(3))} >= {"stop"}
    # Cancelled while queued: each hypothesis ends, none is searched.
    cancelled = Collector()
    engine.submit(beams[1], cancelled).cancel()
    engine.run_until_idle()
    assert [cancelled.finish(i) for i in range(2)] == ["cancelled"] * 2
    # Cancelled between two of its chunks: it ends at the next turn, searched no further.
    cancelled = Collector()
    ticket = engine.submit(beams[0], cancelled)
    assert engine.step() and not cancelled.deltas
    ticket.cancel()
    assert not engine.step()  # nothing left to run
    assert [(cancelled.tokens(i), cancelled.finish(i)) for i in range(3)] == [
        ([], "cancelled")] * 3


def test_a_beam_search_through_the_openai_client_is_that_of_beam_search_alone(tiny_loaded,
                                                                              tiny_lm):
    # test_server.py's settings: its programs, in the suite's shared compilation cache.
    app = build_app(tiny_loaded, max_slots=4, max_queue=64, chunk_size=4, prefill_batch=4)
    url, stop = serve_app(app, 30.0)
    try:
        client = openai_client(url, 30.0)
        ids = [5, 9, 30, 9, 41]
        answer = client.completions.create(model=SERVED_MODEL, prompt=ids, max_tokens=6, n=2,
                                           extra_body={"use_beam_search": True})
        want = searched(tiny_lm, GenerationRequest(tuple(ids), max_tokens=6, n=2,
                                                   stop_ids=FakeTokenizer.stop_ids))
        assert [c.index for c in answer.choices] == [0, 1]
        assert [c.finish_reason for c in answer.choices] == [f for _, f in want]
        assert [c.text for c in answer.choices] == [
            FakeTokenizer.decode(t[:-1] if f == "stop" else t) for t, f in want]
        assert answer.usage.completion_tokens == sum(len(t) for t, _ in want)
        with pytest.raises(openai.BadRequestError, match="temperature is not used by beam"):
            client.completions.create(model=SERVED_MODEL, prompt=ids, max_tokens=6,
                                      temperature=0.7, extra_body={"use_beam_search": True})
    finally:
        stop()
