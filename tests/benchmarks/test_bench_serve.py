"""`kvjax bench serve`'s report and its `transformers` contender."""

import numpy as np
import pytest

from kvjax import model as M
from kvjax.benchmarks.serve import format_results
from kvjax.benchmarks.workload import Result, Workload, make_workload


def test_each_throughput_ratio_names_the_contender_it_divides_by():
    workload = Workload(prompts=[[5, 6], [7]], max_tokens=[3, 5], arrivals=[0.0, 0.5])
    results = [Result(name, 8, seconds, np.array([0.1, 0.2]), np.array([gap] * 6))
               for name, seconds, gap in (("engine", 1.0, 0.0003), ("batches", 2.0, 0.0002),
                                          ("hf", 4.0, 0.010))]
    lines = format_results(results, workload, "setting").splitlines()
    ratios = [line for line in lines if line.startswith("throughput ratio")]
    assert ratios == ["throughput ratio, engine / batches: 2.00x; ITL p50 ratio 1.50x",
                      "throughput ratio, engine / hf: 4.00x; ITL p50 ratio 0.03x"]
    # Gaps of a fraction of a millisecond keep two decimals.
    assert "| engine | 8 | 1.00 | 150.0 | 199.0 | 0.30 | 0.30 |" in lines
    assert "| hf | 2 | 4.00 | 150.0 | 199.0 | 10.0 | 10.0 |" in lines


def test_transformers_continuous_batching_times_every_requested_token():
    from kvjax.benchmarks.serve_transformers import (
        run_transformers_continuous_batching,
        transformers_missing,
    )

    if (missing := transformers_missing()) is not None:
        pytest.skip(f"transformers' continuous batching: {missing}")

    config = M.preset("tiny")
    workload = make_workload(config, 6, rate=200.0, prompt_range=(2, 9),
                             output_range=(1, 7), seed=3)
    result = run_transformers_continuous_batching(config, workload, max_slots=4)
    assert result.tokens == sum(workload.max_tokens)
    assert len(result.ttft) == 6 and np.all(result.ttft > 0)
    # one gap between each pair of consecutive tokens of a request
    assert len(result.itl) == sum(workload.max_tokens) - 6 and np.all(result.itl >= 0)
    assert result.seconds >= workload.arrivals[-1] - workload.arrivals[0]


def test_the_report_takes_each_contenders_median_run_and_every_repeats_ratio():
    from kvjax.benchmarks.serve import median_run, ratio_line

    def run(name, seconds):
        return Result(name, 100, seconds, np.array([0.1]), np.array([0.01]))

    engine = [run("engine", s) for s in (1.0, 2.0, 4.0)]
    batches = [run("batches", s) for s in (2.0, 5.0, 4.0)]
    assert median_run(engine).seconds == 2.0 and median_run(batches).seconds == 4.0
    assert median_run(engine[:2]).seconds == 2.0  # the lower of an even number's middle two
    assert ratio_line(engine, batches) == (
        "throughput ratio in each of 3 repeats, engine / batches: 2.00x, 2.50x, 1.00x "
        "(median 2.00x)")


def test_a_shared_prefix_starts_every_prompt_and_leaves_the_rest_of_the_workload():
    config = M.preset("tiny")
    settings = dict(num_requests=5, rate=100.0, prompt_range=(2, 9), output_range=(1, 7),
                    seed=4)
    plain = make_workload(config, **settings)
    shared = make_workload(config, **settings, shared_prefix=6)
    preamble = shared.prompts[0][:6]
    assert len(preamble) == 6 and all(3 <= t < config.vocab_size for t in preamble)
    assert shared.prompts == [preamble + prompt for prompt in plain.prompts]
    assert (shared.max_tokens, shared.arrivals) == (plain.max_tokens, plain.arrivals)
    with pytest.raises(ValueError, match=r"shared prefix \(60\).*need 76 positions, more than "
                                         r"the model's max_len 64"):
        make_workload(config, **settings, shared_prefix=60)


def test_the_adapters_contender_spreads_the_requests_over_the_base_and_its_adapters():
    import jax

    from kvjax.benchmarks.serve import random_adapters, run_engine

    config = M.preset("tiny", positional_encoding="rope", activation="swiglu")
    params = M.init_params(config, jax.random.key(0))
    adapters = random_adapters(config, params, 2, 4, seed=0)
    assert [lora.rank for _, lora in adapters] == [4, 4]
    # every kernel of the layers, the FFN's gate too (a dense model has no shared expert)
    assert adapters[0][1].targets == M.lora.TARGETS[:7]
    assert random_adapters(config, params, 0, 4, seed=0) == []
    workload = make_workload(config, 6, rate=500.0, prompt_range=(2, 9),
                             output_range=(1, 7), seed=3)
    result = run_engine(config, params, workload, max_slots=2, adapters=adapters)
    assert result.tokens == sum(workload.max_tokens) and len(result.ttft) == 6
    assert ", 2 LoRA adapters," in result.name


def test_a_translators_workload_fits_its_sources_and_targets_apart():
    """A source and its target each fit an encoder-decoder's max_len, where a language model
    would need the prompt and output together; a shared prefix, which only the prefix cache
    serves, is refused for it."""
    from kvjax.benchmarks.serve import serve_benchmark

    settings = dict(num_requests=3, rate=100.0, prompt_range=(2, 60), output_range=(1, 60))
    translator = make_workload(M.preset("tiny", num_encoder_layers=2), **settings)
    assert max(len(p) for p in translator.prompts) <= 60
    with pytest.raises(ValueError, match=r"need 120 positions, more than the model's max_len"):
        make_workload(M.preset("tiny"), **settings)
    with pytest.raises(ValueError, match="shared_prefix=4 measures the prefix cache"):
        serve_benchmark("tiny", 3, 100.0, (2, 8), (1, 8), max_slots=2, chunk_size=None,
                        batch=2, shared_prefix=4, encoder_layers=2)
