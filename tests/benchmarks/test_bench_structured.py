"""`kvjax bench structured`: its rows time free, constrained and host-held steps (the
benchmark checks that the host-held loop chooses the compiled loop's tokens), every
constrained row that ends parses as JSON, and every schema's automaton is counted."""

from kvjax.benchmarks.structured import SCHEMAS, format_tables, structured_benchmark


def test_rows_time_both_loops_and_constrained_rows_parse():
    steps, builds = structured_benchmark(batch_sizes=(2,), prompt_len=8, new_tokens=24,
                                         repeats=1, schema="any object")
    assert [r.batch for r in steps] == [2]
    assert all(r.free_step_ms > 0 and r.constrained_step_ms > 0 and r.host_held_step_ms > 0
               and r.parsed == r.ended for r in steps)
    assert [b.schema for b in builds] == list(SCHEMAS)
    assert all(b.seconds > 0 and b.states > 1 and b.transitions >= b.states for b in builds)
    table = format_tables(steps, builds, "any object")
    assert "| 2 |" in table and "'any object'" in table
