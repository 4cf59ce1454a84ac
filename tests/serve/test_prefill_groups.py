"""Which waiting prompts the engine prefills together: the first (by priority, then age)
leads, the rest are chosen so that the group is padded to the narrowest bucket it can be, and
every request still gets the tokens it gets alone."""

import collections
import itertools
from types import SimpleNamespace

import numpy as np
from test_engine import CHUNK, Collector, alone, prompt

import kvjax.serve.staging as staging
from kvjax.decode.buckets import bucket
from kvjax.serve import Engine, GenerationRequest, prefill_groups

LIMIT = 64


def test_a_group_is_padded_to_the_narrowest_bucket_any_group_with_its_leader_could_have():
    rng = np.random.default_rng(0)
    for _ in range(200):
        lengths = rng.integers(1, LIMIT + 1, int(rng.integers(2, 9))).tolist()
        lead, waiting, size = lengths[0], lengths[1:], int(rng.integers(2, 5))
        order = prefill_groups.companion_order(lead, waiting, LIMIT)
        assert sorted(order) == list(range(len(waiting)))
        chosen = order[:size - 1]
        width = max(bucket(n, LIMIT) for n in [lead] + [waiting[i] for i in chosen])
        best = min(max(bucket(n, LIMIT) for n in [lead] + [waiting[i] for i in group])
                   for group in itertools.combinations(range(len(waiting)),
                                                       min(size - 1, len(waiting))))
        assert width == best, (lead, waiting, size)
        # Prompts of the leader's bucket join before shorter ones, which form groups of
        # their own; within a bucket, the oldest first.
        buckets = [bucket(waiting[i], LIMIT) for i in order]
        own = bucket(lead, LIMIT)
        same = [i for i, b in zip(order, buckets, strict=True) if b == own]
        assert order[:len(same)] == sorted(same)


def test_prompts_of_one_length_prefill_together_and_each_request_gets_its_tokens_alone(
        tiny_lm, monkeypatch):
    config, _, params = tiny_lm
    widths = []
    prefill = staging.prefill_state

    def recorded(config, params, padded, lengths, capacity, *adapters):
        widths.append((padded.shape[1], int(np.sum(lengths > 0))))
        return prefill(config, params, padded, lengths, capacity, *adapters)

    monkeypatch.setattr(staging, "prefill_state", recorded)
    engine = Engine(config, params, max_slots=2, chunk_size=CHUNK, max_queue=8,
                    prefill_batch=2)
    # Arrival order: long, short, long, short. In that order each pair would be padded to
    # the long prompts' bucket; grouped, only the long pair is.
    requests = [GenerationRequest(prompt(130 + i, n), max_tokens=5)
                for i, n in enumerate((20, 5, 21, 6))]
    collectors = [Collector() for _ in requests]
    for request, collector in zip(requests, collectors, strict=True):
        engine.submit(request, collector)
    engine.run_until_idle()
    assert widths == [(bucket(21, config.max_len), 2), (bucket(6, config.max_len), 2)]
    assert [c.tokens() for c in collectors] == [alone(tiny_lm, r) for r in requests]


def test_the_queue_holds_tickets_by_priority_then_in_arrival_order_preempted_first():
    """Against a sort by (priority, when queued), where samples queued again after a
    preemption count as queued before everything of their priority, in their order."""
    rng = np.random.default_rng(3)
    for _ in range(100):
        pending, expected, now = collections.deque(), [], 0
        for _ in range(int(rng.integers(1, 12))):
            now += 1
            if rng.random() < 0.7:
                ticket = SimpleNamespace(request=SimpleNamespace(
                    priority=int(rng.integers(-2, 3))))
                prefill_groups.enqueue(pending, ticket)
                expected.append(((ticket.request.priority, now), ticket))
            else:
                again = [SimpleNamespace(request=SimpleNamespace(priority=int(p)))
                         for p in rng.integers(-2, 3, int(rng.integers(1, 4)))]
                prefill_groups.requeue_first(pending, again)
                expected += [((t.request.priority, -now * 10 + i), t)
                             for i, t in enumerate(again)]
        assert list(pending) == [t for _, t in sorted(expected, key=lambda e: e[0])]


def test_a_request_of_a_lower_priority_value_is_served_before_those_queued_before_it(tiny_lm):
    """Two slots run long samples and two short ones fill the staged rows; of two requests
    queued after them, the one of priority -1 is staged and served first, in the slot the
    shorter long sample leaves (the other's ends after both). Each gets its tokens alone."""
    config, _, params = tiny_lm
    engine = Engine(config, params, max_slots=2, chunk_size=CHUNK, max_queue=8,
                    prefill_batch=2)
    turn, finished = [0], {}

    def submit(name, request):
        collector = Collector()

        def on_delta(delta):
            collector(delta)
            if delta.finish_reason:
                finished[name] = turn[0]

        engine.submit(request, on_delta)
        return request, collector

    served = [submit(f"long{i}", GenerationRequest(prompt(140 + i, 4), max_tokens=m))
              for i, m in enumerate((12, 30))]
    engine.step()
    served += [submit(f"short{i}", GenerationRequest(prompt(142 + i, 4), max_tokens=2))
               for i in range(2)]
    engine.step()
    served += [submit(name, GenerationRequest(prompt(144 + i, 4), max_tokens=6, priority=p))
               for i, (name, p) in enumerate((("first", 0), ("urgent", -1)))]
    while engine.step():
        turn[0] += 1
    assert finished["urgent"] < finished["first"]
    assert [c.tokens() for _, c in served] == [alone(tiny_lm, r) for r, _ in served]
