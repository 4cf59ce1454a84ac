"""The compiler options that keep a program's loops on a GPU (`kvjax/device_loops.py`), and
the engine's chunk compiled with them."""

import jax
import numpy as np

from kvjax import decode
from kvjax import device_loops as D
from kvjax.serve import Engine, GenerationRequest, chunk


def test_a_gpu_records_loops_and_conditionals_and_no_other_backend_is_told_to():
    """This backend's XLA parses the options (it refuses a kind it does not know, by name),
    so the names are XLA's own; a GPU gets every kind, the loops and conditionals included."""
    assert D.device_loop_options("cpu") is None and D.device_loop_options("tpu") is None
    options = D.device_loop_options.__wrapped__("gpu")
    assert options == {D.COMMAND_BUFFER: ",".join(D.DEVICE_LOOP_COMMANDS)}
    assert {"WHILE", "CONDITIONAL"} <= set(options[D.COMMAND_BUFFER].split(","))
    assert not D._accepted({D.COMMAND_BUFFER: "NO_SUCH_KIND"})


def test_kinds_this_xla_does_not_know_are_left_out_and_xla_flags_win(monkeypatch):
    monkeypatch.setattr(D, "DEVICE_LOOP_COMMANDS", ("FUSION", "NO_SUCH_KIND", "WHILE",
                                                    "CONDITIONAL"))
    assert D.device_loop_options.__wrapped__("gpu") == {D.COMMAND_BUFFER:
                                                         "FUSION,WHILE,CONDITIONAL"}
    monkeypatch.setattr(D, "DEVICE_LOOP_COMMANDS", ("FUSION", "NO_SUCH_KIND"))
    assert D.device_loop_options.__wrapped__("gpu") is None  # no loop to keep on the device
    monkeypatch.setenv("XLA_FLAGS", f"--{D.COMMAND_BUFFER}=FUSION")
    assert D.device_loop_options.__wrapped__("gpu") is None


def test_the_engines_chunk_compiled_for_a_gpu_serves_what_generate_makes(tiny_lm, monkeypatch):
    """The chunk a GPU runs (its loops in the command buffer) is the same program with other
    compiler options: compiled with them here, it serves every request as `generate` alone."""
    config, net, params = tiny_lm
    gpu_chunk = chunk._compiled_chunk("gpu")
    assert gpu_chunk is not chunk._compiled_chunk(jax.default_backend())
    monkeypatch.setattr(chunk, "_compiled_chunk", lambda backend: gpu_chunk)
    engine = Engine(config, params, max_slots=2, chunk_size=4, max_queue=4, prefill_batch=2)
    prompts = [tuple(int(t) for t in np.random.default_rng(s).integers(3, 64, 5 + s))
               for s in range(3)]
    tokens = {}
    for i, prompt in enumerate(prompts):
        engine.submit(GenerationRequest(prompt, max_tokens=6 + i),
                      lambda delta, i=i: tokens.setdefault(i, []).extend(delta.token_ids))
    engine.run_until_idle()
    for i, prompt in enumerate(prompts):
        alone = decode.generate(net, params, [list(prompt)], max_new_tokens=6 + i)
        assert tokens[i] == alone.token_lists()[0]
