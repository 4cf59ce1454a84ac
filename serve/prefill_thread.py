"""Where the engine dispatches its prefills from: beside the decode chunk on a CPU.

XLA:CPU runs the programs that one thread dispatches one after another, but programs that
two threads dispatch side by side. A decode chunk of a small model keeps about one core
busy, and a prefill needs only the params and its prompts, not the chunk's state. So on a
CPU the engine dispatches each prefill from a thread of its own, and it runs beside the
chunk in flight instead of after it; the insert that writes its result into the staged rows
is dispatched from the engine's thread, after the chunk, as before.

Everywhere else every program is dispatched from the engine's thread, in one order: an
accelerator runs a device's programs one after another anyway, and where the engine's
programs span devices or processes their collectives must not wait on each other (and every
host must dispatch them in the same order).
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable
from typing import Any

import jax

Dispatch = Callable[..., Any]  # dispatch(fn, *args) -> fn(*args)


def prefill_dispatcher(mesh) -> Dispatch:
    """How an engine on `mesh` (None: one device) calls its prefill programs: from the
    prefill thread on a CPU of one device in one process, from the caller's thread
    elsewhere. Either way the call returns once the program is dispatched, not done."""
    if mesh is not None or jax.process_count() > 1 or jax.default_backend() != "cpu":
        return _here
    return _on_prefill_thread


def _here(fn: Callable, *args) -> Any:
    return fn(*args)


def _on_prefill_thread(fn: Callable, *args) -> Any:
    return _prefill_thread().submit(fn, *args).result()  # re-raises what fn raised


@functools.cache
def _prefill_thread() -> concurrent.futures.ThreadPoolExecutor:
    """One thread for the process's engines: their prefills run in turn on it, each beside
    its own engine's chunk."""
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvjax-prefill")
