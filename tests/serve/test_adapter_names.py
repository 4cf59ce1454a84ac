"""serve/adapter_names.py: adapters loaded and unloaded while a server serves (vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter): a loaded one serves what `generate` makes
with it merged, an unloaded one is a 404 and frees its slot, and what cannot be served is a
400 naming why."""

import httpx
import jax
import pytest
from conftest import SERVED_MODEL, greedy_text, serve_app, trained_adapters

from kvjax import model as M
from kvjax.model import lora as L
from kvjax.serve.server import adapter_stack, build_app
from kvjax.text import LoadedModel

LORAS = {"a": L.LoRA(4, 8.0, ("q", "v", "o", "wi")), "b": L.LoRA(2, None, ("k", "wo")),
         "c": L.LoRA(4, None, ("wi", "o")), "wide": L.LoRA(8, None, ("q",))}


@pytest.fixture(scope="module")
def on_disk(tiny_loaded):
    """{path: (adapters, lora)}: what the server's loader finds at each path."""
    config, params = tiny_loaded.config, tiny_loaded.params
    return {f"/adapters/{name}": (trained_adapters(config, params, lora, i), lora)
            for i, (name, lora) in enumerate(LORAS.items())}


def test_adapters_loaded_and_unloaded_while_serving(tiny_loaded, on_disk):
    def load(path):
        if path not in on_disk:
            raise FileNotFoundError(f"no adapter in {path}")
        return on_disk[path]

    app = build_app(tiny_loaded, max_slots=2, chunk_size=4, prefill_batch=2,
                    adapters={"tiny-a": on_disk["/adapters/a"]}, max_adapters=2,
                    max_adapter_rank=4, load_adapter=load)
    url, stop = serve_app(app, 30.0)

    def post(path, **body):
        return httpx.post(f"{url}{path}", json=body, timeout=30.0)

    def served():
        return [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30.0).json()["data"]]

    def answers_as(model, weights_path):
        answer = post("/v1/completions", model=model, prompt="adapt", max_tokens=6,
                      temperature=0).json()
        weights = tiny_loaded.params if weights_path is None else L.merge(
            tiny_loaded.config, tiny_loaded.params, *on_disk[weights_path])
        lm = LoadedModel(tiny_loaded.config, tiny_loaded.tokenizer, weights,
                         tiny_loaded.directory)
        return answer["choices"][0]["text"] == greedy_text(lm, "adapt", 6)

    try:
        assert served() == [SERVED_MODEL, "tiny-a"]
        loaded = post("/v1/load_lora_adapter", lora_name="tiny-b", lora_path="/adapters/b")
        assert loaded.status_code == 200 and "'tiny-b' added" in loaded.text
        assert served() == [SERVED_MODEL, "tiny-a", "tiny-b"]
        assert answers_as("tiny-b", "/adapters/b") and answers_as("tiny-a", "/adapters/a")
        for body, message in (
                (dict(lora_name="tiny-b", lora_path="/adapters/b"), "already been loaded"),
                (dict(lora_name=SERVED_MODEL, lora_path="/adapters/b"), "the base model's"),
                (dict(lora_name="tiny-c", lora_path="/adapters/c"),
                 "every one of the 2 adapter slots holds an adapter"),
                (dict(lora_name="", lora_path="/adapters/c"), "lora_name='' must be")):
            refused = post("/v1/load_lora_adapter", **body)
            assert refused.status_code == 400 and message in refused.json()["error"]["message"]
        unloaded = post("/v1/unload_lora_adapter", lora_name="tiny-a")
        assert unloaded.status_code == 200 and "'tiny-a' removed" in unloaded.text
        gone = post("/v1/completions", model="tiny-a", prompt="x", max_tokens=2)
        assert gone.status_code == 404 and "`tiny-b`" in gone.json()["error"]["message"]
        assert post("/v1/unload_lora_adapter", lora_name="tiny-a").status_code == 404
        assert post("/v1/unload_lora_adapter").status_code == 400  # no name
        for path, message in (("/adapters/none", "cannot load the adapter in /adapters/none: "
                                                 "no adapter in /adapters/none"),
                              ("/adapters/wide", "cannot serve the adapter in /adapters/"
                                                 "wide: adapter 1 has rank 8, more than the "
                                                 "stack's 4")):
            refused = post("/v1/load_lora_adapter", lora_name="tiny-c", lora_path=path)
            assert refused.status_code == 400 and message in refused.json()["error"]["message"]
        # The slot tiny-a left serves tiny-c; tiny-b is as it was.
        assert post("/v1/load_lora_adapter", lora_name="tiny-c",
                    lora_path="/adapters/c").status_code == 200
        assert served() == [SERVED_MODEL, "tiny-c", "tiny-b"]
        assert answers_as("tiny-c", "/adapters/c") and answers_as("tiny-b", "/adapters/b")
        assert answers_as(SERVED_MODEL, None)
    finally:
        stop()


def test_without_a_loader_the_adapters_stay_as_served(tiny_loaded, on_disk):
    app = build_app(tiny_loaded, max_slots=2, chunk_size=4, prefill_batch=2,
                    adapters={"tiny-a": on_disk["/adapters/a"]})
    assert app.state.engine.adapters.count == 1
    url, stop = serve_app(app, 30.0)
    try:
        refused = httpx.post(f"{url}/v1/load_lora_adapter", timeout=30.0,
                             json={"lora_name": "tiny-b", "lora_path": "/adapters/b"})
        assert refused.status_code == 404
    finally:
        stop()
    with pytest.raises(ValueError, match="max_adapters=1 must be an int that holds the 2 "
                                         "adapters given"):
        build_app(tiny_loaded, adapters={"x": on_disk["/adapters/a"],
                                         "y": on_disk["/adapters/b"]}, max_adapters=1)


def test_a_request_read_before_its_adapter_was_unloaded_never_reaches_the_next_one():
    import asyncio
    import concurrent.futures
    import time

    from kvjax.serve.adapter_names import ServedAdapters
    from kvjax.serve.protocol import APIError

    class SlotsOnly:  # an engine that places adapters at once, as one between its chunks
        def __init__(self):
            self.placed = {}

        def put_adapter(self, index, adapter):
            self.placed[index] = adapter
            done = concurrent.futures.Future()
            done.set_result(None)
            return done

    async def run():
        engine = SlotsOnly()
        served = ServedAdapters(engine, SERVED_MODEL, ["tiny-a"], 1, load=lambda path: path)
        served.check_serves("tiny-a", 1)  # read while tiny-a held slot 1
        served.check_serves(SERVED_MODEL, 0)
        await served.unload("tiny-a")
        await served.load("tiny-c", "/adapters/c")  # waits for slot 1 to be emptied
        assert engine.placed == {1: "/adapters/c"} and served.served() == ["tiny-c"]
        with pytest.raises(APIError, match="`tiny-a` was unloaded while this request"):
            served.check_serves("tiny-a", 1)
        # Two loads of one name at once: one serves it, the other is refused.
        slow = ServedAdapters(engine, SERVED_MODEL, [], 2,
                              load=lambda path: time.sleep(0.2) or path)
        results = await asyncio.gather(slow.load("tiny-d", "/one"), slow.load("tiny-d", "/two"),
                                       return_exceptions=True)
        assert isinstance(results[0], str) and isinstance(results[1], APIError)
        assert "already been loaded" in str(results[1].body()) and slow.served() == ["tiny-d"]

    asyncio.run(run())


def test_a_mixtures_slots_for_loading_hold_its_experts_only_where_an_adapter_given_adapts_them():
    """Room for adapters loaded later (`--allow-lora-loading`) covers every kernel outside a
    mixture's experts; the experts' pairs, each slot a pair per expert, only where an
    adapter given adapts them."""
    config = M.preset("tiny", num_experts=4, experts_per_token=2, ffn_bias=False)
    params = M.init_params(config, jax.random.key(0))
    loaded = LoadedModel(config, None, params, "mixture")

    def held(stack):
        return sorted(stack.pairs["layers"]["0"]["self_attention"]) + sorted(
            stack.pairs["layers"]["0"].get("ffn", {}).get("experts", {}))

    assert held(adapter_stack(loaded, {}, None, None, loading=True)) == ["k", "o", "q", "v"]
    lora = L.LoRA(2, targets=("q", "wo"))
    given = {"a": (L.init_adapters(config, params, lora, jax.random.key(1)), lora)}
    assert held(adapter_stack(loaded, given, None, None, loading=True)) == [
        "k", "o", "q", "v", "wo"]
