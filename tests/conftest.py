"""Shared fixtures: tiny configs and helpers that run a model with and without a cache.

The helpers are jitted (the config is a static, hashable argument): eager Flax calls are
many times slower to dispatch than a tiny model takes to compile.
"""

import atexit
import collections
import dataclasses
import functools
import gc
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# The command line's default cache (`kvjax sample`, `kvjax serve`) is off here and in every
# subprocess, and never fills the user's cache directory. The suite's processes (the workers,
# the notebooks' kernels, the command lines and jobs the tests start) share one JAX
# compilation cache of their own instead, in a temporary directory that lives as long as the
# run: a program that takes long to compile, compiled by one process (or by a worker before
# it dropped its programs, below), is loaded by the next that needs it. Programs that compile
# quickly are not written: writing costs more than compiling them again.
os.environ["KVJAX_COMPILATION_CACHE"] = "off"
SHARED_CACHE_MIN_COMPILE_SECONDS = 0.5

# Most of the suite's time is XLA compiling hundreds of small programs. The tests check what
# programs compute, not how fast, so they skip LLVM's optimizations, and on a jaxlib that still
# has it, emit CPU fusions with XLA's older elemental emitter (about half the compile time of
# the MLIR fusion emitters). Inherited by every subprocess through the environment. An XLA that
# does not know a flag in XLA_FLAGS aborts the process, so each flag is tried in a throwaway
# process first, once per session (the workers inherit the result).
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def _xla_accepts(flag: str) -> bool:
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    probe = "import jax, jax.numpy as jnp; jax.jit(jnp.sin)(jnp.ones(2)).block_until_ready()"
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          timeout=120).returncode == 0


def _share_one_compilation_cache() -> None:
    """Sets the environment every process of the run reads when JAX starts (the workers and
    every child process inherit it); the directory goes when this process ends."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:  # the caller's own: left as it is
        return
    directory = tempfile.mkdtemp(prefix="kvjax-tests-xla-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = directory
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = str(
        SHARED_CACHE_MIN_COMPILE_SECONDS)
    # A bound makes JAX lock the directory around each read and write: processes that
    # compile the same program together never read an entry another is still writing.
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(4 << 30)


if "KVJAX_TEST_FLAGS_CHECKED" not in os.environ:
    os.environ["KVJAX_TEST_FLAGS_CHECKED"] = "1"
    for flag in FAST_COMPILE_FLAGS:
        if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", "") and _xla_accepts(flag):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    _share_one_compilation_cache()

import jax  # noqa: E402  (after the environment above, which it reads when it starts)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from kvjax import model as M  # noqa: E402

# The files that take longest go to the workers first, so that no worker is left running a
# long file while the other has nothing to do (longest first); the rest follow by their
# number of tests, as xdist orders them (`--no-loadscope-reorder` keeps this order).
SLOW_FILES_FIRST = ("test_multi_device_generate.py", "test_multi_device.py",
                    "test_multi_process.py", "test_notebooks.py", "test_demo.py",
                    "test_transformer.py", "test_trainer.py",
                    "test_attention_blocks.py", "test_prompt_state.py", "test_generate.py",
                    "test_speculative.py",
                    "test_hf_models.py", "test_generate_options.py", "test_finetune.py")


def pytest_collection_modifyitems(config, items):
    counts = collections.Counter(item.path.name for item in items)

    def rank(item):
        name = item.path.name
        if name in SLOW_FILES_FIRST:
            return SLOW_FILES_FIRST.index(name), 0
        return len(SLOW_FILES_FIRST), -counts[name]

    items.sort(key=rank)  # stable: each file's tests keep their order


# Tests that go to the workers one by one rather than with their file (`--dist loadfile`,
# pyproject's addopts): each runs a notebook in a kernel of its own and shares nothing with
# the others, and together they are the longest file by far on a GPU, where each kernel
# compiles its programs for the GPU.
ONE_BY_ONE = ("tests/e2e/test_notebooks.py::test_notebook_runs[",)


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None  # xdist's own scheduler for the mode asked for
    from xdist.scheduler import LoadFileScheduling

    class FilesAndSomeTestsAlone(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(ONE_BY_ONE):
                return nodeid
            return super()._split_scope(nodeid)

    return FilesAndSomeTestsAlone(config, log)


# A process keeps every program it compiled, and XLA:CPU maps each program's kernels into
# memory separately: a worker gains hundreds of memory maps per program (about 240 for each
# program of a tiny model's `generate`). At Linux's limit on a process's maps
# (vm.max_map_count, 65,530 by default) the next compile cannot map its code and the worker
# dies with a segmentation fault inside `backend_compile_and_load`, while
# compiling a program that compiles fine on its own. So before a test file starts, a worker
# past half the limit drops every compiled program (`jax.clear_caches`); later files
# compile what they need again.
MAP_SHARE = 0.5


def _map_limit() -> int | None:
    try:
        with open("/proc/sys/vm/max_map_count") as limit:
            return int(limit.read())
    except (OSError, ValueError):
        return None  # not Linux: no such limit to watch


def _map_count() -> int:
    with open("/proc/self/maps", "rb") as maps:
        return sum(1 for _ in maps)


_MAP_LIMIT = _map_limit()
_LAST_FILE: list = [None]


def pytest_runtest_setup(item):
    if _MAP_LIMIT is None or item.path == _LAST_FILE[0]:
        return
    _LAST_FILE[0] = item.path
    if _map_count() > MAP_SHARE * _MAP_LIMIT:
        jax.clear_caches()
        _COMPILED_BY_PROGRAM.clear()
        gc.collect()


# Tests often compile a program a worker already holds under another jit cache key: the same
# model built from an equal config in another file, a helper traced anew. Within a worker,
# XLA's executable is reused when the program's text (without source locations), compile
# options and devices are the same. Programs with host callbacks are always compiled, since
# their callbacks are not part of the text. The wrapped jax function is internal, so where a
# jax lacks it every program is compiled, as without this.
_COMPILED_BY_PROGRAM: dict = {}


def _reuse_compiled_programs() -> None:
    import hashlib

    from jax._src import compiler

    compile_and_load = getattr(compiler, "backend_compile_and_load", None)
    if compile_and_load is None or getattr(compile_and_load, "reuses_programs", False):
        return

    def reusing(backend, module, executable_devices, options, host_callbacks, *args, **kwargs):
        if host_callbacks or args or kwargs:
            return compile_and_load(backend, module, executable_devices, options,
                                    host_callbacks, *args, **kwargs)
        text = module.operation.get_asm(enable_debug_info=False)
        key = (backend.platform, hashlib.sha256(text.encode()).hexdigest(),
               options.SerializeAsString(), tuple(d.id for d in executable_devices))
        if key not in _COMPILED_BY_PROGRAM:
            _COMPILED_BY_PROGRAM[key] = compile_and_load(backend, module, executable_devices,
                                                         options, host_callbacks)
        return _COMPILED_BY_PROGRAM[key]

    reusing.reuses_programs = True
    compiler.backend_compile_and_load = reusing


_reuse_compiled_programs()


@pytest.fixture(scope="session", autouse=True)
def full_float32_matmuls():
    """The tests hold code paths to each other and to NumPy at float32 tolerances. On GPUs
    jax's default matmul precision rounds float32 inputs to TF32 (about 1e-3 relative), a
    speed setting of the backend that kvjax leaves to its users; the tests ask for full
    float32. (A fixture, so that the backend starts after every conftest has set it up.)
    Processes the tests start read it from the environment: a run checked against one in a
    child process must multiply as it does."""
    if jax.default_backend() != "cpu":
        jax.config.update("jax_default_matmul_precision", "highest")
        os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"


@pytest.fixture
def layers_read_by_blocks(monkeypatch):
    """Caches read by blocks on every backend, as a CPU reads all but a small model's layers:
    by default the tests' small layers are read in one pass. Tests of the one pass ask for
    it with `one_read_bytes`."""
    from kvjax.model import attention

    monkeypatch.setattr(attention, "one_read_max_bytes", lambda: 0)


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


def steps_traced_anew(config, params, tokens, capacity, source=None, source_lengths=None):
    """Float32 logits [5, B, 1, V] of 5 decode steps after a prefill of the first 4 and 2
    tokens of rows 0 and 1 of `tokens` [2, >= 9] (row 0 then feeds tokens 4.., row 1 tokens
    4.. too, from position 2), in programs traced anew: what a test that changes how a
    program is traced (a patched policy, a mode) compares. jax would reuse a program traced
    earlier from the same function."""
    cached = jax.jit(lambda *args: run_cached.__wrapped__(*args), static_argnums=0)
    cache = start_cache(config, params, 2, capacity, source, source_lengths)
    _, cache = cached(config, params, tokens[:, :4], cache, jnp.array([4, 2]))
    steps = []
    for t in range(5):
        logits, cache = cached(config, params, tokens[:, 4 + t:5 + t], cache)
        steps.append(np.asarray(logits, np.float32))
    return np.stack(steps)


def run_cli(capsys, *argv):
    """(exit code, stdout, stderr) of `kvjax argv...` run in this process."""
    from kvjax import cli

    try:
        code = cli.main([str(arg) for arg in argv])
    except SystemExit as stop:  # argparse exits for --help and for bad options
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def with_sampling(**kwargs):
    """`kwargs` with `decode.Sampling`'s fields among them gathered into one
    `sampling=decode.Sampling(...)`: how the refusal tables write a bad setting beside a
    call's other arguments. Called inside `pytest.raises`, as `Sampling` checks its values."""
    from kvjax import decode

    names = {field.name for field in dataclasses.fields(decode.Sampling)}
    settings = {name: kwargs.pop(name) for name in list(kwargs) if name in names}
    return {**kwargs, "sampling": decode.Sampling(**settings)} if settings else kwargs


def random_tokens(seed, shape, vocab):
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab, dtype=jnp.int32)


def source_for(config, batch, length=7, seed=5):
    """(source tokens [batch, length], their lengths) for an encoder-decoder config, the
    second row shorter; (None, None) for a decoder-only one."""
    if not config.is_encoder_decoder:
        return None, None
    lengths = jnp.array([length, length - 3][:batch] + [length] * max(0, batch - 2), jnp.int32)
    return random_tokens(seed, (batch, length), config.vocab_size), lengths


def drain(generator):
    """(everything `generator` yields, as a list; what it returns): `decode.stream`'s chunks
    and its `GenerateOutput`."""
    items = []
    while True:
        try:
            items.append(next(generator))
        except StopIteration as stop:
            return items, stop.value


# Generation tests: both variants, and a decoder-only LM, with RoPE and grouped-query attention.
VARIANTS = {"decoder_only": 0, "encoder_decoder": 2}  # name: encoder layers


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request):
    """(config, model, params) of each variant, its layers scanned: a scanned stack compiles
    one layer, not each of them. The decoders and the engine reach the layers only through
    the model's prefill and step and the cache's row operations, which tests/model holds
    equal in both layouts (test_layers.py, test_cache.py); the imported models' tests
    (tests/hf) decode in the default, unrolled layout."""
    config = M.preset("tiny", num_encoder_layers=VARIANTS[request.param],
                      positional_encoding="rope", num_kv_heads=2,
                      scan_layers=True)
    return config, M.build_model(config), M.init_params(config, jax.random.key(1))


@pytest.fixture(scope="module")
def tiny_lm():
    """(config, model, params) of a decoder-only LM, its layers scanned (as `tiny`'s)."""
    config = M.preset("tiny", positional_encoding="rope", num_kv_heads=2, scan_layers=True)
    return config, M.build_model(config), M.init_params(config, jax.random.key(1))


class FakeTokenizer:
    """Enough of `TextTokenizer` for `text.LoadedModel`: printable text, no model file; its
    ids around a prompt are those of kvjax's own tokenizers."""

    vocab_size = 64
    pad_id, bos_id, eos_id = 0, 1, 2
    stop_ids = document_prefix = source_suffix = (2,)
    source_prefix = target_prefix = ()
    forced_end = None
    banned_ids = bad_words = ()
    sampling_defaults: dict = {}

    @staticmethod
    def encode(text):
        return [5 + ord(c) % 50 for c in text]

    @staticmethod
    def decode(ids, skip_special_tokens=True):
        return "".join(chr(65 + i % 26) for i in ids)

    @staticmethod
    def pieces(ids):
        return [f"<{i}>" for i in ids]


def openai_client(url: str, timeout: float = 30.0):
    """The official `openai` client of the server at `url`, retrying nothing."""
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=timeout,
                         max_retries=0)


def serve_app(app, timeout: float = 30.0, **options):
    """(base URL, stop) of `app` served by uvicorn in a thread of this process, on 127.0.0.1
    at an ephemeral port; `options` go to `uvicorn.Config` (e.g. `http=` a protocol)."""
    import threading
    import time

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]

    def stop():
        server.should_exit = True
        thread.join(timeout)

    return f"http://127.0.0.1:{port}", stop


SERVED_MODEL = "tiny-lm"  # the name the tiny LM is served under in the server tests
SHIPPED_LM = Path(__file__).resolve().parent.parent / "checkpoints" / "python-docs-lm"


@pytest.fixture(scope="module")
def docs_tokenizer():
    """The shipped python-docs-lm's tokenizer: a real SentencePiece vocabulary."""
    from kvjax import text

    return text.load(SHIPPED_LM).tokenizer


def end_only_automaton(vocab_size: int, end_id: int):
    """A one-state `TokenAutomaton` over `vocab_size` ids that allows only `end_id`."""
    from kvjax.decode import Choice, TokenAutomaton

    one = np.ones(1, np.int32)
    return TokenAutomaton(constraint=Choice(["x"]), end_id=end_id, vocab_size=vocab_size,
                          initial=0, starts=one * 0, counts=one, tokens=one * end_id,
                          next_states=one * 0)


@pytest.fixture(scope="module")
def tiny_loaded(tiny_lm):
    """The tiny LM as the server holds a checkpoint: a `LoadedModel` with `FakeTokenizer`."""
    from kvjax.text import LoadedModel

    config, _, params = tiny_lm
    return LoadedModel(config, FakeTokenizer(), params, f"/checkpoints/{SERVED_MODEL}")


def greedy_text(loaded, prompt, max_tokens):
    """What greedy `decode.generate` makes from the text `prompt` alone, as text."""
    from kvjax import decode
    from kvjax.text import prompt_tokens

    tokens = decode.generate(loaded.net, loaded.params, [prompt_tokens(loaded, prompt)],
                             max_new_tokens=max_tokens,
                             eos_ids=loaded.tokenizer.stop_ids).token_lists()[0]
    return FakeTokenizer.decode([t for t in tokens if t not in loaded.tokenizer.stop_ids])


def trained_adapters(config, params, lora, seed):
    """LoRA adapters for `params` as training leaves them: B no longer zero."""
    from kvjax.model import lora as L

    fresh = L.init_adapters(config, params, lora, jax.random.key(seed))
    leaves, tree = jax.tree.flatten(fresh)
    keys = jax.random.split(jax.random.key(seed + 10), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape)
                                     for x, k in zip(leaves, keys, strict=True)])
