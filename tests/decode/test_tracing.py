"""decode/tracing.py: a program's count goes up once per trace, not per call, so the tests
that count traces see every compilation and nothing else."""

import jax
import jax.numpy as jnp

from kvjax.decode.tracing import count_trace, trace_count


def test_a_program_is_counted_once_per_trace_not_per_call():
    name = "test_tracing_program"

    @jax.jit
    def program(x):
        count_trace(name)
        return x + 1

    assert trace_count(name) == 0 and trace_count("never_traced") == 0
    program(jnp.zeros(3))
    program(jnp.ones(3))  # the same shapes: the compiled program again
    assert trace_count(name) == 1
    program(jnp.zeros(4))  # another shape: another trace
    assert trace_count(name) == 2
