"""The decode benchmark: how fast cached generation is, and against what.

For each batch size it times greedy `decode.generate` (a prefill, then one compiled
`while_loop` of decode steps) on a model with random weights, once with scanned layers
(one stacked cache and stacked weights, sliced per layer) and once with unrolled layers
(one buffer per layer, read in place): see `TransformerConfig.scan_layers`. It sets them
side by side, in the same run, with:

1. **no cache**: the textbook loop that recomputes the whole sequence for every new token.
   Each step is one jitted forward over the tokens so far, padded to a multiple of 32 so a
   handful of programs serve every length. Every shape the loop uses is compiled and timed
   (best of repeats); the loop's time is the sum of its steps' times, which leaves out
   the Python dispatch between steps (in the baseline's favour).
2. **Hugging Face GPT-2** (`transformers` on PyTorch CPU, its own KV cache), the same sizes,
   `generate` with `do_sample=False` and exactly the same number of new tokens. Optional:
   `pip install -e ".[bench]"`.
3. **the memory floor**: a decode step must read every parameter (of a mixture of experts,
   only the chosen experts') and the cached K/V once, so at batch 1 it cannot take less than
   (parameter bytes + cache bytes) / bandwidth. The bandwidth is measured here, as the best
   of a large reduction and a large matrix-vector product. Per-token decode time is the
   difference between two `generate` calls in one compiled bucket (N and the fewest new
   tokens sharing its buffer): prefill and dispatch cancel.
4. **the weights alone**: the same step's matrix-vector products and nothing else, chained
   in one compiled loop: how fast this backend streams the weights through the kernels a
   batch-1 step is made of. The gap from the floor to it is the backend's; what a step
   takes beyond it is spent on attention, the cache write, sampling and the layer stack.

Every time is the best of `repeats` runs, for every contender alike (on a shared machine the
slower runs measure the neighbours). Prefill is matmul-bound (T tokens per weight read); a
decode step at small batch reads every weight for one token per row: it is memory-bound.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import decode, parallel
from kvjax import model as M
from kvjax.decode.buckets import bucket, smallest_sharing
from kvjax.decode.plan import ON_DEVICE, STEPS_PER_CHECK, LoopPlan, Planner, planned_by
from kvjax.model.cache_size import format_bytes

from .floors import best_seconds, measure_bandwidth, step_param_bytes, time_weights_only_step
from .random_hf import random_gpt2

NO_CACHE_PAD = 32  # the no-cache loop pads the sequence to a multiple of this


@dataclasses.dataclass(frozen=True)
class Row:
    """One batch size and layer mode's measurements; times in seconds for the whole generation.
    The baselines do not depend on the layer mode: rows of one batch size share them."""

    batch: int
    layers: str
    kvjax_seconds: float
    decode_step_seconds: float
    no_cache_seconds: float | None
    hf_seconds: float | None
    new_tokens: int
    devices: int = 1  # kvjax's rows split over this many devices (`data` of a mesh)

    @property
    def label(self) -> str:
        return self.layers if self.devices == 1 else f"{self.layers}, {self.devices} devices"

    def tokens_per_second(self, seconds: float | None) -> float | None:
        return None if seconds is None else self.batch * self.new_tokens / seconds


@dataclasses.dataclass(frozen=True)
class Facts:
    """What every row shares: the setting, the machine and the memory floor at batch 1."""

    preset: str
    prompt_len: int
    new_tokens: int
    param_bytes: int
    cache_bytes_batch1: int
    bandwidth: float  # bytes per second
    weights_only_seconds: float  # a batch-1 step's matrix-vector products alone
    machine: str
    hf_note: str

    @property
    def floor_seconds(self) -> float:
        return (self.param_bytes + self.cache_bytes_batch1) / self.bandwidth


def parse_loop(name: str) -> Planner | None:
    """A `--loops` name (default, device, host, host:K) as a planner for `planned_by`."""
    if name == "default":
        return None
    if name == "device":
        return lambda rows: ON_DEVICE
    kind, _, steps = name.partition(":")
    if kind == "host" and (not steps or steps.isdigit() and int(steps) >= 1):
        steps_per_check = int(steps) if steps else STEPS_PER_CHECK
        return lambda rows: LoopPlan.for_rows(rows, steps_per_check)
    raise ValueError(f"decode loop {name!r} is not default, device, host or host:K "
                     f"(K >= 1 steps per check)")


def _time_kvjax(net, params, prompts, new_tokens: int, repeats: int, mesh=None,
                planner: Planner | None = None) -> tuple[float, float]:
    """(seconds for `new_tokens`, seconds per decode step). Both calls share one bucket.
    With a `mesh`, the rows are split over its `data` devices; with a `planner`, the loop
    is planned by it."""
    half = smallest_sharing(new_tokens, net.config.max_len)
    if mesh is not None:  # placed once, outside the timed calls
        params = parallel.shard_params(params, mesh)

    def run(n):
        return lambda: decode.generate(net, params, prompts, max_new_tokens=n,
                                       mesh=mesh).tokens

    with contextlib.nullcontext() if planner is None else planned_by(planner):
        run(new_tokens)()  # compiles the bucket both calls use
        full = best_seconds(run(new_tokens), repeats)
        shorter = best_seconds(run(half), repeats)
    return full, (full - shorter) / (new_tokens - half)


def _time_no_cache(config, params, prompts: np.ndarray, new_tokens: int,
                   repeats: int) -> float:
    """Seconds for the recompute-everything loop: sum over steps of one full forward."""
    @jax.jit
    def next_token(params, tokens_BT, last):
        logits_BTV = M.teacher_forced_logits(config, params, {"inputs": tokens_BT})
        return jnp.argmax(logits_BTV[:, last], axis=-1)

    batch, prompt_len = prompts.shape
    last = jnp.asarray(prompt_len - 1)

    def time_width(width: int) -> float:
        tokens = jnp.zeros((batch, width), jnp.int32).at[:, :prompt_len].set(prompts)
        jax.block_until_ready(next_token(params, tokens, last))  # compiles this width
        return best_seconds(lambda: next_token(params, tokens, last), repeats)

    # Step s sees the prompt and s generated tokens, padded up to a multiple of NO_CACHE_PAD.
    widths = [-(-(prompt_len + s) // NO_CACHE_PAD) * NO_CACHE_PAD for s in range(new_tokens)]
    seconds = {width: time_width(width) for width in sorted(set(widths))}
    return sum(seconds[width] for width in widths)


def _hf_runner(config: M.TransformerConfig, hf_dir: str | None = None,
               dtype: str = "float32") -> tuple[Callable | None, str]:
    """A function timing `transformers` generate for a batch of prompts, or None and why
    not: the model in `hf_dir` (the very weights kvjax runs, in `dtype`), else a GPT-2 of
    the preset's sizes with random weights in float32."""
    try:
        import torch
        import transformers
    except ImportError:
        return None, "not installed (pip install -e '.[bench]')"
    if hf_dir is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=getattr(torch, dtype)).eval()
    else:
        model = random_gpt2(config)

    on_gpu = torch_on_gpu()
    device = torch.device("cuda" if on_gpu else "cpu")
    model = model.to(device)

    def generate(ids, kwargs):
        out = model.generate(ids, **kwargs)
        if on_gpu:
            torch.cuda.synchronize()
        return out

    def run(prompts: np.ndarray, new_tokens: int, repeats: int) -> float:
        ids = torch.as_tensor(prompts, dtype=torch.long, device=device)
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, do_sample=False, use_cache=True,
                      pad_token_id=0)
        with torch.inference_mode():
            out = generate(ids, kwargs)  # warm-up
            if out.shape[1] != prompts.shape[1] + new_tokens:
                raise RuntimeError(f"HF generated {out.shape[1] - prompts.shape[1]} tokens")
            return best_seconds(lambda: generate(ids, kwargs), repeats)

    where = (torch.cuda.get_device_name(device) if on_gpu
             else f"{torch.get_num_threads()} threads")
    precision = dtype if hf_dir is not None else "float32"
    note = (f"transformers {transformers.__version__}, torch {torch.__version__}, {where}, "
            f"{precision}, {getattr(model.config, '_attn_implementation', None)} attention")
    return run, note


def torch_on_gpu() -> bool:
    """Whether PyTorch contenders run on the GPU: where kvjax runs on one, so that ratios
    compare like with like; needs torch."""
    import torch

    return jax.default_backend() == "gpu" and torch.cuda.is_available()


def benchmark_model(preset: str, hf_dir: str | None) -> tuple[str, M.TransformerConfig, dict]:
    """(name, scanned config, scanned params): a preset with random weights, or the
    decoder-only model in a Hugging Face directory."""
    if hf_dir is None:
        config = M.preset(preset).replace(scan_layers=True)
        return f"{preset} with random weights", config, M.init_params(config, jax.random.key(0))
    from kvjax import hf

    config, params = hf.load_model(hf_dir, scan_layers=True)
    if config.is_encoder_decoder:
        raise ValueError(f"{hf_dir} holds an encoder-decoder; the decode benchmark times "
                         "decoder-only models")
    name = os.path.basename(os.path.normpath(hf_dir))
    return f"{name} (Hugging Face directory)", config, params


LAYER_MODES = ("scanned", "unrolled")


def decode_benchmark(preset: str = "gpt-mini", batch_sizes: Sequence[int] = (1, 8, 32),
                     prompt_len: int = 32, new_tokens: int = 256, repeats: int = 3, *,
                     layer_modes: Sequence[str] = LAYER_MODES, compare_no_cache: bool = True,
                     compare_hf: bool = True, devices: int = 1, whole_cache: bool = False,
                     hf_dir: str | None = None, dtype: str | None = None,
                     cache_dtype: str | None = None, kernel_dtype: str | None = None,
                     loops: dict[str, Planner | None] | None = None,
                     log: Callable[[str], None] = print) -> tuple[list[Row], Facts]:
    """Measures every batch size and layer mode; see the module docstring for what and how.

    With `devices > 1`, kvjax is also timed with every batch split over that many devices
    (`data` of a mesh; on a CPU, host devices: see `kvjax.cli`), in rows of its own beside
    the one-device rows. Each device then holds all the weights and its share of the rows.
    `whole_cache` adds a row per layer mode whose decode steps read every cache slot, filled
    or not, as one block (`attention_block` = max_len): what each step read before decode
    attention went block by block. With `hf_dir` the model is the one in that Hugging Face
    directory (`preset` is then unused), and transformers runs the same weights.
    `dtype`, `cache_dtype` and `kernel_dtype` run kvjax (and its no-cache baseline) in that
    precision
    (`M.with_precision`); transformers runs a Hugging Face directory in `dtype` too, and the
    preset's random GPT-2 in float32. `loops` (name -> `parse_loop(name)`) times kvjax
    with each decode loop, in rows of its own (default: `generate`'s loop alone).
    """
    if new_tokens < 4:
        raise ValueError(f"new_tokens={new_tokens} must be >= 4 to time decode steps")
    name, config, params = benchmark_model(preset, hf_dir)
    config, params = M.with_precision(config, params, dtype, cache_dtype, kernel_dtype)
    if prompt_len + new_tokens > config.max_len:
        raise ValueError(f"prompt_len {prompt_len} + new_tokens {new_tokens} exceeds the "
                         f"{name} max_len {config.max_len}")
    unknown = sorted(set(layer_modes) - set(LAYER_MODES))
    if unknown or not layer_modes:
        raise ValueError(f"layer modes {unknown or list(layer_modes)} not in {LAYER_MODES}")
    if devices > jax.device_count():
        raise ValueError(f"devices={devices} but JAX sees {jax.device_count()} "
                         f"({jax.devices()[0].platform}); on a CPU, start with XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={devices}")
    meshes = {1: None}
    if devices > 1:
        meshes[devices] = parallel.make_mesh(f"data={devices}", jax.devices()[:devices])
    models = {"scanned": (config, params),
              "unrolled": (config.replace(scan_layers=False),
                           M.unstack_layer_params(config, params))}
    if whole_cache:
        models |= {f"{mode}, whole cache": (c.replace(attention_block=c.max_len), p)
                   for mode, (c, p) in list(models.items())}
        layer_modes = [m for mode in layer_modes for m in (mode, f"{mode}, whole cache")]
    hf, hf_note = (_hf_runner(config, hf_dir, dtype or "float32") if compare_hf
                   else (None, "skipped"))
    rows = []
    for batch in batch_sizes:
        prompts = np.random.default_rng(batch).integers(
            3, config.vocab_size, (batch, prompt_len)).astype(np.int32)
        timed = {}
        for mode in layer_modes:
            for count, mesh in meshes.items():
                for loop, planner in (loops or {"default": None}).items():
                    label = mode if loop == "default" else f"{mode}, {loop} loop"
                    log(f"batch {batch}: kvjax, {label}, {count} device(s) ...")
                    mode_config, mode_params = models[mode]
                    timed[label, count] = _time_kvjax(M.build_model(mode_config), mode_params,
                                                      prompts, new_tokens, repeats, mesh,
                                                      planner)
        no_cache = hf_seconds = None
        if compare_no_cache:
            log(f"batch {batch}: no cache ...")
            no_cache = _time_no_cache(config, params, prompts, new_tokens, repeats)
        if hf is not None:
            log(f"batch {batch}: Hugging Face transformers ...")
            hf_seconds = hf(prompts, new_tokens, repeats)
        rows += [Row(batch, mode, seconds, step, no_cache, hf_seconds, new_tokens, count)
                 for (mode, count), (seconds, step) in timed.items()]
    log("memory bandwidth ...")
    param_bytes = step_param_bytes(config, params)
    # The cache a step reads, at the middle of the timed steps (N/2 + 1 .. N).
    filled = prompt_len + (new_tokens // 2 + 1 + new_tokens) // 2
    log("weights alone ...")
    facts = Facts(name, prompt_len, new_tokens, param_bytes,
                  M.cache_size_bytes(config, 1, filled).total, measure_bandwidth(),
                  time_weights_only_step(config, params, repeats), _machine(), hf_note)
    return rows, facts


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    backend = jax.default_backend()
    if backend != "cpu":
        backend += f" ({jax.devices()[0].device_kind})"
    return f"{cpu}, {os.cpu_count()} cores; jax {jax.__version__} on {backend}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.1f}x"


def format_table(rows: Sequence[Row], facts: Facts) -> str:
    """A Markdown table of the rows and the facts behind them."""
    lines = [
        f"Greedy decode, `{facts.preset}`, {facts.prompt_len}-token "
        f"prompt, {facts.new_tokens} new tokens. Machine: {facts.machine}.",
        "",
        "| batch | layers | kvjax tokens/s | no cache tokens/s | HF tokens/s "
        "| vs no cache | vs HF | decode step ms |",
        "|---:|:---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ours = r.tokens_per_second(r.kvjax_seconds)
        no_cache = r.tokens_per_second(r.no_cache_seconds)
        hf = r.tokens_per_second(r.hf_seconds)

        def cell(value):
            return "-" if value is None else f"{value:,.0f}"

        lines.append(f"| {r.batch} | {r.label} | {cell(ours)} | {cell(no_cache)} | {cell(hf)} | "
                     f"{_ratio(ours, no_cache)} | {_ratio(ours, hf)} | "
                     f"{r.decode_step_seconds * 1e3:.2f} |")
    floor = facts.floor_seconds
    batch1 = [r for r in rows if r.batch == 1]
    lines += [
        "",
        f"Memory floor at batch 1: {format_bytes(facts.param_bytes)} of parameters + "
        f"{format_bytes(facts.cache_bytes_batch1)} of cache at "
        f"{facts.bandwidth / 1e9:.1f} GB/s (measured) = {floor * 1e3:.2f} ms per token.",
    ]
    weights = facts.weights_only_seconds
    lines.append(
        f"Weights alone: a batch-1 step's matrix-vector products, chained in one compiled "
        f"loop with nothing else, take {weights * 1e3:.2f} ms "
        f"({facts.param_bytes / weights / 1e9:.1f} GB/s of parameters) = "
        f"{weights / floor:.2f}x the floor.")
    for r in batch1:
        step = r.decode_step_seconds
        lines.append(f"Decode step at batch 1 ({r.label}): {step * 1e3:.2f} ms = "
                     f"{step / floor:.2f}x the floor = {step / weights:.2f}x the weights alone.")
    if any("whole cache" in r.layers for r in rows):
        capacity = bucket(facts.prompt_len, 1 << 30) + bucket(facts.new_tokens, 1 << 30)
        filled = facts.prompt_len + (facts.new_tokens // 2 + 1 + facts.new_tokens) // 2
        lines.append(
            f"Whole cache: generate gives each row {capacity} slots; over the timed steps "
            f"(tokens {facts.new_tokens // 2 + 2} to {facts.new_tokens}) the rows hold "
            f"{filled} on average, so a step that reads every slot reads "
            f"{1 - filled / capacity:.0%} empty ones.")
    lines.append(f"Hugging Face: {facts.hf_note}.")
    return "\n".join(lines)

