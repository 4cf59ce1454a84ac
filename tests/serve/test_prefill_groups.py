"""Which waiting prompts the engine prefills together: the oldest leads, the rest are chosen
so that the group is padded to the narrowest bucket it can be, and every request still gets
the tokens it gets alone."""

import itertools

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
