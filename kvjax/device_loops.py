"""Compiler options that keep a program's loops on an NVIDIA GPU, with no host in between.

XLA:GPU runs a `while_loop` whose trip count it cannot know, and every `lax.cond`, from the
host: it copies the predicate to the host, waits for it, and launches the next iteration's
kernels (or their command buffer, a CUDA graph of the body) from there. A program whose
steps take the GPU less time than the host needs to launch them is then bound by the host;
a serving engine's chunk of decode steps over a small model is one. XLA can record the
loops and conditionals themselves into the command buffer (CUDA graphs' conditional nodes),
so that the whole loop is launched once and decides on the device. Its defaults leave them
out; `device_loop_options` gives the options that put them in, for the programs that ask
(`jax.jit(..., compiler_options=...)`, or `jit` below): every other program, and what a
user set through `XLA_FLAGS`, stays as it is. (`generate`'s decode loop is not one of them:
XLA does not make it one graph, and with these options it runs slower.)
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import jax
import numpy as np

COMMAND_BUFFER = "xla_gpu_enable_command_buffer"
# XLA's default kinds of command, then the loops and conditionals.
DEVICE_LOOP_COMMANDS = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN",
                        "DYNAMIC_SLICE_FUSION", "WHILE", "CONDITIONAL")


@functools.cache
def device_loop_options(backend: str) -> dict[str, str] | None:
    """The compiler options of a program whose loops should stay on the device of
    `backend`: on a GPU, the command buffer kinds this XLA knows of `DEVICE_LOOP_COMMANDS`;
    None elsewhere, where `XLA_FLAGS` already says which kinds to record, or where this XLA
    cannot record a loop."""
    if backend != "gpu" or COMMAND_BUFFER in os.environ.get("XLA_FLAGS", ""):
        return None
    everything = {COMMAND_BUFFER: ",".join(DEVICE_LOOP_COMMANDS)}
    if _accepted(everything):
        return everything
    # An XLA older or newer than these names: keep the kinds it knows.
    known = [kind for kind in DEVICE_LOOP_COMMANDS if _accepted({COMMAND_BUFFER: kind})]
    if not {"WHILE", "CONDITIONAL"} <= set(known):
        return None
    return {COMMAND_BUFFER: ",".join(known)}


def _accepted(options: dict[str, str]) -> bool:
    """Whether XLA compiles a program with these options (it refuses a kind it does not
    know by name)."""
    try:
        jax.jit(lambda x: x + 1, compiler_options=options).lower(np.int32(0)).compile()
    except jax.errors.JaxRuntimeError:
        return False
    return True


def jit(fun: Callable, **jit_kwargs) -> Callable:
    """`jax.jit(fun, **jit_kwargs)`, compiled with the `device_loop_options` of the backend
    it runs on. The backend is asked at each call, not at import (asking it starts it);
    `.for_backend(name)` is the jitted function of that backend's options."""

    @functools.cache
    def for_backend(backend: str):
        return jax.jit(fun, compiler_options=device_loop_options(backend), **jit_kwargs)

    @functools.wraps(fun)
    def call(*args, **kwargs):
        return for_backend(jax.default_backend())(*args, **kwargs)

    call.for_backend = for_backend
    return call
