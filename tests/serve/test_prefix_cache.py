"""Prefix caching: a prompt that starts like a kept one prefills only the rest, and gets the
tokens it gets alone; the index finds the longest kept prefix and reuses rows least
recently used first."""

import numpy as np
import pytest
from test_engine import Collector
from test_pages import preemptions

from kvjax import decode
from kvjax import model as M
from kvjax.serve import Engine, GenerationRequest
from kvjax.serve.metrics import ServeMetrics
from kvjax.serve.prefix_cache import PLAIN, PrefixCache, PrefixIndex


def tokens(seed, length):
    return tuple(int(t) for t in np.random.default_rng(seed).integers(3, 60, length))


def alone(net, params, requests):
    """The greedy tokens `generate` makes for each request alone, from as few batches as the
    model's length allows: each row of a batch is its prompt alone
    (tests/decode/test_generate.py), and greedy tokens do not depend on the budget."""
    budget = max(r.max_tokens for r in requests)
    fits = [len(r.prompt) + budget <= net.config.max_len for r in requests]
    made = {}
    batch = [i for i, f in enumerate(fits) if f]
    if batch:
        rows = decode.generate(net, params, [list(requests[i].prompt) for i in batch],
                               max_new_tokens=budget).token_lists()
        made.update(zip(batch, rows, strict=True))
    for i in (i for i, f in enumerate(fits) if not f):
        made[i] = decode.generate(net, params, [list(requests[i].prompt)],
                                  max_new_tokens=requests[i].max_tokens).token_lists()[0]
    return [made[i][:r.max_tokens] for i, r in enumerate(requests)]


# The index ---------------------------------------------------------------------------------

def test_the_longest_kept_prefix_in_whole_blocks_leaving_the_last_token_to_feed():
    index = PrefixIndex(rows=2, block=4)
    kept = tokens(0, 10)  # two full blocks
    row = index.keep(kept)
    assert index.keep(kept) is None  # held already
    assert index.lookup(kept + (7, 8)) == (row, 8)
    assert index.lookup(kept[:9]) == (row, 8)
    assert index.lookup(kept[:8]) == (row, 4)  # its last token must still be fed
    assert index.lookup(kept[:4]) == (-1, 0)
    assert index.lookup(kept[:5] + (1, 1, 1, 1)) == (row, 4)  # diverges in the second block
    assert index.lookup(tokens(1, 12)) == (-1, 0)
    assert index.keep(kept[:3]) is None  # no full block


def test_rows_are_reused_least_recently_used_first():
    index = PrefixIndex(rows=2, block=4)
    a, b, c = tokens(2, 9), tokens(3, 9), tokens(4, 9)
    row_a, row_b = index.keep(a), index.keep(b)
    assert row_a != row_b
    assert index.lookup(a)[0] == row_a  # a hit counts as use: b is now the oldest
    assert index.keep(c) == row_b
    assert index.lookup(b) == (-1, 0)
    assert index.lookup(a) == (row_a, 8) and index.lookup(c) == (row_b, 8)


def test_a_key_that_collides_never_hands_out_another_prompts_prefix(monkeypatch):
    index = PrefixIndex(rows=2, block=4)
    # Every prompt's chain the same keys: only the kept tokens (and the adapter they were
    # kept with) tell prompts apart.
    monkeypatch.setattr(index, "_chain", lambda prompt, blocks, origin=PLAIN: [
        bytes([i]) for i in range(blocks)])
    kept, other = tokens(5, 9), tokens(6, 9)
    row = index.keep(kept)
    assert index.lookup(other) == (-1, 0)
    assert index.lookup(kept, (1, "")) == (-1, 0)
    assert index.lookup(kept, (0, "salt")) == (-1, 0)
    assert index.lookup(kept) == (row, 8)


def test_a_salted_prompt_shares_prefixes_only_with_its_own_salt():
    index = PrefixIndex(rows=3, block=4)
    kept = tokens(7, 9)
    salted = index.keep(kept, (0, "tenant a"))
    assert index.lookup(kept) == (-1, 0)
    assert index.lookup(kept, (0, "tenant b")) == (-1, 0)
    assert index.lookup(kept, (1, "tenant a")) == (-1, 0)  # another adapter's K/V
    assert index.lookup(kept + (3,), (0, "tenant a")) == (salted, 8)
    plain = index.keep(kept)  # the same tokens unsalted: a row of their own
    assert plain not in (None, salted)
    assert index.lookup(kept + (3,)) == (plain, 8)
    assert index.keep(kept, (0, "tenant a")) is None  # held already
    index.forget(1)  # an adapter's slot changing leaves the base model's prefixes
    assert index.lookup(kept + (3,), (0, "tenant a")) == (salted, 8)


def test_of_prompts_sharing_a_first_block_no_row_keeps_the_first_leads(tiny_lm):
    config, _, _ = tiny_lm
    cache = PrefixCache(config, rows=1, block=4, capacity=32)
    a, b, c = tokens(7, 4), tokens(8, 4), tokens(9, 4)
    kept = b + (1, 2)
    cache.index.keep(kept)
    prompts = [a + (1,), c + (5,), a + (2, 3), b + (9,), kept + (3,), a + (4,), c,
               c + (6,)]
    # a: prompts 0, 2 and 5 share it; c: 1 and 7 (6 has no token after the block); b is
    # kept already.
    assert cache.leaders(prompts) == [0, 1]
    assert cache.leaders([a]) == [] and cache.leaders([a + (1,), c + (1,)]) == []


def test_bad_sizes_are_refused_by_name(tiny_lm):
    config, _, params = tiny_lm
    with pytest.raises(ValueError, match="rows >= 1 and block >= 1"):
        PrefixIndex(rows=0)
    with pytest.raises(ValueError, match="prefix_cache_rows=-1 must be an int >= 0"):
        Engine(config, params, max_slots=2, prefix_cache_rows=-1)
    with pytest.raises(ValueError, match="prefix_block=0 must be an int >= 1"):
        Engine(config, params, max_slots=2, prefix_block=0)


# The engine --------------------------------------------------------------------------------

def serve(engine, requests):
    """Each request's tokens and logprobs of its one sample, served together."""
    made = [([], []) for _ in requests]

    def collect(i):
        def on_delta(delta):
            assert not isinstance(delta, Exception), delta
            made[i][0].extend(delta.token_ids)
            made[i][1].extend(delta.logprobs)
        return on_delta

    for i, request in enumerate(requests):
        engine.submit(request, collect(i))
    engine.run_until_idle()
    return made


@pytest.mark.parametrize("page_size", [None, 4])
def test_a_hit_reads_its_row_before_a_miss_staged_with_it_takes_the_row(tiny_lm, page_size):
    config, net, params = tiny_lm
    engine = Engine(config, params, max_slots=4, max_len=64, chunk_size=4, prefill_batch=4,
                    prefix_cache_rows=1, page_size=page_size)
    preamble = tokens(50, 20)
    requests = [GenerationRequest(preamble + (5,), max_tokens=3),
                GenerationRequest(preamble + (6, 7), max_tokens=6),  # a hit, with
                GenerationRequest(tokens(51, 18), max_tokens=6)]  # a miss kept in its row
    made = serve(engine, requests[:1]) + serve(engine, requests[1:])
    assert engine._prefixes.hits == 1  # noqa: SLF001
    assert [got for got, _ in made] == alone(net, params, requests)
    hit = decode.generate(net, params, [list(requests[1].prompt)], max_new_tokens=6,
                          return_logprobs=True)
    np.testing.assert_allclose(made[1][1], hit.logprobs[0], rtol=1e-5, atol=1e-5)


def test_running_requests_read_a_kept_preambles_pages_in_place(tiny_lm):
    """With pages, samples that start with a kept prefix take its row's pages into their
    tables instead of copies: three requests whose pages would not all fit the pool as
    copies run at once, the row they read is given to no other prompt while they run, and
    each makes what it makes alone; at the end no page is held and no row is read."""
    config, net, params = tiny_lm
    metrics = ServeMetrics()
    engine = Engine(config, params, max_slots=4, max_len=64, chunk_size=4, prefill_batch=4,
                    prefix_cache_rows=1, page_size=4, num_pages=24, metrics=metrics)
    preamble = tokens(30, 37)  # two blocks of 16 kept: 8 pages of 4
    requests = [GenerationRequest(preamble + (5,), max_tokens=2)]
    requests += [GenerationRequest(preamble + tokens(31 + i, 3), max_tokens=12)
                 for i in range(3)]  # 13 pages each as copies: 39
    requests.append(GenerationRequest(tokens(40, 17), max_tokens=2))  # a block to keep
    made = serve(engine, requests[:1])
    collectors = [Collector() for _ in requests[1:]]
    for request, collector in zip(requests[1:], collectors, strict=True):
        engine.submit(request, collector)
    for _ in range(3):  # until the three run
        engine.step()
        live = np.asarray(engine.state.slots.running)
        if live.sum() >= 3:
            break
    tables = np.asarray(engine.state.slots.cache.pages)[live]
    store_pages = engine.pages[0] + np.arange(8)  # the kept row's pages follow the slots'
    assert sum((row[:8] == store_pages).all() for row in tables) == 3
    assert all((row[8:][row[8:] >= 0] < engine.pages[0]).all() for row in tables)
    assert engine._prefixes.index.lookup(preamble + (1,))[1] == 32  # noqa: SLF001 - kept
    engine.run_until_idle()
    got = [made[0][0]] + [c.tokens() for c in collectors]
    assert got == alone(net, params, requests)
    assert preemptions(metrics) == 0
    assert not any(engine._prefixes.index.borrowed.values())  # noqa: SLF001
    assert np.all(np.asarray(engine.state.free_pages))


def test_prompts_sharing_a_preamble_prefill_only_the_rest_and_equal_generate_alone(tiny_lm):
    config, net, params = tiny_lm
    metrics = ServeMetrics()
    engine = Engine(config, params, max_slots=4, chunk_size=4, prefill_batch=4,
                    prefix_cache_rows=1, metrics=metrics)
    preamble, other = tokens(10, 37), tokens(11, 20)
    # Two prompts that share the preamble staged together: the first is prefilled and
    # kept before the second, which reuses it.
    first = [GenerationRequest(preamble + (5, 6), max_tokens=6),
             GenerationRequest(preamble + (8,), max_tokens=6)]
    # With the preamble kept: three hits (one ending where the cache does) and a miss.
    # Then another preamble evicts it (one row): the other's next prompt hits, and the
    # first preamble misses again.
    second = [GenerationRequest(preamble + tokens(12 + i, n), max_tokens=6 if n < 20 else 1)
              for i, n in enumerate((1, 9, 64 - 37 - 1))]
    second.append(GenerationRequest(tokens(20, 12), max_tokens=6))
    rounds = [first, second, [GenerationRequest(other + (9,), max_tokens=5)],
              [GenerationRequest(other + (9, 10, 11), max_tokens=5)],
              [GenerationRequest(preamble + (7,), max_tokens=5)]]
    served = [serve(engine, requests) for requests in rounds]
    requests = [request for requests in rounds for request in requests]
    assert [got for made in served for got, _ in made] == alone(net, params, requests)
    assert engine._prefixes.hits == 1 + 3 + 1
    assert engine._prefixes.tokens_reused == 32 + 3 * 32 + 16
    exposition = metrics.exposition().decode()
    assert "kvjax_prefix_cache_hits_total 5.0" in exposition
    assert "kvjax_prefix_cache_tokens_total 144.0" in exposition
    # Every request's prompt counted once, hit or miss, and its end timed.
    assert f"kvjax_prompt_tokens_total {sum(len(r.prompt) for r in requests)}.0" in exposition
    assert f"kvjax_request_latency_seconds_count {len(requests)}.0" in exposition

    # A hit's logprobs are a miss's, up to the last bits of a longer feed.
    plain = Engine(config, params, max_slots=4, chunk_size=4, prefix_cache_rows=0)
    (_, missed), = serve(plain, second[:1])
    assert plain._prefixes is None
    np.testing.assert_allclose(served[1][0][1], missed, rtol=1e-5, atol=1e-5)


def extend(tokens: list):
    """A callback that adds each delta's tokens to `tokens`."""
    return lambda delta: tokens.extend(delta.token_ids)


def test_requests_reuse_kept_prefixes_only_under_their_own_cache_salt(tiny_lm):
    config, net, params = tiny_lm
    # The engine of the test above (its programs): one store row, taken by each miss.
    engine = Engine(config, params, max_slots=4, chunk_size=4, prefill_batch=4,
                    prefix_cache_rows=1)
    preamble = tokens(13, 33)
    rounds = [(preamble + (5,), "a"), (preamble + (6,), None), (preamble + (7,), None),
              (preamble + (8,), "b"), (preamble + (9,), "a"), (preamble + (4,), "a")]
    hits, made, cached = [], [], []
    for prompt, salt in rounds:
        before = engine._prefixes.hits
        made.append([])
        ticket = engine.submit(GenerationRequest(prompt, max_tokens=4, cache_salt=salt),
                               extend(made[-1]))
        engine.run_until_idle()
        hits.append(engine._prefixes.hits - before)
        cached.append(ticket.cached_tokens)
    # Salt a's preamble serves neither the unsalted prompt nor salt b's, whose misses take
    # the row; a's next prompt then misses too, and the one after it hits (its 2 blocks).
    assert hits == [0, 0, 1, 0, 0, 1]
    assert cached == [0, 0, 32, 0, 0, 32]
    assert made == alone(net, params, [GenerationRequest(p, max_tokens=4) for p, _ in rounds])


def test_a_long_prompt_is_prefilled_a_part_per_turn_while_the_slots_decode(tiny_lm):
    config, net, params = tiny_lm
    engine = Engine(config, params, max_slots=2, chunk_size=2, prefix_cache_rows=1,
                    prefix_block=8, prefill_part=16)
    running, long_prompt = GenerationRequest(tokens(30, 5), max_tokens=16), tokens(31, 53)
    made = {"running": [], "long": []}
    turns = {"running": [], "long": []}

    def collect(name):
        return lambda delta: (made[name].extend(delta.token_ids),
                              turns[name].extend([turn] * len(delta.token_ids)))

    turn = 0
    engine.submit(running, collect("running"))
    engine.step()
    long = engine.submit(GenerationRequest(long_prompt, max_tokens=4), collect("long"))
    while engine.step():
        turn += 1
    for request, name in ((running, "running"), (GenerationRequest(long_prompt, max_tokens=4),
                                                 "long")):
        alone = decode.generate(net, params, [list(request.prompt)],
                                max_new_tokens=request.max_tokens).token_lists()[0]
        assert made[name] == alone
    # 53 tokens in parts of 16: 16, 32 and 48 fed in three turns, the third of which stages
    # the last 5 after them and makes the first token; the running request decoded in each.
    assert turns["long"][0] == 2
    assert set(range(3)) <= set(turns["running"])
    assert engine._prefixes.hits == 1 and engine._prefixes.tokens_reused == 48
    # Its own parts are no cache hit for it (what a request reports as cached); the same
    # prompt again finds them kept.
    assert long.cached_tokens == 0
    again = engine.submit(GenerationRequest(long_prompt, max_tokens=4), lambda delta: None)
    engine.run_until_idle()
    assert again.cached_tokens == 48


def test_a_part_whose_padding_would_pass_the_slots_end_is_fed_unpadded(tiny_lm):
    config, _, params = tiny_lm
    config = config.replace(max_len=128)
    net = M.build_model(config)
    # Parts of 40 are padded to 48; the third (80 kept, slots of 127) would end past the last
    # slot, so that its K/V were never written, yet kept for later prompts to read.
    engine = Engine(config, params, max_slots=2, chunk_size=2, max_len=127,
                    prefix_cache_rows=1, prefix_block=8, prefill_part=40)
    long_prompt = tokens(40, 125)
    serve(engine, [GenerationRequest(long_prompt, max_tokens=1)])
    later = GenerationRequest(long_prompt[:97], max_tokens=3)  # reuses 96, of the third part
    (got, logprobs), = serve(engine, [later])
    alone = decode.generate(net, params, [list(later.prompt)], max_new_tokens=3,
                            return_logprobs=True)
    assert engine._prefixes.tokens_reused == 96
    assert got == alone.token_lists()[0]
    np.testing.assert_allclose(logprobs, alone.logprobs[0], rtol=1e-5, atol=1e-5)
