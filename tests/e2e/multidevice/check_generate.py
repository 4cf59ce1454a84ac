"""Generation on 8 devices: the tokens one device makes, rows padded, no per-step gathers."""

import importlib
import re

import jax
import numpy as np
import pytest

from kvjax import decode, parallel
from kvjax import model as M

G = importlib.import_module("kvjax.decode.generate")  # the module, not the function
P = importlib.import_module("kvjax.decode.prepare")

VARIANTS = {
    "lm scanned": M.preset("tiny", num_kv_heads=2, scan_layers=True),
    # Layer 0 over a window of 3, layer 1 global: the cache holds layer 0 in a ring of 3.
    "lm unrolled": M.preset("tiny", num_kv_heads=2, scan_layers=False, sliding_window=3,
                            full_attention_layers=(1,)),
    "translate scanned": M.preset("tiny", num_encoder_layers=1, scan_layers=True),
    "translate unrolled": M.preset("tiny", num_encoder_layers=1, scan_layers=False),
}
# 5 rows: they do not divide data=4 or data=8, so the batch is filled up.
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [3], [20, 21, 22, 23]]
NEW = 12


# Greedy decoding on two of the four and sampling, streaming and beams on the other two: each
# variant and each layer layout is run twice, on a mesh, and compiles are what this file costs.
@pytest.fixture(scope="module", params=["lm unrolled", "translate scanned"])
def model(request):
    config = VARIANTS[request.param]
    return M.build_model(config), M.init_params(config, jax.random.key(0))


@pytest.fixture(scope="module", params=["lm scanned", "translate unrolled"])
def some_model(request):
    config = VARIANTS[request.param]
    return M.build_model(config), M.init_params(config, jax.random.key(0))


def test_greedy_tokens_equal_one_device(model):
    net, params = model
    mesh = parallel.make_mesh("data=4,model=2")
    want = decode.generate(net, params, PROMPTS, max_new_tokens=NEW, eos_ids=(2,))
    got = decode.generate(net, params, PROMPTS, max_new_tokens=NEW, eos_ids=(2,), mesh=mesh)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.lengths, want.lengths)
    assert got.stop_reasons() == want.stop_reasons()


def test_params_on_a_mesh_carry_it():
    config = VARIANTS["lm unrolled"]
    net, params = M.build_model(config), M.init_params(config, jax.random.key(0))
    mesh = parallel.make_mesh("data=4,model=2")
    want = decode.generate(net, params, PROMPTS, max_new_tokens=NEW, mesh=mesh)
    on_mesh = parallel.shard_params(params, mesh)
    got = decode.generate(net, on_mesh, PROMPTS, max_new_tokens=NEW)  # no `mesh` argument
    np.testing.assert_array_equal(got.tokens, want.tokens)


def test_sampled_stream_and_beam_tokens_equal_one_device(some_model):
    net, params = some_model
    mesh = parallel.make_mesh("data=4,model=2")
    settings = dict(max_new_tokens=NEW, sampling=decode.Sampling(temperature=1.0, top_k=20),
                    rng=jax.random.key(3))
    want = decode.generate(net, params, PROMPTS, **settings)
    got = decode.generate(net, params, PROMPTS, mesh=mesh, **settings)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    chunks = list(decode.stream(net, params, PROMPTS, chunk_size=5, mesh=mesh, **settings))
    np.testing.assert_array_equal(np.concatenate(chunks, axis=1), want.tokens)
    want = decode.beam_search(net, params, PROMPTS[:4], max_new_tokens=NEW, num_beams=3)
    got = decode.beam_search(net, params, PROMPTS[:4], max_new_tokens=NEW, num_beams=3,
                             mesh=mesh)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.scores, want.scores, rtol=1e-5)


def test_constrained_greedy_and_beam_tokens_equal_one_device():
    """Each device holds the automata's tables whole and its rows' states: a regular
    expression, a choice and an unconstrained row give the one-device tokens, in beam
    search too."""
    from pathlib import Path

    from kvjax import text

    tokenizer = text.load(Path(__file__).resolve().parents[3] / "checkpoints"
                          / "python-docs-lm").tokenizer
    config = M.preset("tiny", num_kv_heads=2, vocab_size=tokenizer.vocab_size)
    net, params = M.build_model(config), M.init_params(config, jax.random.key(0))
    regex, choice = (decode.compile_constraint(c, tokenizer) for c in (
        decode.Regex("[a-z]+ (is|was) [0-9]{1,3}"), decode.Choice(["yes", "no", "maybe not"])))
    settings = dict(max_new_tokens=NEW, eos_ids=(tokenizer.eos_id,),
                    constraint=[regex, choice, None, choice])
    mesh = parallel.make_mesh("data=4,model=2")
    want = decode.generate(net, params, PROMPTS[:4], **settings)
    got = decode.generate(net, params, PROMPTS[:4], mesh=mesh, **settings)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert tokenizer.decode(want.token_lists()[1]) in ("yes", "no", "maybe not")
    want = decode.beam_search(net, params, PROMPTS[:4], num_beams=3, **settings)
    got = decode.beam_search(net, params, PROMPTS[:4], num_beams=3, mesh=mesh, **settings)
    np.testing.assert_array_equal(got.tokens, want.tokens)


def test_speculative_tokens_equal_one_device_plain_loop():
    """Prompt lookup's drafts verified on a mesh, each device drafting from its rows'
    contexts: the greedy tokens of one device's plain loop, for rows under a regular
    expression and a choice as for free ones, with a windowed layer's ring sized for a call
    that verifies the drafts."""
    from pathlib import Path

    from kvjax import text

    tokenizer = text.load(Path(__file__).resolve().parents[3] / "checkpoints"
                          / "python-docs-lm").tokenizer
    config = M.preset("tiny", num_kv_heads=2, vocab_size=tokenizer.vocab_size,
                      scan_layers=False, sliding_window=3, full_attention_layers=(1,))
    net, params = M.build_model(config), M.init_params(config, jax.random.key(0))
    regex, choice = (decode.compile_constraint(c, tokenizer) for c in (
        decode.Regex("[a-z]+ (is|was) [0-9]{1,3}"), decode.Choice(["yes", "no", "maybe not"])))
    settings = dict(max_new_tokens=NEW, eos_ids=(tokenizer.eos_id,),
                    constraint=[regex, None, choice, None])
    want = decode.generate(net, params, PROMPTS[:4], **settings)
    got = decode.generate(net, params, PROMPTS[:4], mesh=parallel.make_mesh("data=4,model=2"),
                          speculative=decode.Speculative(num_draft_tokens=3,
                                                         min_tokens_per_call=0), **settings)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.lengths, want.lengths)
    assert got.speculation.accepted.sum() > 0


def decode_loop_hlo(config, params, mesh, batch=8):
    """The compiled decode loop of a `generate` call on `mesh`, as HLO text."""
    net = M.build_model(config)
    mesh, params = P.placement(config, params, mesh)
    prepared = P.prepare(net, params, PROMPTS[:1] * batch, None, max_new_tokens=NEW,
                         eos_ids=(), num_beams=1, rng=None, mesh=mesh)
    state = G._begin(config, params, prepared)
    return G._continue.lower(config, params, state, prepared.stops, prepared.sampling,
                             prepared.stops.max_new_tokens, prepared.processors,
                             mesh=mesh).compile().as_text()


def collectives(hlo: str, op: str) -> list[str]:
    return re.findall(rf"= (\S+) {op}\(", hlo)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_decode_loop_gathers_no_index_arrays(scan_layers):
    """The cache write is a scatter batched over rows: each device writes its own rows with
    its own indices. On `data` alone a step needs no gather at all; with `model` too, none
    of an integer array (the attention and the split of the fused QKV projection gather
    activations and masks there)."""
    config = M.preset("tiny", scan_layers=scan_layers)
    params = M.init_params(config, jax.random.key(0))
    hlo = decode_loop_hlo(config, params, parallel.make_mesh("data=8"))
    assert collectives(hlo, "all-gather") == [] and collectives(hlo, "all-to-all") == []
    hlo = decode_loop_hlo(config, params, parallel.make_mesh("data=4,model=2"))
    gathered = collectives(hlo, "all-gather") + collectives(hlo, "collective-permute")
    assert gathered and not [s for s in gathered if s.startswith(("s32", "u32"))], gathered


def test_decode_benchmark_times_a_layer_mode_beside_two_devices():
    # One layer mode: the test of the command line runs the other, on one device.
    from kvjax.benchmarks import decode as bench

    rows, facts = bench.decode_benchmark("tiny", batch_sizes=(3,), prompt_len=4, new_tokens=8,
                                         repeats=1, layer_modes=("unrolled",),
                                         compare_hf=False, devices=2, log=lambda _: None)
    assert [(r.batch, r.label) for r in rows] == [(3, "unrolled"), (3, "unrolled, 2 devices")]
    # One set of weights: recomputing without a cache is timed once for every row.
    assert len({r.no_cache_seconds for r in rows}) == 1 and rows[0].no_cache_seconds > 0
    table = bench.format_table(rows, facts)
    assert "| 3 | unrolled, 2 devices |" in table and "| 3 | unrolled |" in table
    assert facts.weights_only_seconds > 0
    assert f"take {facts.weights_only_seconds * 1e3:.2f} ms" in table
