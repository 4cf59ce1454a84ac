"""Counts how often each compiled generation program is traced.

Every trace is a compilation, so tests use `trace_count` to check that calls which differ
only in traced settings reuse one program."""

_TRACE_COUNTS: dict[str, int] = {}


def trace_count(name: str) -> int:
    """How many times the compiled program `name` was traced: 'start' and
    'continue' (`generate`), 'beam' and 'beam_advance' (`beam_search`)."""
    return _TRACE_COUNTS.get(name, 0)


def count_trace(name: str) -> None:
    """Called from inside a jitted function's body, so it runs once per trace."""
    _TRACE_COUNTS[name] = _TRACE_COUNTS.get(name, 0) + 1
