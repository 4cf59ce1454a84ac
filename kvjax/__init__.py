"""kvjax: a small, fast, readable Transformer library in JAX/Flax with an explicit KV cache.

One import package with three subpackages: `kvjax.model` (the modules, the config and the
KV cache), `kvjax.decode` (generation) and `kvjax.train` (data and the training loop).
Beside them: what inference and training share (`kvjax.tokenizer`, `kvjax.checkpoint`),
text-in/text-out sampling (`kvjax.text`), the command line (`kvjax.cli`), the demo and the
benchmark. Importing `kvjax` itself loads none of them.
"""

from __future__ import annotations

import os

__version__ = "0.1.0"


def enable_compilation_cache(directory: str | os.PathLike) -> None:
    """Keeps compiled XLA programs in `directory`, so a second process skips compilation.

    Within one process `jax.jit` already reuses a program for the same shapes and static
    arguments; this persists those programs on disk, keyed by the program and the jax/XLA
    versions, so `kvjax sample` started again loads them instead of compiling. Every program
    is cached, however quickly it compiled.
    """
    import jax  # here, so that `kvjax --help` does not wait for jax to load

    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
