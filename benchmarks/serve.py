"""The serving benchmark: continuous batching against fixed batches of `decode.generate`
and, where `transformers` is installed, against its own continuous batching.

A workload of requests with mixed prompt and output lengths arrives over time (Poisson
arrivals, a fixed seed) at a model with random weights, all greedy with no stop id, so each
request makes exactly its `max_tokens`. Two contenders serve it, three with `transformers`:

1. **the engine** (`kvjax.serve.Engine`, on its own thread): each request is submitted at its
   arrival time; its first token (TTFT) and each later one (inter-token latency) are timed
   as the engine hands them out, a chunk at a time.
2. **fixed batches**: the requests in arrival order, `batch` at a time, each batch one
   `decode.generate` call (every row runs until the batch's longest request is done, and the
   next batch starts only then, and not before its last request has arrived). The calls are
   timed for real and laid out on the arrivals' timeline; a request's first token is seen
   when its batch returns (generate does not stream), and its inter-token latency is the
   batch's time per step.
3. **`transformers` continuous batching** (`ContinuousBatchingManager`, GPT-2 of the same
   sizes, PyTorch): see `serve_transformers`.

Throughput counts the tokens the requests asked for, over the time from the first arrival
to the last answer. Every contender compiles or warms up before the timed runs. The engine
and the fixed batches run `repeats` times in turn: each one's median run is reported, and
the ratio of each repeat's pair.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import jax
import numpy as np

from kvjax import decode
from kvjax import model as M
from kvjax.decode.buckets import bucket
from kvjax.device_loops import device_loop_options
from kvjax.model import lora as L
from kvjax.model import lora_rows
from kvjax.serve import Engine, GenerationRequest

from .workload import Result, Workload, make_workload


def run_engine(config, params, workload: Workload, max_slots: int,
               chunk_size: int | None = None, max_len: int | None = None,
               prefix_cache_rows: int | None = None,
               steps_per_check: int | None = None, page_size: int | None = None,
               num_pages: int | None = None, max_staged: int | None = None,
               adapters=None, max_source_len: int | None = None) -> Result:
    """The engine with `max_slots` slots of `max_len` positions (default: the model's; an
    encoder-decoder's sources of `max_source_len`), `prefix_cache_rows` (default: the
    engine's), `steps_per_check`, the slots' pages (`page_size`, `num_pages`) and
    `max_staged` (the engine's defaults). With `adapters` (`Engine`'s) request i asks for
    adapter i mod (their number + 1), 0 the base alone."""
    engine = Engine(config, params, max_slots=max_slots, max_len=max_len, chunk_size=chunk_size,
                    max_queue=len(workload.prompts), prefix_cache_rows=prefix_cache_rows,
                    steps_per_check=steps_per_check, page_size=page_size, num_pages=num_pages,
                    max_staged=max_staged, adapters=adapters, max_source_len=max_source_len)
    served = 1 + (0 if engine.adapters is None else engine.adapters.count)
    engine.warm_up(len(p) for p in workload.prompts)
    first, last, gaps, errors = {}, {}, [], []
    done = threading.Semaphore(0)

    def listener(i):
        def on_delta(delta):
            now = time.perf_counter()
            if isinstance(delta, Exception):
                errors.append(delta)
                done.release()
                return
            if delta.token_ids:
                if i not in first:
                    first[i] = now
                    gaps.extend([0.0] * (len(delta.token_ids) - 1))
                else:
                    gaps.extend([(now - last[i]) / len(delta.token_ids)] *
                                len(delta.token_ids))
                last[i] = now
            if delta.finish_reason:
                done.release()
        return on_delta

    engine.start()
    start, most_live = time.perf_counter(), 0
    for i, (prompt, max_tokens, arrival) in enumerate(zip(
            workload.prompts, workload.max_tokens, workload.arrivals, strict=True)):
        time.sleep(max(0.0, start + arrival - time.perf_counter()))
        engine.submit(GenerationRequest(tuple(prompt), max_tokens=max_tokens,
                                        adapter=i % served), listener(i))
        most_live = max(most_live, engine.live_slots)
    for _ in workload.prompts:
        while not done.acquire(timeout=0.01):  # looks at the load a hundred times a second
            most_live = max(most_live, engine.live_slots)
        most_live = max(most_live, engine.live_slots)
    end = time.perf_counter()
    engine.close()
    if errors:
        raise RuntimeError(f"the engine failed: {errors[0]!r}")
    ttft = np.array([first[i] - (start + a) for i, a in enumerate(workload.arrivals)])
    pages = ("contiguous" if engine.pages is None
             else f"{engine.pages[0]} pages of {engine.pages[1]}")
    # Whether the chunk's loops were compiled to stay on the device (`kvjax.device_loops`).
    loops = ", loops on the device" if device_loop_options(jax.default_backend()) else ""
    lora = "" if served == 1 else f", {served - 1} LoRA adapters"
    sources = "" if engine.source_capacity is None else f" (sources {engine.source_capacity})"
    return Result(f"engine ({max_slots} slots of {engine.capacity}{sources}, {pages}{lora}, "
                  f"{engine.num_staged} staged, chunk "
                  f"{engine.chunk_size}, {engine.steps_per_check} steps per check, "
                  f"{engine.prefix_cache_rows} prefix rows{loops}; at most {most_live} live)",
                  workload.useful_tokens,
                  end - (start + workload.arrivals[0]), ttft, np.array(gaps))


def run_fixed_batches(config, params, workload: Workload, batch: int) -> Result:
    net = M.build_model(config)
    groups = [range(i, min(i + batch, len(workload.prompts)))
              for i in range(0, len(workload.prompts), batch)]

    def call(group):
        return decode.generate(net, params, [workload.prompts[i] for i in group],
                               max_new_tokens=max(workload.max_tokens[i] for i in group))

    seen = set()
    for group in groups:  # compile every shape the batches use
        shape = (len(group), bucket(max(len(workload.prompts[i]) for i in group),
                                    config.max_len),
                 bucket(max(workload.max_tokens[i] for i in group), config.max_len))
        if shape not in seen:
            seen.add(shape)
            jax.block_until_ready(call(group).tokens)
    clock, ttft, itl = 0.0, np.zeros(len(workload.prompts)), []
    for group in groups:
        begin = max(clock, workload.arrivals[group[-1]])
        started = time.perf_counter()
        output = call(group)
        seconds = time.perf_counter() - started
        clock = begin + seconds
        steps = int(output.lengths.max())
        for i in group:
            ttft[i] = clock - workload.arrivals[i]
            itl.extend([seconds / steps] * (workload.max_tokens[i] - 1))
    return Result(f"fixed batches of {batch} (decode.generate)", workload.useful_tokens,
                  clock - workload.arrivals[0], ttft, np.array(itl))


def random_adapters(config, params, count: int, rank: int, seed: int) -> list:
    """`count` adapters of `rank` on every attention and feed-forward kernel, as training
    leaves them (B no longer zero), `(adapters, lora)` pairs."""
    if not count:
        return []
    lora = L.LoRA(rank, targets=lora_rows.servable_targets(config, params))
    made = []
    for i in range(count):
        fresh = L.init_adapters(config, params, lora, jax.random.key(seed + 1 + i))
        made.append((jax.tree.map(lambda a: a + 0.01, fresh), lora))
    return made


def median_run(runs: Sequence[Result]) -> Result:
    """The run of median throughput (the lower middle one of an even number)."""
    ranked = sorted(runs, key=lambda r: r.tokens_per_second)
    return ranked[(len(ranked) - 1) // 2]


def ratio_line(engine_runs: Sequence[Result], other_runs: Sequence[Result]) -> str:
    """Each repeat's throughput ratio (the two contenders run one after the other), and
    their median."""
    ratios = [e.tokens_per_second / o.tokens_per_second
              for e, o in zip(engine_runs, other_runs, strict=True)]
    return (f"throughput ratio in each of {len(ratios)} repeats, {engine_runs[0].name} / "
            f"{other_runs[0].name}: {', '.join(f'{r:.2f}x' for r in ratios)} "
            f"(median {np.median(ratios):.2f}x)")


def format_results(results: list[Result], workload: Workload, setting: str,
                   notes: Sequence[str] = ()) -> str:
    def ms(values, q):  # inter-token gaps on an accelerator are fractions of a millisecond
        if not len(values):
            return "-"
        value = 1000 * np.percentile(values, q)
        return f"{value:.2f}" if value < 10 else f"{value:.1f}"

    lines = [setting, f"{len(workload.prompts)} requests, {workload.useful_tokens} tokens "
             f"asked for, arriving over {workload.arrivals[-1]:.1f} s",
             "| contender | tokens/s | wall s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | "
             "ITL p99 ms |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.name} | {r.tokens_per_second:.0f} | {r.seconds:.2f} | "
                     f"{ms(r.ttft, 50)} | {ms(r.ttft, 99)} | {ms(r.itl, 50)} | "
                     f"{ms(r.itl, 99)} |")
    for other in results[1:]:
        itl = ""
        if len(results[0].itl) and len(other.itl):
            gaps = np.percentile(results[0].itl, 50) / np.percentile(other.itl, 50)
            itl = f"; ITL p50 ratio {gaps:.2f}x"
        lines.append(f"throughput ratio, {results[0].name} / {other.name}: "
                     f"{results[0].tokens_per_second / other.tokens_per_second:.2f}x{itl}")
    lines += notes
    return "\n".join(lines)


def serve_benchmark(preset: str, num_requests: int, rate: float, prompt_range, output_range,
                    max_slots: int, chunk_size: int | None, batch: int, seed: int = 0,
                    long_tail: bool = False, compare_transformers: bool = True,
                    repeats: int = 3, max_len: int | None = None,
                    shared_prefix: int = 0, prefix_cache_rows: int | None = None,
                    steps_per_check: int | None = None, page_size: int | None = None,
                    num_pages: int | None = None, max_staged: int | None = None,
                    lora_adapters: int = 0, lora_rank: int = 8,
                    encoder_layers: int = 0, sliding_window: int | None = None,
                    full_attention_layers: tuple[int, ...] = ()) -> str:
    """The report: each contender's run of median throughput among `repeats` (the engine and
    the fixed batches take turns, so that both see the machine's drift alike), then the
    ratio in each repeat; transformers' contender runs once. The engine's slots hold
    `max_len` positions, by default the workload's longest prompt plus its longest output:
    a deployment sizes its slots to the longest request it accepts, as each fixed batch
    sizes its cache to its own longest. With `shared_prefix` N every prompt starts with the
    same N tokens; a model whose positions are not learned is given the positions that
    takes (its `max_len` raised, said in the report). With `lora_adapters` N, a third
    contender is the engine serving N random adapters of rank `lora_rank` on every
    attention and feed-forward kernel beside the base, the requests spread over the N + 1
    in turn, with the ratio of its throughput to the engine's without them. With
    `encoder_layers` N > 0 the preset is an encoder-decoder of N encoder layers, whose
    prompts are sources: a slot then holds the longest source beside the longest target.
    With `sliding_window` N every layer attends over the last N positions, but those of
    `full_attention_layers`, which attend over every position."""
    config = M.preset(preset, num_encoder_layers=encoder_layers, sliding_window=sliding_window,
                      full_attention_layers=full_attention_layers)
    translator = M.prompt_is_source(config)
    if translator and shared_prefix:
        raise ValueError(f"shared_prefix={shared_prefix} measures the prefix cache, which an "
                         "encoder-decoder has none of")
    prompt = shared_prefix + prompt_range[1]  # an encoder-decoder's is its source
    longest = max(prompt, M.prompt_slots(config, prompt) + output_range[1])
    sources = prompt if translator else None  # slots sized to the longest request, as below
    needed = max(longest, max_len or 0)
    raised = needed > config.max_len and config.positional_encoding != "learned"
    if raised:
        config = config.replace(max_len=needed)
    if max_len is None:
        max_len = longest
    elif max_len < longest:
        prefix = f"{shared_prefix} shared + " if shared_prefix else ""
        raise ValueError(f"max_len={max_len} is shorter than the longest request "
                         f"({prefix}{prompt_range[1]} prompt + {output_range[1]} output "
                         "tokens)")
    params = M.init_params(config, jax.random.key(seed))
    workload = make_workload(config, num_requests, rate, prompt_range, output_range, seed,
                             long_tail, shared_prefix)
    adapters = random_adapters(config, params, lora_adapters, lora_rank, seed)
    engine_runs, batch_runs, adapter_runs = [], [], []
    options = (max_slots, chunk_size, max_len, prefix_cache_rows, steps_per_check, page_size,
               num_pages, max_staged)
    for _ in range(repeats):
        engine_runs.append(run_engine(config, params, workload, *options,
                                      max_source_len=sources))
        batch_runs.append(run_fixed_batches(config, params, workload, batch))
        if adapters:
            adapter_runs.append(run_engine(config, params, workload, *options, adapters,
                                           max_source_len=sources))
    results = [median_run(engine_runs), median_run(batch_runs)]
    notes = [ratio_line(engine_runs, batch_runs)] if repeats > 1 else []
    if adapters:
        results.append(median_run(adapter_runs))
        notes.append(ratio_line(adapter_runs, engine_runs))
    if compare_transformers and translator:
        notes.append("transformers continuous batching: it serves decoder-only models")
    elif compare_transformers:
        from kvjax.benchmarks import serve_transformers

        missing = serve_transformers.transformers_missing()
        if missing:
            notes.append(f"transformers continuous batching: {missing}")
        else:
            results.append(serve_transformers.run_transformers_continuous_batching(
                config, workload, max_slots))
            notes.append(serve_transformers.versions())
    kind = f" as an encoder-decoder of {encoder_layers} encoder layers" if translator else ""
    setting = (f"preset {preset}{kind}, random weights, greedy; prompts {prompt_range[0]}-"
               f"{prompt_range[1]} tokens, outputs {output_range[0]}-{output_range[1]} "
               f"({'log-uniform' if long_tail else 'uniform'}), "
               f"Poisson arrivals at {rate:g}/s (seed {seed}); {jax.devices()[0].device_kind}")
    if full_attention_layers:
        setting += (f"; layers {', '.join(map(str, full_attention_layers))} over every "
                    f"position, the others over the last {sliding_window}")
    elif sliding_window:
        setting += f"; every layer over the last {sliding_window} positions"
    if shared_prefix:
        setting += f"\nevery prompt starts with the same {shared_prefix} tokens"
    if raised:
        setting += f"; the model's max_len raised to {needed}"
    return format_results(results, workload, setting, notes)
