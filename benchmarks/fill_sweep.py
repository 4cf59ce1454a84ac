"""Decode step time against how much of the cache is filled, at a fixed capacity.

A decode step reads the cache only up to the longest row, in blocks (`attend_blocks`), so a
step at 64 filled slots of a 1,024-slot cache should cost about what a step costs whose
cache holds only 64 slots. For every layer layout and filled length this times one decode
step of `batch` rows, filled to that length, three ways:

- **capacity**: a cache of `capacity` slots read in blocks of `config.attention_block`
  (what `generate` runs);
- **tight**: a cache of exactly the filled slots (nothing to skip: what reading only the
  filled part can at best reach);
- **whole**: the `capacity` cache read as one block of every slot, filled or not (what each
  step cost before decode attention read in blocks);
- **paged**: a paged cache (`model/paged.py`) of `capacity` slots per row in pages of
  `page_size`, the rows' pages scattered over the pool, read through the page tables;
- **window**: the `capacity` cache with every layer attending over a sliding window of
  `window` slots (Mistral's, or a Gemma's local layers): past the window a step should cost
  what a `tight` step over the window costs, however much the rows hold.

Each is a compiled loop of `steps` decode steps that resets the rows' lengths before every
step, so every step sees the same fill; the cache is donated, so it is updated in place.
Variants are timed in turn within each repeat and each keeps its best time: on a shared
machine the slower repeats measure the neighbours.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import model as M

WAYS = ("capacity", "tight", "whole", "paged", "window")
PAGE_SIZE = 16


@dataclasses.dataclass(frozen=True)
class SweepRow:
    """Seconds per decode step at `filled` slots (after the step's write), for each way."""

    layers: str
    filled: int
    capacity_seconds: float
    tight_seconds: float
    whole_seconds: float
    paged_seconds: float
    window_seconds: float


def _step_loop(config: M.TransformerConfig, params, steps: int):
    """A jitted `(cache, tokens [B, 1], lengths [B]) -> (cache, tokens)` running `steps`
    greedy decode steps, each from `lengths` filled slots."""
    step = M.step_fn(config, params)

    def run(cache, tokens_B1, lengths_B):
        def body(_, carry):
            cache, tokens_B1 = carry
            logits_B1V, cache = step(tokens_B1, cache.replace(lengths=lengths_B))
            return cache, jnp.argmax(logits_B1V, axis=-1).astype(jnp.int32)

        return jax.lax.fori_loop(0, steps, body, (cache, tokens_B1))

    return jax.jit(run, donate_argnums=0)


def _scattered_pages(config: M.TransformerConfig, batch: int, capacity: int,
                     page_size: int) -> M.KVCache:
    """A paged cache of `capacity` slots per row whose pages lie in a shuffled order over a
    pool of exactly the rows' pages (as they would after requests came and went). Pages
    divide the capacity: of `page_size` slots if it does, else of the largest that does."""
    page_size = math.gcd(page_size, capacity)
    per_row = capacity // page_size
    cache = M.init_paged_cache(config, batch, batch * per_row, page_size, per_row)
    order = np.random.default_rng(0).permutation(batch * per_row).reshape(batch, per_row)
    return cache.replace(pages=jnp.asarray(order, jnp.int32))


class _Timed:
    """One program and its own donated cache, timed at one fill."""

    def __init__(self, config, params, batch: int, capacity: int, filled: int, steps: int,
                 page_size: int | None = None):
        self.run = _step_loop(config, params, steps)
        self.cache = (M.init_cache(config, batch, capacity) if page_size is None
                      else _scattered_pages(config, batch, capacity, page_size))
        self.tokens = jnp.ones((batch, 1), jnp.int32)
        self.lengths = jnp.full((batch,), filled - 1, jnp.int32)
        self.steps = steps
        self.best = float("inf")

    def time(self) -> None:
        start = time.perf_counter()
        self.cache, tokens = self.run(self.cache, self.tokens, self.lengths)
        jax.block_until_ready(tokens)
        self.best = min(self.best, (time.perf_counter() - start) / self.steps)


def check_sweep(preset: str, capacity: int, fills: Sequence[int]) -> None:
    """Raises a ValueError naming a capacity or filled length the sweep cannot time."""
    max_len = M.preset(preset).max_len
    if not 1 <= capacity <= max_len:
        raise ValueError(f"sweep capacity {capacity} must be in [1, {max_len}] (the {preset} "
                         f"max_len)")
    bad = [f for f in fills if not 1 <= f <= capacity]
    if bad or not fills:
        raise ValueError(f"filled lengths {bad or list(fills)} must be in [1, {capacity}]")


def fill_sweep(preset: str = "gpt-mini", batch: int = 32, capacity: int = 1024,
               fills: Sequence[int] = (64, 128, 256, 512, 1024), layer_modes=("scanned",
                                                                               "unrolled"),
               repeats: int = 3, steps: int = 16, page_size: int = PAGE_SIZE,
               window: int = 128, log: Callable[[str], None] = print) -> list[SweepRow]:
    """Step time at each filled length, for each layer layout (see the module docstring)."""
    check_sweep(preset, capacity, fills)
    config = M.preset(preset)
    params = M.init_params(config.replace(scan_layers=True), jax.random.key(0))
    rows = []
    for mode in layer_modes:
        scanned = mode == "scanned"
        mode_config = config.replace(scan_layers=scanned)
        mode_params = params if scanned else M.unstack_layer_params(mode_config, params)
        whole = mode_config.replace(attention_block=capacity)
        windowed = mode_config.replace(sliding_window=window)
        log(f"fill sweep, {mode} layers: compiling ...")
        timed = {(way, filled): _Timed(c, mode_params, batch, size, filled, steps, pages)
                 for filled in fills
                 for way, c, size, pages in (("capacity", mode_config, capacity, None),
                                             ("tight", mode_config, filled, None),
                                             ("whole", whole, capacity, None),
                                             ("paged", mode_config, capacity, page_size),
                                             ("window", windowed, capacity, None))}
        for contender in timed.values():
            contender.time()  # compiles
        for repeat in range(repeats):
            log(f"fill sweep, {mode} layers: repeat {repeat + 1} of {repeats} ...")
            for contender in timed.values():
                contender.time()
        rows += [SweepRow(mode, filled, *(timed[way, filled].best for way in WAYS))
                 for filled in fills]
        del timed  # frees this layout's caches before the next one's are made
    return rows


def format_sweep(rows: Sequence[SweepRow], batch: int, capacity: int, block: int,
                 page_size: int = PAGE_SIZE, window: int = 128) -> str:
    """A Markdown table of the sweep."""
    lines = [
        f"Decode step time against filled slots, batch {batch}, a cache of {capacity:,} "
        f"slots read in blocks of {block} (`capacity`), a cache of only the filled slots "
        f"(`tight`), all {capacity:,} slots read at once (`whole`), and a paged cache of "
        f"{capacity:,} slots per row in pages of {page_size} scattered over its pool (`paged`), "
        f"and the capacity's cache under a sliding window of {window:,} slots (`window`).",
        "",
        "| layers | filled | capacity ms | tight ms | capacity / tight | whole ms "
        "| whole / capacity | paged ms | paged / capacity | window ms | window / capacity |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.layers} | {r.filled:,} | {r.capacity_seconds * 1e3:.2f} | "
            f"{r.tight_seconds * 1e3:.2f} | {r.capacity_seconds / r.tight_seconds:.2f}x | "
            f"{r.whole_seconds * 1e3:.2f} | {r.whole_seconds / r.capacity_seconds:.2f}x | "
            f"{r.paged_seconds * 1e3:.2f} | {r.paged_seconds / r.capacity_seconds:.2f}x | "
            f"{r.window_seconds * 1e3:.2f} | {r.window_seconds / r.capacity_seconds:.2f}x |")
    return "\n".join(lines)


def plot_sweep(rows: Sequence[SweepRow], path: str, batch: int, capacity: int) -> None:
    """Step time against filled slots as a PNG: one colour per layout, one style per way."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"capacity": "-o", "tight": "--s", "whole": ":^", "paged": "-.d", "window": "-x"}
    for colour, mode in zip(("C0", "C1"), dict.fromkeys(r.layers for r in rows), strict=False):
        mode_rows = [r for r in rows if r.layers == mode]
        fills = [r.filled for r in mode_rows]
        for way, style in styles.items():
            ms = [getattr(r, f"{way}_seconds") * 1e3 for r in mode_rows]
            ax.plot(fills, ms, style, color=colour, label=f"{mode}, {way}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("filled slots per row")
    ax.set_ylabel("decode step (ms)")
    ax.set_title(f"Decode step against filled slots (batch {batch}, capacity {capacity:,})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
