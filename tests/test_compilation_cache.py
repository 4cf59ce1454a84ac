"""The persistent compilation cache: a second process loads the programs the first compiled."""

import subprocess
import sys

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
