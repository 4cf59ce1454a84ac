"""`kvjax bench kernels`: the time covered by kernels equals a NumPy timeline's count, the
per-token sums are the trace's, and a real generate call's profile (and the engine's) holds
its decode step's kernels once per token."""

import jax
import numpy as np
from conftest import run_cli

from kvjax.benchmarks.kernels import busy_ns, format_profile, summarize


def test_busy_time_counts_each_covered_nanosecond_once():
    rng = np.random.default_rng(0)
    starts = rng.integers(0, 900, 40)
    spans = [(int(s), int(s + rng.integers(1, 60)), "k") for s in starts]
    timeline = np.zeros(1000, bool)
    for start, stop, _ in spans:
        timeline[start:stop] = True
    assert busy_ns(spans) == timeline.sum()


def test_rows_are_per_step_sums_longest_first():
    spans = [(0, 10, "a"), (10, 40, "b"), (40, 50, "a"), (60, 100, "b"), (100, 102, "c")]
    profile = summarize(spans, copies=4, steps=2, device="/device:GPU:0")
    assert [(r.name, r.calls_per_step, r.us_per_step) for r in profile.rows] == [
        ("b", 1.0, 0.035), ("a", 1.0, 0.01), ("c", 0.5, 0.001)]
    assert profile.busy_us == 0.092 / 2 and profile.wall_us == 0.102 / 2
    assert profile.host_copies == 2 and profile.kernels_per_step == 2.5
    table = format_profile(profile, "t", top=2)
    assert "| `b` | 0.04 | 1.00 |" in table and "| 1 others | 0.00 | 0.50 |" in table


def test_a_decode_call_runs_its_step_kernels_once_per_token(capsys):
    code, out, _ = run_cli(capsys, "bench", "kernels", "--preset", "tiny", "--new-tokens",
                           "16", "--top", "200", "--engine", "--batch", "2")
    assert code == 0, out
    generate, engine = out.split("The serving engine, 2 slots")
    rows = [line.split("|") for line in generate.splitlines() if line.startswith("| `")]
    calls = [row[3].strip() for row in rows]
    # The prefill's kernels run once in 16 tokens, the step's once per token after the first.
    assert f"{1 / 16:.2f}" in calls and f"{15 / 16:.2f}" in calls, out
    for part in (generate, engine):
        assert float(part.split(" ms per step untraced")[0].split()[-1]) > 0
        totals = part.split("Per token: ")[1]
        busy, wall = (float(totals.split(" µs")[i].split()[-1]) for i in (0, 1))
        assert 0 < busy <= wall
    copies = [float(part.split("Per token: ")[1].split(" copies")[0].split()[-1])
              for part in (generate, engine)]
    if jax.default_backend() == "gpu":
        # A GPU copies each loop iteration's predicate to the host, but for the engine's
        # chunk, whose loops stay on the device (`kvjax.device_loops`): its host turns copy.
        assert copies[0] >= 15 / 16 and copies[1] < copies[0], out
    else:  # a CPU has no host to copy to; the engine's step kernels run once per token too
        assert copies == [0, 0]
        engine_calls = [float(line.split("|")[3]) for line in engine.splitlines()
                        if line.startswith("| `")]
        assert any(0.9 <= c <= 1.1 for c in engine_calls), engine
