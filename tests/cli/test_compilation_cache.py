"""The persistent compilation cache: a second process loads the programs the first compiled."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from kvjax.cli import compilation_cache

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
import jax
import jax.monitoring

events = {"hits": 0, "misses": 0}

def count(name, **_):
    if name == "/jax/compilation_cache/cache_hits":
        events["hits"] += 1
    elif name == "/jax/compilation_cache/cache_misses":
        events["misses"] += 1

jax.monitoring.register_event_listener(count)
from kvjax import enable_compilation_cache
enable_compilation_cache(sys.argv[1])
from kvjax import decode
from kvjax import model as M
config = M.preset("tiny")
decode.generate(M.build_model(config), M.init_params(config, jax.random.key(0)), [[1, 2, 3]],
                max_new_tokens=4)
print(events["hits"], events["misses"])
"""


def run(directory):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(directory)], capture_output=True,
                          text=True, timeout=300, check=True)
    hits, misses = map(int, done.stdout.split()[-2:])
    return hits, misses


def test_second_process_compiles_nothing(tmp_path):
    first_hits, first_misses = run(tmp_path / "xla")
    assert first_hits == 0 and first_misses >= 3  # init, prefill, decode loop at least
    assert any((tmp_path / "xla").iterdir())
    second_hits, second_misses = run(tmp_path / "xla")
    assert second_misses == 0 and second_hits == first_misses


# The command line's default: on for sample and serve, off by flag or environment.

DEFAULT_SCRIPT = """
import os, sys
import jax
from kvjax.cli import compilation_cache
directory, named = compilation_cache.choose("sample", None, False, os.environ)
print(directory, compilation_cache.use(directory, named))
jax.jit(lambda x: x * 2)(1.0)
"""


def test_sample_and_serve_keep_programs_in_the_users_cache_by_default(tmp_path):
    """Run as `kvjax sample` sets it up, in a process of its own (this one never turns the
    cache on): with KVJAX_COMPILATION_CACHE unset, programs land under $XDG_CACHE_HOME."""
    env = {k: v for k, v in os.environ.items() if k != compilation_cache.ENVIRONMENT_VARIABLE}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", DEFAULT_SCRIPT], capture_output=True,
                          text=True, timeout=300, check=True, env=env)
    directory = tmp_path / "kvjax" / "jax"
    assert done.stdout.split() == [str(directory), "True"]
    assert [p for p in directory.iterdir() if p.name.endswith("-cache")]


@pytest.mark.parametrize(("command", "flag", "off", "environ", "expected"), [
    ("sample", None, False, {"XDG_CACHE_HOME": "/x"}, ("/x/kvjax/jax", False)),
    ("serve", None, False, {"HOME": "/home/u"}, ("/home/u/.cache/kvjax/jax", False)),
    ("serve", None, False, {"KVJAX_COMPILATION_CACHE": "/c", "XDG_CACHE_HOME": "/x"},
     ("/c", False)),
    ("sample", None, False, {"KVJAX_COMPILATION_CACHE": "Off"}, (None, False)),
    ("sample", None, False, {"KVJAX_COMPILATION_CACHE": "0"}, (None, False)),
    ("sample", None, False, {"KVJAX_COMPILATION_CACHE": "", "XDG_CACHE_HOME": "/x"},
     ("/x/kvjax/jax", False)),
    ("sample", "/d", False, {"KVJAX_COMPILATION_CACHE": "off"}, ("/d", True)),
    ("sample", None, True, {"XDG_CACHE_HOME": "/x"}, (None, False)),
    ("train", None, False, {"XDG_CACHE_HOME": "/x", "KVJAX_COMPILATION_CACHE": "/c"},
     (None, False)),
    ("train", "/d", False, {}, ("/d", True)),
])
def test_flags_then_environment_then_default_decide(monkeypatch, command, flag, off, environ,
                                                     expected):
    monkeypatch.setenv("HOME", environ.get("HOME", "/home/u"))
    assert compilation_cache.choose(command, flag, off, environ) == expected


def test_the_suite_never_uses_the_users_cache():
    """The command line's cache is off; the suite's processes share a temporary one of their
    own (tests/conftest.py), never the user's directory."""
    assert os.environ[compilation_cache.ENVIRONMENT_VARIABLE] == "off"
    assert compilation_cache.choose("sample", None, False, os.environ) == (None, False)
    suites = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    assert jax.config.jax_compilation_cache_dir == suites
    users = compilation_cache.default_directory(os.environ)
    assert suites is None or os.path.commonpath(
        [os.path.abspath(suites), os.path.abspath(users)]) != os.path.abspath(users)


def test_an_unusable_default_warns_and_runs_without_while_a_named_one_fails(capsys):
    from kvjax import cli

    blocked = str(ROOT / "pyproject.toml" / "below")  # a file is in the way
    before = jax.config.jax_compilation_cache_dir
    with pytest.warns(compilation_cache.CompilationCacheWarning,
                      match="compilation cache is off for this run: .*below cannot be "
                            "written: Not a directory"):
        assert not compilation_cache.use(blocked, named=False)
    assert jax.config.jax_compilation_cache_dir == before
    with pytest.raises(OSError, match="--compilation-cache .*pyproject.toml is not a "
                                      "directory"):
        compilation_cache.use(str(ROOT / "pyproject.toml"), named=True)
    with pytest.raises(SystemExit) as stop:
        cli.main(["--compilation-cache", "/tmp", "--no-compilation-cache", "cache-size"])
    assert stop.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
