"""The compiler options that keep a program's loops on a GPU (`kvjax/device_loops.py`), and
the engine's chunk compiled with them."""

import jax
import numpy as np

from kvjax import decode
from kvjax import device_loops as D
from kvjax.serve import Engine, GenerationRequest, chunk, slots


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


def test_a_jit_compiles_with_the_options_of_the_backend_it_runs_on():
    calls = []

    @D.jit
    def double(x):
        calls.append(x)
        return 2 * x

    assert int(double(np.int32(3))) == 6 and int(double(np.int32(4))) == 8
    assert len(calls) == 1  # traced once, as jax.jit
    assert double.for_backend(jax.default_backend()) is double.for_backend(jax.default_backend())
    assert double.__name__ == "double"


def test_the_engines_programs_compiled_for_a_gpu_serve_what_generate_makes(tiny_lm,
                                                                           monkeypatch):
    """The engine's programs a GPU runs with its loops and conditionals in the command
    buffer (the chunk, the first tokens' choice) are the same programs with other compiler
    options: compiled with them here, they serve every request as `generate` alone."""
    config, net, params = tiny_lm
    on_gpu = jax.default_backend() == "gpu"
    for module, name in ((chunk, "_decode_chunk"), (slots, "_first_tokens")):
        program = getattr(module, name)
        gpu_program = program.for_backend("gpu")
        # Elsewhere the program is compiled without them: on a GPU it is this one already.
        assert (gpu_program is program.for_backend(jax.default_backend())) == on_gpu
        monkeypatch.setattr(module, name, gpu_program)
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
