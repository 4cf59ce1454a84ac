"""Several LoRA adapters served at once: each request's tokens are those `generate` makes
with its own adapter merged into the model, whatever adapters share the batch, and a kept
prefix serves only requests of its own adapter."""

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import greedy_text, run_full, trained_adapters
from test_engine import Collector, prompt

from kvjax import decode
from kvjax.decode import checks
from kvjax.decode.tracing import trace_count
from kvjax.model import lora as L
from kvjax.serve import Engine, GenerationRequest
from kvjax.serve.prompt_logprobs import prompt_logprobs

LORAS = (L.LoRA(4, 8.0, ("q", "v", "o", "wi")), L.LoRA(2, None, ("k", "wo")))


@pytest.fixture(scope="module")
def served(tiny_lm):
    """(engine, the params each adapter index stands for: 0 the base, then merged ones)."""
    config, _, params = tiny_lm
    adapters = [(trained_adapters(config, params, lora, i), lora) for i, lora in enumerate(LORAS)]
    engine = Engine(config, params, max_slots=4, chunk_size=4, prefill_batch=4,
                    prefix_block=4, prefix_cache_rows=2, adapters=adapters)
    merged = [params] + [L.merge(config, params, a, lora) for a, lora in adapters]
    return engine, merged


def alone(tiny_lm, params, request):
    config, net, _ = tiny_lm
    return decode.generate(net, params, [list(request.prompt)],
                           max_new_tokens=request.max_tokens).token_lists()[0]


def test_each_request_gets_its_own_adapters_tokens_in_a_mixed_batch(served, tiny_lm):
    engine, merged = served
    preamble = prompt(50, 9)  # two kept blocks of 4, shared by every adapter's prompts
    requests = [GenerationRequest(preamble + prompt(i, 1 + i % 3), max_tokens=6 + i % 4,
                                  adapter=i % 3) for i in range(7)]
    requests.append(GenerationRequest(requests[1].prompt, max_tokens=6, adapter=2))
    expected = [alone(tiny_lm, merged[r.adapter], r) for r in requests]
    by_adapter = [alone(tiny_lm, p, requests[0]) for p in merged]
    assert len({tuple(t) for t in by_adapter}) == 3  # each adapter changes the tokens
    collectors = [Collector() for _ in requests]
    for request, collector in zip(requests, collectors, strict=True):
        engine.submit(request, collector)
    engine.run_until_idle()
    assert [c.tokens() for c in collectors] == expected
    # The preamble, kept once per adapter, served the later requests of that adapter only.
    assert engine._prefixes.hits >= 2


def test_a_prompt_kept_with_one_adapter_is_prefilled_again_for_another(served, tiny_lm):
    engine, merged = served
    tokens = prompt(60, 11)
    hits = engine._prefixes.hits
    for adapter in (1, 2, 1):  # the store's two rows: one prefix for each adapter
        request = GenerationRequest(tokens, max_tokens=5, adapter=adapter)
        collector = Collector()
        engine.submit(request, collector)
        engine.run_until_idle()
        assert collector.tokens() == alone(tiny_lm, merged[adapter], request)
    assert engine._prefixes.hits == hits + 1  # the last one alone reused its adapter's
    index = engine._prefixes.index
    assert [index.lookup(tokens, (adapter, ""))[1] for adapter in (0, 1, 2)] == [0, 8, 8]


def test_after_warming_up_any_mix_of_adapters_compiles_nothing_new(served):
    engine, _ = served
    engine.warm_up(prompt_lengths=(5, 10, 15))  # the lengths asked for below
    names = ("serve_insert", "serve_first_tokens", "serve_chunk", "prefill",
             "prefill_after_prefix", "keep_prefixes")
    before = {name: trace_count(name) for name in names}
    collectors = [Collector() for _ in range(6)]
    for i, collector in enumerate(collectors):  # every adapter in every slot, prefixes hit
        engine.submit(GenerationRequest(prompt(80 + i % 2, 5 + 5 * (i % 3)), max_tokens=3,
                                        adapter=(i * 7) % 3), collector)
    engine.run_until_idle()
    assert all(len(c.tokens()) == 3 for c in collectors)
    assert {name: trace_count(name) for name in names} == before


def test_an_adapter_placed_while_serving_serves_its_tokens_and_compiles_nothing_new(
        served, tiny_lm):
    engine, merged = served
    config, _, params = tiny_lm
    third = L.LoRA(3, 6.0, ("q", "v", "wo"))  # within the stack's rank (4) and targets
    placed = (trained_adapters(config, params, third, 7), third)
    tokens = prompt(90, 9)  # two blocks of 4 kept with adapter 2, then with the new one
    names = ("serve_insert", "serve_first_tokens", "serve_chunk", "prefill",
             "prefill_after_prefix", "keep_prefixes")

    def served_alone(adapter):
        collector = Collector()
        engine.submit(GenerationRequest(tokens, max_tokens=5, adapter=adapter), collector)
        engine.run_until_idle()
        return collector.tokens()

    assert served_alone(2) == alone(tiny_lm, merged[2], GenerationRequest(tokens, 5))
    before = {name: trace_count(name) for name in names}
    waiting = engine.submit(GenerationRequest(tokens, max_tokens=5, adapter=2), Collector())
    refused = engine.put_adapter(2, placed)
    engine.step()
    with pytest.raises(ValueError, match="adapter 2 is asked for by a request still queued"):
        refused.result(timeout=0)
    waiting.cancel()
    engine.run_until_idle()
    done = engine.put_adapter(2, placed)
    engine.step()
    assert done.result(timeout=0) is None
    # Its prompt kept with the old adapter is not reused: the tokens are the new adapter's.
    hits = engine._prefixes.hits
    assert served_alone(2) == alone(tiny_lm, L.merge(config, params, *placed),
                                    GenerationRequest(tokens, 5))
    assert engine._prefixes.hits == hits
    assert served_alone(1) == alone(tiny_lm, merged[1], GenerationRequest(tokens, 5))
    assert {name: trace_count(name) for name in names} == before
    engine.put_adapter(2, (trained_adapters(config, params, LORAS[1], 1), LORAS[1]))
    engine.step()  # the fixture's adapter back in its slot
    assert served_alone(2) == alone(tiny_lm, merged[2], GenerationRequest(tokens, 5))
    wide = L.LoRA(8, None, ("q",))
    too_wide = engine.put_adapter(1, (trained_adapters(config, params, wide, 3), wide))
    engine.step()
    with pytest.raises(ValueError, match="adapter 1 has rank 8, more than the stack's 4"):
        too_wide.result(timeout=0)


def test_an_adapter_the_engine_does_not_serve_is_refused_by_its_index(served):
    engine, _ = served
    for bad in (3, -1, 1.0, True):
        with pytest.raises(checks.InvalidValue, match=f"adapter={bad} is not among the 2"):
            engine.submit(GenerationRequest((5, 6), adapter=bad), Collector())


def test_prompt_logprobs_are_the_adapted_models(served, tiny_lm):
    engine, merged = served
    config = tiny_lm[0]
    tokens = prompt(70, 7)
    chosen, _, _ = prompt_logprobs(config, engine.params, tokens, 2, 2, engine.adapters)
    logits = run_full(config, merged[2], jnp.asarray([tokens]))[0]
    want = jax.nn.log_softmax(logits.astype(jnp.float32))
    np.testing.assert_allclose(chosen[1:], [want[t - 1, tokens[t]] for t in range(1, 7)],
                               atol=2e-5)


def test_the_server_serves_each_adapter_under_its_name(served, tiny_loaded):
    from conftest import SERVED_MODEL, serve_app

    from kvjax.serve.server import build_app
    from kvjax.text import LoadedModel

    engine, merged = served
    config, params = engine.config, tiny_loaded.params
    adapters = {"tiny-a": (trained_adapters(config, params, LORAS[0], 0), LORAS[0])}
    app = build_app(tiny_loaded, max_slots=2, chunk_size=4, prefill_batch=2,
                    adapters=adapters)
    url, stop = serve_app(app, 30.0)
    try:
        listed = httpx.get(f"{url}/v1/models", timeout=30.0).json()["data"]
        assert [(m["id"], m["parent"]) for m in listed] == [(SERVED_MODEL, None),
                                                             ("tiny-a", SERVED_MODEL)]
        for model, weights in ((SERVED_MODEL, params), ("tiny-a", merged[1])):
            answer = httpx.post(f"{url}/v1/completions", timeout=30.0, json={
                "model": model, "prompt": "adapt", "max_tokens": 6, "temperature": 0}).json()
            lm = LoadedModel(config, tiny_loaded.tokenizer, weights, tiny_loaded.directory)
            assert answer["choices"][0]["text"] == greedy_text(lm, "adapt", 6)
        missing = httpx.post(f"{url}/v1/completions", timeout=30.0, json={
            "model": "tiny-b", "prompt": "x"})
        assert missing.status_code == 404 and "`tiny-a`" in missing.json()["error"]["message"]
        counted = httpx.get(f"{url}/metrics", timeout=30.0).text
        for model in (SERVED_MODEL, "tiny-a"):
            assert f'kvjax_model_requests_total{{model="{model}"}} 1.0' in counted
        assert 'model="tiny-b"' not in counted
    finally:
        stop()
    with pytest.raises(ValueError, match=f"adapter name '{SERVED_MODEL}' is the model's own"):
        build_app(tiny_loaded, adapters={SERVED_MODEL: adapters["tiny-a"]})


def test_a_placement_waiting_on_an_engine_that_cannot_serve_again_hears_why(tiny_lm,
                                                                            monkeypatch):
    from kvjax.model import lora_rows
    from kvjax.serve.engine import EngineFailed

    config, _, params = tiny_lm
    stack = lora_rows.stack(config, params, [], capacity=1, rank=2, targets=("q",))
    engine = Engine(config, params, max_slots=2, chunk_size=4, adapters=stack)
    waiting = engine.put_adapter(1, None)  # queued: no turn has run

    def no_memory(self):
        raise MemoryError("no memory for the slots")

    monkeypatch.setattr(Engine, "_reset", no_memory)
    engine._fail_all(RuntimeError("the chunk failed"))
    with pytest.raises(EngineFailed, match="no memory for the slots"):
        waiting.result(timeout=0)
    with pytest.raises(EngineFailed, match="cannot serve again"):
        engine.put_adapter(1, None)
