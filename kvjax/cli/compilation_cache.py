"""Where the command line keeps compiled programs between runs (JAX's persistent compilation
cache), so that a second start loads them instead of compiling.

`kvjax sample` and `kvjax serve` keep them by default in the user's cache directory,
`$XDG_CACHE_HOME/kvjax/jax` (`~/.cache/kvjax/jax` when XDG_CACHE_HOME is unset); the other
commands only when asked. The first of these that applies decides:

  --no-compilation-cache           off
  --compilation-cache DIR          in DIR, for any command; an unusable DIR is an error
  KVJAX_COMPILATION_CACHE=off      off (so are 0, false, no, none)
  KVJAX_COMPILATION_CACHE=DIR      in DIR instead of the default, for sample and serve
  the default                      sample and serve: the user's cache directory (also when
                                   KVJAX_COMPILATION_CACHE is set but empty)

A directory from the environment or the default that cannot be used (not writable, a file in
the way) is a one-line warning and a run without the cache, never a failure. Importing the
library turns nothing on: `kvjax.enable_compilation_cache` is there for programs that want it.
The cache holds at most `MAX_BYTES`, least recently used programs going first; that limit
also makes JAX lock the directory around each read and write, so processes starting
together never read an entry another is still writing.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping

ENVIRONMENT_VARIABLE = "KVJAX_COMPILATION_CACHE"
OFF = ("off", "0", "false", "no", "none")
COMMANDS_WITH_CACHE = ("sample", "serve")
MAX_BYTES = 2 << 30


class CompilationCacheWarning(UserWarning):
    """The default or environment's cache directory cannot be used: the run goes on without."""


def default_directory(environ: Mapping[str, str]) -> str:
    """`$XDG_CACHE_HOME/kvjax/jax`, or `~/.cache/kvjax/jax`."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvjax", "jax")


def choose(command: str, directory: str | None, off: bool,
           environ: Mapping[str, str]) -> tuple[str | None, bool]:
    """(the cache directory or None, whether the user named it with --compilation-cache) for
    `command` run with `--compilation-cache directory` and `--no-compilation-cache` (`off`)."""
    if off:
        return None, False
    if directory:
        return directory, True
    if command not in COMMANDS_WITH_CACHE:
        return None, False
    setting = (environ.get(ENVIRONMENT_VARIABLE) or "").strip()  # empty: as if unset
    if setting.lower() in OFF:
        return None, False
    return setting or default_directory(environ), False


def use(directory: str, named: bool) -> bool:
    """Turns the cache on in `directory` once it is known to be usable; whether it is on. An
    unusable directory raises an OSError naming it if the user `named` it, else warns."""
    reason = None
    if os.path.exists(directory) and not os.path.isdir(directory):
        reason = f"{directory} is not a directory"
    else:
        try:
            os.makedirs(directory, exist_ok=True)
            probe = os.path.join(directory, f".kvjax-write-test-{os.getpid()}")
            with open(probe, "w"):
                pass
            os.remove(probe)
        except OSError as error:
            reason = f"{directory} cannot be written: {error.strerror or error}"
    if reason is not None:
        if named:
            raise OSError(f"--compilation-cache {reason}")
        warnings.warn(f"the compilation cache is off for this run: {reason} (set "
                      f"{ENVIRONMENT_VARIABLE} to another directory or to off)",
                      CompilationCacheWarning, stacklevel=2)
        return False
    import importlib.util

    import jax

    from kvjax import enable_compilation_cache

    enable_compilation_cache(directory)
    if importlib.util.find_spec("filelock") is not None:  # JAX needs it to bound the cache
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return True
