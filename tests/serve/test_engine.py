"""The continuous-batching engine: each request's tokens are those it gets alone, whatever
shares the batch, joins it or leaves it; slots are reused without compiling."""

import jax
import numpy as np
import pytest
from conftest import FakeTokenizer

from kvjax import decode
from kvjax import model as M
from kvjax.decode import Sampling
from kvjax.decode.sampling import seed_key
from kvjax.decode.tracing import trace_count
from kvjax.model.decode_kernel import decode_kernel_mode
from kvjax.serve import Engine, GenerationRequest, QueueFull

SLOTS, CHUNK = 4, 4


@pytest.fixture(scope="module")
def engine(tiny_lm):
    config, _, params = tiny_lm
    return Engine(config, params, max_slots=SLOTS, chunk_size=CHUNK, max_queue=8,
                  prefill_batch=4, tokenizer=FakeTokenizer())


class Collector:
    """Every delta of one request, by sample."""

    def __init__(self):
        self.deltas = []

    def __call__(self, delta):
        assert not isinstance(delta, Exception), delta
        self.deltas.append(delta)

    def tokens(self, index=0):
        return [t for d in self.deltas if d.index == index for t in d.token_ids]

    def text(self, index=0):
        return "".join(d.text for d in self.deltas if d.index == index)

    def finish(self, index=0):
        ends = [d.finish_reason for d in self.deltas if d.index == index and d.finish_reason]
        assert len(ends) == 1, ends
        return ends[0]


def prompt(seed, length, vocab=64):
    return tuple(int(t) for t in np.random.default_rng(seed).integers(3, vocab, length))


# The budget every reference asks for, cut to its request's own: greedy tokens are the
# uncached model's argmax whatever the budget (tests/decode/test_generate.py), and one budget
# is one compiled program for the references of every test.
ALONE_BUDGET = 40


def alone(tiny_lm, request):
    """The greedy tokens `generate` makes for `request` alone."""
    config, net, params = tiny_lm
    budget = max(request.max_tokens, min(ALONE_BUDGET, config.max_len - len(request.prompt)))
    return decode.generate(net, params, [list(request.prompt)], max_new_tokens=budget,
                           eos_ids=request.stop_ids, sampling=request.sampling
                           ).token_lists()[0][:request.max_tokens]


def test_greedy_requests_equal_generate_alone_while_others_join_and_leave(engine, tiny_lm):
    # (prompt length, max_tokens): one prompt bucket and token buffer for `generate`.
    shapes = [(3, 6), (5, 8), (8, 3), (6, 8), (7, 5), (2, 7)]
    requests = [GenerationRequest(prompt(i, n), max_tokens=m) for i, (n, m) in enumerate(shapes)]
    # Request 3 stops at a token it makes on its way: a stop id ends it early.
    free_run = alone(tiny_lm, requests[3])
    requests[3] = GenerationRequest(requests[3].prompt, max_tokens=8, stop_ids=(free_run[2],))
    # Requests 4 and 5 would stop at their first and third tokens, which min_tokens holds
    # back (in the program that samples first tokens, and in a chunk).
    held = []
    for i, source, position in ((4, requests[4], 0), (5, requests[0], 2)):
        held.append(alone(tiny_lm, source)[position])
        requests[i] = GenerationRequest(source.prompt, max_tokens=requests[i].max_tokens,
                                        stop_ids=(held[-1],), sampling=Sampling(min_tokens=3))
    expected = [alone(tiny_lm, r) for r in requests]
    assert all(len(tokens) >= 3 and stop not in tokens[:3]
               for tokens, stop in zip(expected[4:], held, strict=True))
    collectors = [Collector() for _ in requests]
    for request, collector in zip(requests[:3], collectors[:3], strict=True):
        engine.submit(request, collector)
    engine.step()  # requests 0 and 1 are mid-flight, 2 is done; 3 and 4 join, 5 waits
    assert [len(c.tokens()) for c in collectors[:3]] == [1 + CHUNK, 1 + CHUNK, 3]
    assert engine.live_slots == 2
    for request, collector in zip(requests[3:], collectors[3:], strict=True):
        engine.submit(request, collector)
    engine.run_until_idle()
    assert [c.tokens() for c in collectors] == expected
    assert len(expected[3]) == free_run.index(free_run[2]) + 1
    assert collectors[3].finish() == "stop"
    assert [c.finish() for c in collectors[:3]] == ["length"] * 3
    assert engine.live_slots == 0 and engine.queue_length == 0


def test_a_seeded_sample_is_the_same_whatever_shares_the_batch(engine, tiny_lm):
    sampling = Sampling(temperature=1.0, top_k=20, repetition_penalty=1.3,
                        presence_penalty=0.4, frequency_penalty=0.6)
    bias = {3: 4.0, 5: -100.0}
    request = GenerationRequest(prompt(10, 6), max_tokens=8, sampling=sampling, seed=7,
                                logit_bias=bias)
    by_itself = Collector()
    engine.submit(request, by_itself)
    engine.run_until_idle()

    crowd = [Collector() for _ in range(3)]
    for i, collector in enumerate(crowd):  # they take the slots request had alone
        engine.submit(GenerationRequest(prompt(20 + i, 4 + 3 * i), max_tokens=6 + i,
                                        sampling=Sampling(temperature=0.8), seed=i),
                      collector)
    engine.step()
    among_others = Collector()
    engine.submit(GenerationRequest(request.prompt, max_tokens=8, sampling=sampling, seed=7,
                                    n=2, logit_bias=bias), among_others)
    engine.run_until_idle()
    assert len(by_itself.tokens()) == 8
    assert among_others.tokens(0) == by_itself.tokens()  # sample 0 of n is the first sample
    assert among_others.tokens(1) != by_itself.tokens()  # the second sample draws its own
    assert 3 in by_itself.tokens() and 5 not in by_itself.tokens()
    # `generate` draws the same way: the seed is the prompt's key, whatever else it samples;
    # a request's logit bias is `decode.LogitBias` applied to its rows alone.
    _, net, params = tiny_lm
    keys = jax.random.wrap_key_data(np.stack([seed_key(3), seed_key(7)]))
    made = decode.generate(net, params, [list(prompt(11, 5)), list(request.prompt)],
                           max_new_tokens=8, sampling=sampling, num_samples=2, rng=keys,
                           logit_processors=[decode.LogitBias.of(bias)]).token_lists()
    assert made[2:] == [among_others.tokens(0), among_others.tokens(1)]


def test_after_warming_up_serving_compiles_nothing_new(engine):
    engine.warm_up(prompt_lengths=range(1, 9))  # every row count, one length bucket
    before = {name: trace_count(name)
              for name in ("serve_insert", "serve_first_tokens", "serve_chunk", "prefill")}
    collectors = [Collector() for _ in range(SLOTS + 2)]
    for i, collector in enumerate(collectors):  # every slot, some twice; 1-4 rows prefilled
        engine.submit(GenerationRequest(prompt(40 + i, 2 + i % 6), max_tokens=3 + i,
                                        sampling=Sampling(temperature=0.5 * (i % 2),
                                                          top_p=0.9), seed=i), collector)
    engine.run_until_idle()
    assert all(len(c.tokens()) == 3 + i for i, c in enumerate(collectors))
    assert {name: trace_count(name) for name in before} == before


def test_first_tokens_compile_once_per_row_count_whatever_the_prompt_bucket(tiny_lm):
    config, _, params = tiny_lm
    # State shapes of its own (3 staged rows), so no other test traced its programs.
    fresh = Engine(config, params, max_slots=2, max_staged=3, chunk_size=CHUNK,
                   prefill_batch=2, prefix_cache_rows=0)

    def traces():
        return np.array([trace_count(name) for name in ("serve_insert", "serve_first_tokens")])

    before = traces()
    fresh.warm_up(prompt_lengths=range(1, 9))  # prefills of 1 and 2 rows, bucket 8
    first_bucket = traces()
    fresh.warm_up(prompt_lengths=range(9, 17))  # the same rows, bucket 16
    assert (first_bucket - before).tolist() == [2, 2]
    assert (traces() - first_bucket).tolist() == [2, 0]


def test_a_stop_string_ends_the_text_before_it_or_after_it_and_never_leaks(engine, tiny_lm):
    request = GenerationRequest(prompt(50, 4), max_tokens=8)
    tokens = alone(tiny_lm, request)
    text = FakeTokenizer.decode(tokens)
    stop = text[5:7]
    cut = text.index(stop)
    for keep in (False, True):  # vLLM's include_stop_str_in_output
        collector = Collector()
        engine.submit(GenerationRequest(request.prompt, max_tokens=8, stop=(stop, "never"),
                                        include_stop=keep), collector)
        engine.run_until_idle()
        assert collector.text() == text[:cut + keep * len(stop)]
        assert collector.finish() == "stop"
        # The tokens end with the one that completed the stop string.
        assert collector.tokens() == tokens[:cut + len(stop)]


def test_a_cancelled_request_frees_its_slot_within_one_chunk(engine):
    collector = Collector()
    ticket = engine.submit(GenerationRequest(prompt(60, 3), max_tokens=40), collector)
    engine.step()
    assert engine.live_slots == 1
    ticket.cancel()
    engine.step()
    assert engine.live_slots == 0
    assert collector.finish() == "cancelled"
    assert len(collector.tokens()) == 1 + CHUNK


def test_bad_requests_are_refused_naming_the_value(engine):
    with pytest.raises(ValueError, match="60 tokens and max_tokens is 8: 68 tokens do not fit "
                                         "a slot's capacity of 64"):
        engine.submit(GenerationRequest(prompt(0, 60), max_tokens=8), Collector())
    with pytest.raises(ValueError, match="top_p=1.5 must be in"):
        engine.submit(GenerationRequest(prompt(0, 3), sampling=Sampling(top_p=1.5)),
                      Collector())
    with pytest.raises(ValueError, match=r"top_p=\[0.5, 0.9\]: a request takes one value"):
        engine.submit(GenerationRequest(prompt(0, 3), sampling=Sampling(top_p=[0.5, 0.9])),
                      Collector())
    with pytest.raises(ValueError, match="token id 64 is outside"):
        engine.submit(GenerationRequest((5, 64)), Collector())
    with pytest.raises(ValueError, match="n=5 is more than the engine's 4 slots"):
        engine.submit(GenerationRequest((5, 6), n=5), Collector())


def test_a_full_queue_refuses_more(engine):
    tickets = [engine.submit(GenerationRequest((5, 6), max_tokens=1), Collector())
               for _ in range(engine.max_queue)]
    with pytest.raises(QueueFull, match="max_queue=8"):
        engine.submit(GenerationRequest((5, 6)), Collector())
    for ticket in tickets:
        ticket.cancel()
    engine.run_until_idle()
    assert engine.queue_length == 0 and engine.live_slots == 0


@pytest.mark.parametrize("page_size", [None, 4], ids=["rows", "pages"])
def test_an_int8_cache_serves_what_generate_makes_with_it(tiny_lm, page_size):
    # The slots hold the prefix's int8 values and their scales: a slot that got the values
    # without the scales would attend over garbage from its first step. In pages too.
    config, _, params = tiny_lm
    config, params = M.with_precision(config, params, cache_dtype="int8")
    engine = Engine(config, params, max_slots=2, chunk_size=CHUNK, max_queue=4,
                    prefill_batch=2, tokenizer=FakeTokenizer(), page_size=page_size)
    requests = [GenerationRequest(prompt(20 + i, n), max_tokens=6)
                for i, n in enumerate((4, 7, 5))]
    net = M.build_model(config)
    alone = [decode.generate(net, params, [list(r.prompt)], max_new_tokens=r.max_tokens,
                             return_logprobs=True) for r in requests]
    collectors = [Collector() for _ in requests]
    for request, collector in zip(requests, collectors, strict=True):
        engine.submit(request, collector)
    engine.run_until_idle()
    assert [c.tokens() for c in collectors] == [out.token_lists()[0] for out in alone]
    # A random model's greedy tokens barely depend on the prompt; its logprobs do.
    for collector, out in zip(collectors, alone, strict=True):
        logprobs = [p for d in collector.deltas for p in d.logprobs]
        np.testing.assert_allclose(logprobs, out.logprobs[0, :len(logprobs)], atol=1e-5)


def test_a_slot_that_frees_mid_chunk_takes_the_next_staged_sample_at_once(tiny_lm):
    # Two slots, chunks of 8 steps: C frees the slot A left after two steps, and D takes it
    # two steps later, all within one chunk.
    config, _, params = tiny_lm
    # Checked at every step, as on a CPU (an accelerator checks every 8 by default).
    engine = Engine(config, params, max_slots=2, chunk_size=8, steps_per_check=1, max_queue=4,
                    prefill_batch=2)
    long, a, c, d = (GenerationRequest(prompt(70 + i, 3 + i), max_tokens=m)
                     for i, m in enumerate((30, 3, 3, 3)))
    collectors = [Collector() for _ in range(4)]
    engine.submit(long, collectors[0])
    engine.submit(a, collectors[1])
    engine.step()
    assert collectors[1].finish() == "length" and engine.live_slots == 1
    engine.submit(c, collectors[2])
    engine.submit(d, collectors[3])
    engine.step()
    assert [len(c.tokens()) for c in collectors] == [1 + 8 + 8, 3, 3, 3]
    assert [c.tokens() for c in collectors[1:]] == [alone(tiny_lm, r) for r in (a, c, d)]
    engine.run_until_idle()
    assert collectors[0].tokens() == alone(tiny_lm, long)


def test_steps_checked_four_at_a_time_make_the_same_tokens(tiny_lm):
    # As an accelerator runs a chunk: whether to go on, or to admit, is decided every four
    # steps. A ends after two steps of the first four and C waits on the host (the two
    # staged rows are taken): the chunk ends after the four, where checking every step would
    # end it after two. Chunks of six leave two steps of every second group past the
    # chunk's end, and groups go on after every slot is done: those steps emit nothing.
    config, _, params = tiny_lm
    engine = Engine(config, params, max_slots=2, chunk_size=6, steps_per_check=4,
                    max_queue=4, prefill_batch=2)
    long, a, c, d = (GenerationRequest(prompt(110 + i, 3 + i), max_tokens=m)
                     for i, m in enumerate((30, 3, 3, 5)))
    collectors = [Collector() for _ in range(4)]
    for request, collector in zip((long, a, c), collectors, strict=False):
        engine.submit(request, collector)
    engine.step()
    assert [len(c.tokens()) for c in collectors[:3]] == [1 + 4, 3, 0]
    engine.submit(d, collectors[3])
    engine.run_until_idle()
    assert [c.tokens() for c in collectors] == [alone(tiny_lm, r) for r in (long, a, c, d)]
    assert [c.finish() for c in collectors] == ["length"] * 4
    assert engine.live_slots == 0 and engine.queue_length == 0


def test_a_cancelled_staged_sample_never_takes_a_slot(engine):
    busy = [Collector() for _ in range(SLOTS)]
    tickets = [engine.submit(GenerationRequest(prompt(80 + i, 4), max_tokens=40), c)
               for i, c in enumerate(busy)]
    waiting = Collector()
    tickets.append(engine.submit(GenerationRequest(prompt(90, 5), max_tokens=40), waiting))
    engine.step()  # the busy ones take the staged rows, then the slots
    engine.step()  # the last one is staged: its first token, and it waits
    assert engine.live_slots == SLOTS and engine.queue_length == 1
    assert len(waiting.tokens()) == 1
    tickets[-1].cancel()
    engine.step()
    assert waiting.finish() == "cancelled" and len(waiting.tokens()) == 1
    assert engine.queue_length == 0 and engine.live_slots == SLOTS
    for ticket in tickets[:-1]:
        ticket.cancel()
    engine.run_until_idle()
    assert engine.live_slots == 0


def test_a_chunk_ends_when_a_free_slot_can_only_be_fed_by_the_host(tiny_lm):
    # Two slots and two staged rows: C waits on the host while A and B fill them. When A
    # ends after two steps nothing is staged for its slot, so the chunk stops there.
    config, _, params = tiny_lm
    engine = Engine(config, params, max_slots=2, chunk_size=8, steps_per_check=1, max_queue=4,
                    prefill_batch=1)
    requests = [GenerationRequest(prompt(100 + i, 4), max_tokens=m)
                for i, m in enumerate((3, 20, 20))]
    collectors = [Collector() for _ in requests]
    for request, collector in zip(requests, collectors, strict=True):
        engine.submit(request, collector)
    engine.step()
    assert [len(c.tokens()) for c in collectors] == [3, 3, 0]
    engine.run_until_idle()
    assert [c.tokens() for c in collectors] == [alone(tiny_lm, r) for r in requests]


def test_fewer_staged_rows_than_slots_serve_every_request_as_alone(tiny_lm):
    # One staged row for three slots: each request waits on the host until the row frees,
    # chunks end early to stage the next, and nothing is lost or changed.
    config, _, params = tiny_lm
    engine = Engine(config, params, max_slots=3, max_staged=1, chunk_size=CHUNK, max_queue=8,
                    prefill_batch=2)
    assert engine.state.staged.running.shape == (1,)
    assert engine.state.staged.cache.k[0].shape[1] == 1  # one row of cache memory
    requests = [GenerationRequest(prompt(110 + i, 2 + i), max_tokens=m)
                for i, m in enumerate((9, 2, 6, 11, 3))]
    collectors = [Collector() for _ in requests]
    for request, collector in zip(requests, collectors, strict=True):
        engine.submit(request, collector)
    engine.run_until_idle()
    assert [c.tokens() for c in collectors] == [alone(tiny_lm, r) for r in requests]
    assert engine.live_slots == 0 and engine.queue_length == 0
    with pytest.raises(ValueError, match="n=2 is more than the engine's 1 staged rows"):
        engine.submit(GenerationRequest((5, 6), n=2), Collector())
    with pytest.raises(ValueError, match="max_staged=0 must be an int >= 1"):
        Engine(config, params, max_slots=2, max_staged=0)


def test_more_samples_to_stop_than_a_chunk_takes_wait_for_the_next(engine):
    # With a chunk in flight the host can hold ended samples beyond the B + Q a chunk's
    # cancel list holds; the rest go with the next chunk instead of failing the engine.
    engine.outputs.to_stop = list(range(10_000, 10_000 + 2 * SLOTS + 3))
    engine.step()
    assert engine.outputs.to_stop == list(range(10_000 + 2 * SLOTS, 10_000 + 2 * SLOTS + 3))
    engine.step()
    assert engine.outputs.to_stop == [] and engine.live_slots == 0


def test_prompt_scores_are_computed_on_the_engines_turn_and_queue_bounded(engine, tiny_lm):
    """Prompt logprobs run where every other program is dispatched: in a turn of the
    engine's loop, never on the caller's thread; more than `max_queue` waiting is a 429."""
    from kvjax.serve.prompt_logprobs import prompt_logprobs

    config, _, params = tiny_lm
    futures = [engine.score_prompt(prompt(60 + i, 5), 3) for i in range(8)]
    with pytest.raises(QueueFull, match="8 requests are waiting to be scored or searched"):
        engine.score_prompt(prompt(70, 5), 3)
    assert not any(f.done() for f in futures)
    engine.step()
    for i, future in enumerate(futures):
        assert future.result(timeout=0) == prompt_logprobs(config, params, prompt(60 + i, 5), 3)


def test_the_decode_kernel_serves_what_generate_makes_through_it():
    """A bfloat16 model whose decode steps attend through the kernel (run as JAX ops here, as
    it compiles on one NVIDIA GPU): rows of different lengths join and leave the slots, and
    each request's tokens and logprobs are those `generate` makes alone through the kernel."""
    config = M.preset("tiny", d_model=64, num_heads=4, num_kv_heads=2,
                      positional_encoding="rope")
    config, params = M.with_precision(config, M.init_params(config, jax.random.key(3)),
                                      "bfloat16")
    net = M.build_model(config)
    # One prompt bucket and token buffer: the three runs alone share one compiled program.
    requests = [GenerationRequest(prompt(40 + i, n), max_tokens=m)
                for i, (n, m) in enumerate(((4, 8), (7, 3), (5, 6)))]
    with decode_kernel_mode("interpret"):
        engine = Engine(config, params, max_slots=2, chunk_size=CHUNK, max_queue=4,
                        prefill_batch=2)
        collectors = [Collector() for _ in requests]
        for request, collector in zip(requests, collectors, strict=True):
            engine.submit(request, collector)
        engine.run_until_idle()
        alone = [decode.generate(net, params, [list(r.prompt)], max_new_tokens=r.max_tokens,
                                 return_logprobs=True) for r in requests]
    assert [c.tokens() for c in collectors] == [out.token_lists()[0] for out in alone]
    for collector, out in zip(collectors, alone, strict=True):
        logprobs = [p for d in collector.deltas for p in d.logprobs]
        np.testing.assert_allclose(logprobs, out.logprobs[0, :len(logprobs)], atol=2e-2)


def test_a_callback_that_raises_cancels_its_own_request_and_the_engine_serves_on(tiny_lm):
    """A client's `on_delta` is the client's code: when it raises, its request is cancelled
    (logged), and every other request, then and later, gets what it gets alone."""
    import threading

    config, _, params = tiny_lm
    engine = Engine(config, params, max_slots=SLOTS, chunk_size=CHUNK, max_queue=8,
                    prefill_batch=4, tokenizer=FakeTokenizer())
    requests = [GenerationRequest(prompt(60 + i, 4 + i), max_tokens=12) for i in range(3)]
    calls, ended = [], [threading.Event() for _ in requests]

    def broken(delta):
        calls.append(delta)
        raise ConnectionError("the client went away")

    collectors = [Collector() for _ in requests]

    def reporting(i):
        def on_delta(delta):
            collectors[i](delta)
            if delta.finish_reason:
                ended[i].set()
        return on_delta

    engine.start()
    try:
        engine.submit(requests[0], reporting(0))
        broken_ticket = engine.submit(requests[1], broken)
        assert ended[0].wait(120)
        engine.submit(requests[2], reporting(2))  # after the failure
        assert ended[2].wait(120)
    finally:
        engine.close()
    assert len(calls) == 1 and broken_ticket.cancelled  # told once, then left alone
    assert [collectors[i].tokens() for i in (0, 2)] == [alone(tiny_lm, requests[i])
                                                          for i in (0, 2)]
