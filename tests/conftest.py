"""Shared fixtures: tiny configs and helpers that run a model with and without a cache.

The helpers are jitted (the config is a static, hashable argument): eager Flax calls are
many times slower to dispatch than a tiny model takes to compile.
"""

import functools
import importlib.metadata
import os
import tomllib
from pathlib import Path

# No persistent compilation cache: jax 0.10.2 sometimes crashes (a segmentation fault in
# `executable.serialize()`, inside `compilation_cache.put_executable_and_time`) while writing
# an entry, which takes a whole xdist worker down. Each process compiles what it runs: the
# command line's default cache (`kvjax sample`, `kvjax serve`) is off here and in every
# subprocess, and never fills the user's cache directory.
os.environ["KVJAX_COMPILATION_CACHE"] = "off"

# Most of the suite's time is XLA compiling hundreds of small programs. The tests check what
# programs compute, not how fast, so on CPU they skip LLVM's optimizations and emit fusions
# with XLA's older elemental emitter, which compiles in about half the time of the MLIR
# fusion emitters (the HLO passes, which decide fusions, copies and collectives, all run).
# Inherited by every subprocess through the environment. Only with the pinned jaxlib these
# were measured on: an XLA that does not know a flag in XLA_FLAGS aborts the process (jax
# 0.11.2's CUDA build takes every worker down before a test runs).
def _pinned_jaxlib() -> str:
    project = Path(__file__).resolve().parents[1] / "pyproject.toml"
    pins = tomllib.loads(project.read_text())["project"]["dependencies"]
    return next(pin.split("==")[1] for pin in pins if pin.startswith("jaxlib=="))


if importlib.metadata.version("jaxlib") == _pinned_jaxlib():
    for flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"):
        if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()

import jax  # noqa: E402  (after the environment above, which it reads when it starts)
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

from kvjax import model as M  # noqa: E402

# XLA:CPU in jax 0.10.2 now and then crashes (a segmentation fault inside
# `backend_compile_and_load`) while compiling a program that compiles fine on its own, and
# the crash takes an xdist worker down. xdist puts what that worker had left of its file
# back in the queue for a fresh worker; the test that was running is reported as a rerun
# instead of a failure, and runs again there. A second crash of the same test fails it, and
# so does a crashed test that never ran again. Only crashes are retried, never failures.
_CRASHED: dict[str, bool] = {}  # crashed test id: whether it has run again since


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    if crashitem not in _CRASHED:
        _CRASHED[crashitem] = False
        report.outcome = "rerun"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class RequeueUnfinishedFiles(LoadFileScheduling):
        """xdist (3.8) puts every file a crashed worker held back in the queue, finished
        ones too; a fresh worker handed a finished file runs nothing, is never given more,
        and the session waits forever. Only files with tests left go back."""

        def remove_node(self, node):
            workload = self.assigned_work.get(node, {})
            for scope in [scope for scope, unit in workload.items() if all(unit.values())]:
                del workload[scope]
            return super().remove_node(node)

    return RequeueUnfinishedFiles(config, log)


def pytest_runtest_logreport(report):
    if report.nodeid in _CRASHED and report.outcome != "rerun" and report.when == "teardown":
        _CRASHED[report.nodeid] = True


def pytest_report_teststatus(report):
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})
    return None


def pytest_terminal_summary(terminalreporter):
    for nodeid, ran_again in _CRASHED.items():
        terminalreporter.write_line(
            f"{nodeid}: its worker crashed; " + ("it ran again in a fresh worker" if ran_again
                                                 else "it did not run again: failed"),
            yellow=ran_again, red=not ran_again)


def pytest_sessionfinish(session):
    if not all(_CRASHED.values()):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session", autouse=True)
def full_float32_matmuls():
    """The tests hold code paths to each other and to NumPy at float32 tolerances. On GPUs
    jax's default matmul precision rounds float32 inputs to TF32 (about 1e-3 relative), a
    speed setting of the backend that kvjax leaves to its users; the tests ask for full
    float32. (A fixture, so that the backend starts after every conftest has set it up.)"""
    if jax.default_backend() != "cpu":
        jax.config.update("jax_default_matmul_precision", "highest")


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
