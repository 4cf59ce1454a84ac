"""The serving benchmark's third contender: `transformers`' own continuous batching.

Hugging Face GPT-2 of the preset's sizes with random weights (the sizes of kvjax's model,
not its weights, as in the decode benchmark), on PyTorch with one thread per CPU, served by
`transformers`' `ContinuousBatchingManager` (the engine behind `generate_batch`, made with
`init_continuous_batching`): paged KV cache, a FIFO scheduler that mixes prefill and decode
tokens in one forward pass, its generation loop on its own thread. Each request is added
with `add_request` at its Poisson arrival time, greedy, with no end-of-sequence id, so it
makes exactly its `max_tokens`; the counts are checked.

Timing: the manager records the moment each token is sampled (`record_timestamps`), on its
generation thread. TTFT is the first token's moment minus the request's arrival; the
inter-token latencies are the gaps between a request's consecutive tokens. (The kvjax engine
is timed where its listener receives tokens, a chunk at a time, each chunk's gap shared
evenly by its tokens: its ITL p99 is smoother for it, its TTFT a little later.) The wall
time runs from the first arrival to the last token sampled.

At most `max_slots` requests decode together (`max_requests_per_batch`), as in the engine;
the cache holds every slot's longest request, so nothing is evicted, and one forward pass
takes up to `max_slots` times the longest prompt in tokens, enough to prefill every slot at
once. Before the timed run a few requests go through the same manager, untimed, as the
other contenders compile before theirs.

Needs `torch` and `transformers` (`pip install -e ".[bench]"`), imported only here.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np

from kvjax.benchmarks.decode import torch_on_gpu
from kvjax.benchmarks.random_hf import random_gpt2
from kvjax.benchmarks.workload import Result, Workload

WARM_UP_REQUESTS = 4
PAGE_SIZE = 256  # tokens per cache block, transformers' default


# The oldest transformers this contender was run with: its continuous-batching API (manager
# warm-up, per-request timestamps) changed between releases before it.
OLDEST_TRANSFORMERS = (5, 23)


def transformers_missing() -> str | None:
    """Why the contender cannot run here, or None when it can."""
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError:
        return "not installed (pip install -e '.[bench]')"
    release = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    if release < OLDEST_TRANSFORMERS:
        oldest = ".".join(map(str, OLDEST_TRANSFORMERS))
        return (f"transformers {transformers.__version__} is older than {oldest}, whose "
                "continuous-batching API this contender uses")
    return None


def versions() -> str:
    """The line the report prints under the table."""
    import torch
    import transformers

    on_gpu = torch_on_gpu()
    where = torch.cuda.get_device_name() if on_gpu else f"{torch.get_num_threads()} threads"
    return (f"transformers {transformers.__version__}, torch {torch.__version__} ({where}); "
            "GPT-2 of the preset's sizes with its own random weights")


def run_transformers_continuous_batching(config, workload: Workload, max_slots: int,
                                         timeout: float = 600.0) -> Result:
    """Serves `workload` with `transformers`' continuous batching (see the module's notes);
    raises RuntimeError when a request fails, makes the wrong number of tokens, or the
    requests are not all answered within `timeout` seconds after the last arrives."""
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    on_gpu = torch_on_gpu()
    model = random_gpt2(config).to("cuda" if on_gpu else "cpu")
    longest_prompt = max(len(p) for p in workload.prompts)
    longest = longest_prompt + max(workload.max_tokens)
    cb_config = transformers.ContinuousBatchingConfig(
        page_size=PAGE_SIZE, max_requests_per_batch=max_slots,
        num_blocks=max_slots * (math.ceil(longest / PAGE_SIZE) + 1),
        max_batch_tokens=max_slots * longest_prompt)
    # eos -1: no end-of-sequence id, so every request runs to its max_new_tokens.
    generation = transformers.GenerationConfig(do_sample=False, eos_token_id=-1,
                                               pad_token_id=0, max_new_tokens=longest)
    manager = model.init_continuous_batching(generation_config=generation,
                                             continuous_batching_config=cb_config)
    manager.warmup()
    manager.start()
    try:
        warm = range(min(WARM_UP_REQUESTS, len(workload.prompts)))
        _serve(manager, {f"warm-{i}": (workload.prompts[i], workload.max_tokens[i])
                         for i in warm}, None, timeout)
        requests = {str(i): (p, n) for i, (p, n) in enumerate(
            zip(workload.prompts, workload.max_tokens, strict=True))}
        start = time.perf_counter()
        outputs = _serve(manager, requests, [start + a for a in workload.arrivals], timeout)
    finally:
        manager.stop(block=True)
        manager.destroy()
    stamps = [np.asarray(outputs[str(i)].timestamps) for i in range(len(workload.prompts))]
    ttft = np.array([s[0] - (start + a) for s, a in zip(stamps, workload.arrivals,
                                                        strict=True)])
    itl = np.concatenate([np.diff(s) for s in stamps])
    end = max(s[-1] for s in stamps)
    name = f"transformers continuous batching ({max_slots} per batch)"
    return Result(name, workload.useful_tokens, end - (start + workload.arrivals[0]), ttft, itl)


def _serve(manager, requests: dict, arrivals: list[float] | None, timeout: float) -> dict:
    """Adds each request (id -> (prompt, max_tokens)) at its arrival (perf_counter seconds;
    None: all at once) and returns id -> finished output, each checked to hold exactly its
    max_tokens tokens and a timestamp for each."""
    for (request_id, (prompt, max_tokens)), arrival in zip(
            requests.items(), arrivals or [None] * len(requests), strict=True):
        if arrival is not None:
            time.sleep(max(0.0, arrival - time.perf_counter()))
        added = manager.add_request(list(prompt), request_id=request_id,
                                    max_new_tokens=max_tokens, record_timestamps=True,
                                    eos_token_id=-1)
        if added is None:
            raise RuntimeError(f"transformers refused request {request_id}")
    outputs, deadline = {}, time.perf_counter() + timeout
    while len(outputs) < len(requests):
        output = manager.get_result(timeout=1.0)
        if output is None:
            if not manager.is_running() or time.perf_counter() > deadline:
                raise RuntimeError(f"transformers answered {len(outputs)} of "
                                   f"{len(requests)} requests")
            continue
        if not output.is_finished():
            continue
        if output.error is not None:
            raise RuntimeError(f"transformers failed request {output.request_id}: "
                               f"{output.error}")
        wanted = requests[output.request_id][1]
        made = len(output.generated_tokens)
        if made != wanted or len(output.timestamps or ()) != wanted:
            raise RuntimeError(f"transformers made {made} tokens ({len(output.timestamps or ())}"
                               f" timestamps) for request {output.request_id}, not {wanted}")
        outputs[output.request_id] = output
    return outputs
