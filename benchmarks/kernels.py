"""Where a decode step's time goes: every kernel of one `decode.generate` call (or of a
serving engine's chunks doing the same work), read from a `jax.profiler` trace and counted
per generated token (`kvjax bench kernels [--engine]`).

A decode step reads every weight once, so its floor is the weights' bytes over the memory
bandwidth. The table says how far each kernel is from that: a matrix product near the
bandwidth, a kernel that writes out an array as large as a weight (a product XLA split into
a multiply and a sum that it did not fuse), or dozens of small kernels of a microsecond each.
Beside the kernels' own time it gives the call's time per step: the difference is the
device waiting for the host, as on a GPU every `while_loop` iteration and every `lax.cond`
copies its predicate to the host (the device-to-host copies counted per step) before the
next part is launched. The profiler itself slows the host, so that difference is an upper
bound: `kvjax bench decode` times the steps.

On a GPU the kernels are the events of the device's streams; on a CPU, those of XLA's
threads (thunks), where a loop XLA compiles whole (the host-planned loop's inner steps) is
not seen inside. Kernels a GPU runs from a command buffer (the engine's chunk, whose loops
are kept on the device: `kvjax.device_loops`) are not seen inside either: the untraced time
per step printed beside each profile says what the whole costs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import re
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable

import jax
import numpy as np

from kvjax import decode
from kvjax import model as M
from kvjax.decode.plan import planned_by

from .decode import benchmark_model, parse_loop

# Bookkeeping events on XLA:CPU's threads, and the control flow that holds kernels.
_CPU_NOT_KERNELS = re.compile(r"ThreadpoolListener|end: |ThunkExecutor|(while|cond|call)\.\d")
_HOST_COPY = "MemcpyD2H"

Span = tuple[int, int, str]  # start ns, end ns, name


@dataclasses.dataclass(frozen=True)
class KernelRow:
    name: str
    calls_per_step: float
    us_per_step: float


@dataclasses.dataclass(frozen=True)
class KernelProfile:
    """Per generated token (the prefill's kernels shared out among them): each kernel's time
    and calls (`rows`, longest first), the kernels' time counted once where they overlap
    (`busy_us`), the call's time from its first kernel to its last (`wall_us`) and the copies
    to the host (`host_copies`). `device` names where the kernels ran."""

    steps: int
    device: str
    rows: tuple[KernelRow, ...]
    busy_us: float
    wall_us: float
    host_copies: float

    @property
    def kernels_per_step(self) -> float:
        return sum(row.calls_per_step for row in self.rows)


def kernel_spans(space) -> tuple[list[Span], int, str]:
    """(kernels, copies to the host, device) of a `jax.profiler.ProfileData`: a GPU's if the
    trace has one, else XLA:CPU's."""
    planes = list(space.planes)
    gpus = [p for p in planes if p.name.startswith("/device:GPU")]
    kernels, copies = [], 0
    for plane in gpus:
        for line in plane.lines:
            if not line.name.startswith("Stream"):  # module and op summaries repeat them
                continue
            for event in line.events:
                if event.name == _HOST_COPY:
                    copies += 1
                else:
                    kernels.append((event.start_ns, event.start_ns + event.duration_ns,
                                    event.name))
    if gpus:
        return kernels, copies, gpus[0].name
    for plane in planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):
                continue
            kernels += [(e.start_ns, e.start_ns + e.duration_ns, e.name) for e in line.events
                        if not _CPU_NOT_KERNELS.match(e.name)]
    return kernels, 0, "/host:CPU"


def busy_ns(spans: list[Span]) -> int:
    """The time covered by at least one span."""
    total, end = 0, None
    for start, stop, _ in sorted(spans):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def summarize(spans: list[Span], copies: int, steps: int, device: str) -> KernelProfile:
    """The profile of a call of `steps` steps whose kernels are `spans`."""
    if not spans:
        raise RuntimeError(f"the trace holds no kernels of {device}")
    by_name = defaultdict(lambda: [0, 0])
    for start, stop, name in spans:
        by_name[name][0] += 1
        by_name[name][1] += stop - start
    rows = tuple(KernelRow(name, calls / steps, ns / 1e3 / steps)
                 for name, (calls, ns) in sorted(by_name.items(), key=lambda kv: -kv[1][1]))
    wall = max(s[1] for s in spans) - min(s[0] for s in spans)
    return KernelProfile(steps, device, rows, busy_ns(spans) / 1e3 / steps,
                         wall / 1e3 / steps, copies / steps)


def profile_kernels(run: Callable[[], object], steps: int) -> KernelProfile:
    """Runs `run` (compiled already) once under the profiler; its kernels per one of its
    `steps` steps."""
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(run())
        traces = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
        if len(traces) != 1:
            raise RuntimeError(f"expected one trace in {trace_dir}, found {traces}")
        spans, copies, device = kernel_spans(ProfileData.from_file(traces[0]))
    return summarize(spans, copies, steps, device)


def _model(preset, hf_dir, layers, dtype, cache_dtype):
    name, config, params = benchmark_model(preset, hf_dir)
    config, params = M.with_precision(config, params, dtype, cache_dtype)
    if layers == "unrolled":
        config, params = config.replace(scan_layers=False), M.unstack_layer_params(config, params)
    return name, config, params


def profile_decode(preset: str, hf_dir: str | None, batch: int, prompt_len: int,
                   new_tokens: int, layers: str = "unrolled", dtype: str | None = None,
                   cache_dtype: str | None = None,
                   loop: str = "default") -> tuple[str, KernelProfile, float]:
    """(the model's name, the kernels of one greedy `generate` call of `new_tokens` tokens
    for `batch` random prompts of `prompt_len` tokens, its seconds per step untraced), for
    the model `kvjax bench decode` times, with its decode loop `loop` (`kvjax bench decode
    --loops`)."""
    planner = parse_loop(loop)  # a bad name fails first
    name, config, params = _model(preset, hf_dir, layers, dtype, cache_dtype)
    prompts = np.random.default_rng(batch).integers(3, config.vocab_size, (batch, prompt_len))
    net = M.build_model(config)

    def run():
        return jax.block_until_ready(decode.generate(net, params, prompts.astype(np.int32),
                                                     max_new_tokens=new_tokens).tokens)

    with contextlib.nullcontext() if planner is None else planned_by(planner):
        run()  # compiles
        started = time.perf_counter()
        run()
        seconds = (time.perf_counter() - started) / new_tokens
        return name, profile_kernels(run, new_tokens), seconds


def profile_engine(preset: str, hf_dir: str | None, batch: int, prompt_len: int,
                   new_tokens: int, layers: str = "unrolled", dtype: str | None = None,
                   cache_dtype: str | None = None) -> tuple[str, KernelProfile, float]:
    """(the model's name, the kernels of a serving engine of `batch` slots while they make
    `new_tokens` greedy tokens each from `batch` random prompts, the engine's seconds per
    step untraced): the same work as `profile_decode`'s call, as the engine's chunks do it
    (the prefills' kernels shared out over the tokens too)."""
    from kvjax.serve import Engine, GenerationRequest

    name, config, params = _model(preset, hf_dir, layers, dtype, cache_dtype)
    prompts = np.random.default_rng(batch).integers(3, config.vocab_size, (batch, prompt_len))
    # No prefix cache: the prompts share nothing, and keeping them only adds copies.
    engine = Engine(config, params, max_slots=batch, max_len=prompt_len + new_tokens,
                    max_queue=batch, prefix_cache_rows=0)

    def run() -> float:
        """The seconds from the engine's start to its last token: every request is queued
        before its thread starts, so that its first turn prefills them together, as
        `profile_decode`'s call does."""
        done, errors = threading.Semaphore(0), []

        def on_delta(delta):
            if isinstance(delta, Exception):
                errors.append(delta)
            if isinstance(delta, Exception) or delta.finish_reason:
                done.release()

        for prompt in prompts:
            engine.submit(GenerationRequest(tuple(int(t) for t in prompt),
                                            max_tokens=new_tokens), on_delta)
        started = time.perf_counter()
        engine.start()
        for _ in prompts:
            if not done.acquire(timeout=600):
                raise RuntimeError("the engine answered no request in 10 minutes")
        seconds = time.perf_counter() - started
        engine.close()
        if errors:
            raise RuntimeError(f"the engine failed: {errors[0]!r}")
        return seconds

    try:
        run()  # compiles the programs its turns run
        seconds = run() / new_tokens
        return name, profile_kernels(run, new_tokens), seconds
    finally:
        engine.close()


def format_profile(profile: KernelProfile, title: str, top: int = 30) -> str:
    """A Markdown table of the `top` longest kernels and the totals."""
    lines = [f"{title}. Kernels on {profile.device}, per generated token (the prefill's "
             f"shared out over the {profile.steps} tokens):", "",
             "| kernel | µs per token | calls per token |", "|:---|---:|---:|"]
    lines += [f"| `{row.name}` | {row.us_per_step:.2f} | {row.calls_per_step:.2f} |"
              for row in profile.rows[:top]]
    rest = profile.rows[top:]
    if rest:
        lines.append(f"| {len(rest)} others | {sum(r.us_per_step for r in rest):.2f} | "
                     f"{sum(r.calls_per_step for r in rest):.2f} |")
    lines += ["", f"Per token: {profile.kernels_per_step:.1f} kernels, busy "
              f"{profile.busy_us:.1f} µs (kernels, overlaps counted once), "
              f"{profile.wall_us:.1f} µs from the first kernel to the last, "
              f"{profile.host_copies:.2f} copies to the host."]
    return "\n".join(lines)
