"""What a decode step cannot beat, measured on the machine at hand: the memory bandwidth, and
the step's matrix-vector products alone (`kvjax bench decode`'s floor lines), with the timing
rule every benchmark shares (`best_seconds`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import model as M


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` calls of `fn`, each waited for, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


COPY_PASSES = 8  # copies per timed call on an accelerator (see measure_bandwidth)


def measure_bandwidth(num_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes per second moved through memory: the best of a sum and a matrix-vector product
    over `num_bytes` of float32, each far larger than any CPU cache, and of copies of them
    (read and written; a GPU's reductions fall short of its bandwidth), `COPY_PASSES` in one
    call on an accelerator so that the call's launch and output are not counted as moving."""
    cols = 8192
    rows = num_bytes // 4 // cols
    # Filled with ones: a memset's time, where random numbers would take seconds.
    matrix = jnp.ones((rows, cols), jnp.float32)
    vector = jnp.ones((cols,), jnp.float32)
    total = jax.jit(jnp.sum)
    gemv = jax.jit(jnp.dot)
    passes = 1 if jax.default_backend() == "cpu" else COPY_PASSES
    copy = jax.jit(lambda m: jax.lax.fori_loop(
        0, passes, lambda _, x: jax.lax.optimization_barrier(x + 1.0), m))
    best = 0.0
    for fn, moved in ((lambda: total(matrix), 1), (lambda: gemv(matrix, vector), 1),
                      (lambda: copy(matrix), 2 * passes)):
        jax.block_until_ready(fn())
        best = max(best, moved * matrix.size * 4 / best_seconds(fn, repeats))
    return best


def step_param_bytes(config: M.TransformerConfig, params) -> int:
    """Bytes of the parameters a batch-1 decode step reads: every one, but of a mixture of
    experts only the `experts_per_token` experts the token goes through."""
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        share = 1.0
        if "experts" in [getattr(key, "key", None) for key in path]:
            share = config.experts_per_token / config.num_experts
        total += int(leaf.size * leaf.dtype.itemsize * share)
    return total


def step_matrices(config: M.TransformerConfig, params) -> list[tuple[jax.Array, bool]]:
    """Every weight matrix a decoder-only model's decode step multiplies, as `(matrix,
    on_the_left)`: each kernel as a 2-D [in, out] for `x @ W` (an output projection's
    [N, H, D] is [N·H, D]), of a mixture of experts `experts_per_token` experts' matrices
    (the first ones: a token's), and with tied embeddings the table, which the logits
    multiply as `table @ x` ([V, D]). Embedding rows that are only looked up are not
    multiplied."""
    if config.is_encoder_decoder:
        raise ValueError("step_matrices is for decoder-only models: an encoder's weights are "
                         "not read by a decode step")
    matrices = []
    per_layer = M.with_layer_layout(config, params, scan_layers=False)[1]
    for path, leaf in jax.tree_util.tree_leaves_with_path(per_layer):
        names = [getattr(key, "key", None) for key in path]
        if names[-2] == "experts":  # wi, wi_gate [D, experts, F]; wo [experts, F, D]
            axis = 0 if names[-1] == "wo" else 1
            matrices += [(jnp.take(leaf, e, axis=axis), False)
                         for e in range(config.experts_per_token)]
        elif names[-1] == "kernel":
            inputs = leaf.shape[:2] if names[-2] == "out" else leaf.shape[:1]  # [N, H, D]
            matrices.append((leaf.reshape(int(np.prod(inputs)), -1), False))
        elif names[-1] == "embedding" and config.tie_embeddings:
            matrices.append((leaf, True))
    return matrices


def time_weights_only_step(config: M.TransformerConfig, params, repeats: int,
                           steps: int = 64) -> float:
    """Seconds per batch-1 step for the step's matrix-vector products alone.

    Each product feeds the next (one running vector), so they run one after another as in
    the model, inside one compiled loop of `steps` iterations. No attention, no cache, no
    sampling, no layer stack: how fast this backend streams the weights through the kernels
    a batch-1 decode step is made of, with nothing else in the way."""
    matrices = step_matrices(config, params)
    width = max(max(w.shape) for w, _ in matrices)

    @jax.jit
    def run(weights):
        def body(_, x):
            for w, (_, on_the_left) in zip(weights, matrices, strict=True):
                y = w @ x[:w.shape[1]] if on_the_left else x[:w.shape[0]] @ w
                x = x.at[:y.shape[0]].add(1e-3 * y)
            return x
        return jax.lax.fori_loop(0, steps, body, jnp.ones((width,), weights[0].dtype))

    weights = [w for w, _ in matrices]
    jax.block_until_ready(run(weights))
    return best_seconds(lambda: run(weights), repeats) / steps
