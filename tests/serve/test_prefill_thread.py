"""Where the engine dispatches its prefills (`serve/prefill_thread.py`): on a CPU of one
device, from a thread of its own, whose programs XLA:CPU runs beside the chunk in flight;
elsewhere, or on a mesh, from the engine's thread. Either way a request gets the tokens it
gets alone, and an error raised on the prefill thread is raised where it was called."""

import threading

import jax
import numpy as np
import pytest
from conftest import FakeTokenizer

from kvjax import decode, parallel
from kvjax.serve import Engine, GenerationRequest, staging
from kvjax.serve.prefill_thread import prefill_dispatcher

# Where this suite runs decides where the prefills go: a GPU or TPU keeps them on the
# engine's thread, and the tests check that instead.
OWN_THREAD = jax.default_backend() == "cpu" and jax.process_count() == 1


def thread_name() -> str:
    return threading.current_thread().name


def test_a_prefill_is_dispatched_from_its_own_thread_only_on_a_cpu_of_one_device():
    here = thread_name()
    ran_on = prefill_dispatcher(None)(thread_name)
    assert ran_on.startswith("kvjax-prefill") if OWN_THREAD else ran_on == here
    one_device = parallel.make_mesh({parallel.DATA: 1, parallel.MODEL: 1}, jax.devices()[:1])
    assert prefill_dispatcher(one_device)(thread_name) == here

    def refuse(prompt):
        raise ValueError(f"bad prompt {prompt}")

    with pytest.raises(ValueError, match="bad prompt 7"):  # raised where it was called
        prefill_dispatcher(None)(refuse, 7)


class Deltas:
    """Every delta of one request; `ended` is set by its last one, or by an error."""

    def __init__(self):
        self.tokens, self.errors, self.ended = [], [], threading.Event()

    def __call__(self, delta):
        if isinstance(delta, Exception):
            self.errors.append(delta)
            self.ended.set()
            return
        self.tokens += delta.token_ids
        if delta.finish_reason:
            self.ended.set()


def test_a_running_engine_prefills_where_the_dispatcher_says_and_serves_generates_tokens(
        tiny_lm, monkeypatch):
    config, net, params = tiny_lm
    threads = []
    prefill = staging.prefill_state

    def watched(*args):
        threads.append(thread_name())
        return prefill(*args)

    monkeypatch.setattr(staging, "prefill_state", watched)
    engine = Engine(config, params, max_slots=4, chunk_size=4, max_queue=8, prefill_batch=4,
                    tokenizer=FakeTokenizer())
    prompts = [np.random.default_rng(i).integers(3, 64, n).tolist()
               for i, n in enumerate((3, 6, 5))]
    expected = decode.generate(net, params, prompts, max_new_tokens=8).token_lists()
    engine.start()
    try:
        served = [Deltas() for _ in prompts]
        for prompt, deltas in zip(prompts, served, strict=True):
            engine.submit(GenerationRequest(tuple(prompt), max_tokens=8), deltas)
        assert all(deltas.ended.wait(120) for deltas in served)
        assert [d.errors for d in served] == [[], [], []]
        assert [d.tokens for d in served] == expected
        assert threads and all(t.startswith("kvjax-prefill") == OWN_THREAD for t in threads)
    finally:
        engine.close()
