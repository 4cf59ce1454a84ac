"""Counts the copies of whole cache buffers in a compiled decode loop, per layer layout.

    python benchmarks/decode_copies.py [--preset gpt-mini] [--batch-sizes 1 32] [--capacity 288]

A decode step should write its new slot in place and read the cache where it lies; a copy
of a whole [L_i, B, K, S, H] buffer inside the loop costs as much as reading the cache again.
This compiles (without running) a loop of decode steps and counts the `copy` instructions
whose shape is a cache buffer's, in XLA's optimised program for this backend: the loop body
is compiled once, so each of them runs at every step.
"""

import argparse
import re

import jax
import jax.numpy as jnp

from kvjax import model as M


def cache_buffer_copies(config: M.TransformerConfig, batch: int, capacity: int) -> int:
    params = M.param_shapes(config)
    cache = jax.eval_shape(lambda: M.init_cache(config, batch, capacity))

    def steps(params, cache, tokens_B1):
        step = M.step_fn(config, params)

        def body(_, carry):
            cache, tokens_B1 = carry
            logits_B1V, cache = step(tokens_B1, cache)
            return cache, jnp.argmax(logits_B1V, axis=-1).astype(jnp.int32)

        return jax.lax.fori_loop(0, 4, body, (cache, tokens_B1))

    hlo = jax.jit(steps, donate_argnums=1).lower(
        params, cache, jax.ShapeDtypeStruct((batch, 1), jnp.int32)).compile().as_text()
    shapes = {"f32[" + ",".join(map(str, b.shape)) + "]" for b in cache.k}
    return sum(1 for m in re.finditer(r"= (f32\[[\d,]+\])\{[^}]*\} copy\(", hlo)
               if m.group(1) in shapes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt-mini")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--capacity", type=int, default=288)
    args = parser.parse_args()
    for scan_layers in (True, False):
        config = M.preset(args.preset, scan_layers=scan_layers)
        for batch in args.batch_sizes:
            copies = cache_buffer_copies(config, batch, args.capacity)
            layout = "scanned" if scan_layers else "unrolled"
            print(f"{layout} layers, batch {batch}: {copies} copy instructions of a whole "
                  f"cache buffer in the compiled decode loop")


if __name__ == "__main__":
    main()
