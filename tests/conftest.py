"""Shared fixtures: tiny configs and helpers that run a model with and without a cache.

The helpers are jitted (the config is a static, hashable argument): eager Flax calls are
many times slower to dispatch than a tiny model takes to compile.
"""

import functools
import os

# No persistent compilation cache: jax 0.10.2 sometimes crashes (a segmentation fault in
# `executable.serialize()`, inside `compilation_cache.put_executable_and_time`) while writing
# an entry, which takes a whole xdist worker down. Each process compiles what it runs: the
# command line's default cache (`kvjax sample`, `kvjax serve`) is off here and in every
# subprocess, and never fills the user's cache directory.
os.environ["KVJAX_COMPILATION_CACHE"] = "off"

# Most of the suite's time is XLA compiling hundreds of small programs, and on CPU LLVM's
# optimizations are most of that. The tests check what programs compute, not how fast, so
# they skip them (the HLO passes, which decide fusions, copies and collectives, all run).
# Inherited by every subprocess through the environment.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402  (after the environment above, which it reads when it starts)
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

from kvjax import model as M  # noqa: E402


@pytest.fixture(scope="session")
def tiny_config():
    return M.preset("tiny")


@functools.partial(jax.jit, static_argnums=0)
def run_full(config, params, tokens, lengths=None, source=None, source_lengths=None):
    """One forward over the whole sequence without a cache: logits [B, T, V]."""
    batch = {"inputs": tokens, "lengths": lengths, "source": source,
             "source_lengths": source_lengths}
    return M.teacher_forced_logits(config, params, batch)


@functools.partial(jax.jit, static_argnums=(0, 2, 3))
def start_cache(config, params, batch, capacity, source=None, source_lengths=None):
    """An empty cache; for an encoder-decoder it already holds the cross-attention K/V."""
    net = M.build_model(config)
    if not config.is_encoder_decoder:
        return M.init_cache(config, batch, capacity)
    encoded = net.apply({"params": params}, source, source_lengths, method=net.encode)
    return net.apply({"params": params}, encoded, source_lengths, capacity,
                     method=net.start_decoding)


@functools.partial(jax.jit, static_argnums=0)
def run_cached(config, params, tokens, cache, lengths=None):
    """One call with a cache: (logits [B, T, V], new cache)."""
    net = M.build_model(config)
    return net.apply({"params": params}, tokens, cache, lengths, method=net.step)


def run_cli(capsys, *argv):
    """(exit code, stdout, stderr) of `kvjax argv...` run in this process."""
    from kvjax import cli

    try:
        code = cli.main([str(arg) for arg in argv])
    except SystemExit as stop:  # argparse exits for --help and for bad options
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def random_tokens(seed, shape, vocab):
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab, dtype=jnp.int32)


# Generation tests: both variants, and a decoder-only LM, with RoPE and grouped-query attention.
VARIANTS = {"decoder_only": 0, "encoder_decoder": 2}  # name: encoder layers


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request):
    """(config, model, params) of each variant."""
    config = M.preset("tiny", num_encoder_layers=VARIANTS[request.param],
                      positional_encoding="rope", num_kv_heads=2)
    return config, M.build_model(config), M.init_params(config, jax.random.key(1))


@pytest.fixture(scope="module")
def tiny_lm():
    """(config, model, params) of a decoder-only LM."""
    config = M.preset("tiny", positional_encoding="rope", num_kv_heads=2)
    return config, M.build_model(config), M.init_params(config, jax.random.key(1))


class FakeTokenizer:
    """Enough of `TextTokenizer` for `text.LoadedModel`: printable text, no model file; its
    ids around a prompt are those of kvjax's own tokenizers."""

    vocab_size = 64
    pad_id, bos_id, eos_id = 0, 1, 2
    stop_ids = document_prefix = source_suffix = (2,)

    @staticmethod
    def encode(text):
        return [5 + ord(c) % 50 for c in text]

    @staticmethod
    def decode(ids):
        return "".join(chr(65 + i % 26) for i in ids)
