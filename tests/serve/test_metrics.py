"""serve/metrics.py, read back by prometheus_client's own parser of the text format: every
count, gauge and histogram holds what was reported, the rate covers the last ten seconds
only, and two servers' metrics are their own."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvjax.serve import metrics as metrics_module
from kvjax.serve.metrics import RATE_WINDOW_SECONDS, ServeMetrics


def samples(metrics: ServeMetrics) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of one scrape."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.exposition().decode())
            for s in family.samples}


def test_a_scrape_reads_back_what_was_reported(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: now[0])
    metrics, other = ServeMetrics(), ServeMetrics()
    metrics.set_load(queued=3, live=2, pages_used=5)
    metrics.observe_first_token(0.02)
    metrics.observe_tokens(3, 0.004)
    metrics.count_prefix_hits(prompts=2, tokens=40)
    metrics.count_preemptions(1)
    metrics.count_prompt_tokens(12)
    metrics.observe_request(40.0)
    for outcome in ("stop", "stop", "length"):
        metrics.count_request(outcome)
    for model in ("base", "tuned", "base"):
        metrics.count_model_request(model)
    got = samples(metrics)
    assert got[("kvjax_model_requests_total", (("model", "base"),))] == 2
    assert got[("kvjax_model_requests_total", (("model", "tuned"),))] == 1
    assert got[("kvjax_queue_length", ())] == 3 and got[("kvjax_live_slots", ())] == 2
    assert got[("kvjax_cache_pages_used", ())] == 5
    assert got[("kvjax_generated_tokens_total", ())] == 4
    assert got[("kvjax_requests_total", (("outcome", "stop"),))] == 2
    assert got[("kvjax_requests_total", (("outcome", "length"),))] == 1
    assert got[("kvjax_prefix_cache_hits_total", ())] == 2
    assert got[("kvjax_prefix_cache_tokens_total", ())] == 40
    assert got[("kvjax_preemptions_total", ())] == 1
    assert got[("kvjax_prompt_tokens_total", ())] == 12
    whole = "kvjax_request_latency_seconds"
    assert got[(f"{whole}_count", ())] == 1 and got[(f"{whole}_sum", ())] == 40.0
    assert got[(f"{whole}_bucket", (("le", "30.0"),))] == 0
    assert got[(f"{whole}_bucket", (("le", "60.0"),))] == 1
    first = "kvjax_time_to_first_token_seconds"
    assert got[(f"{first}_count", ())] == 1 and got[(f"{first}_sum", ())] == pytest.approx(0.02)
    assert got[(f"{first}_bucket", (("le", "0.01"),))] == 0
    assert got[(f"{first}_bucket", (("le", "0.025"),))] == 1
    between = "kvjax_inter_token_latency_seconds"
    assert got[(f"{between}_count", ())] == 3
    assert got[(f"{between}_sum", ())] == pytest.approx(0.012)
    assert got[(f"{between}_bucket", (("le", "0.0025"),))] == 0
    assert got[(f"{between}_bucket", (("le", "0.005"),))] == 3
    assert got[("kvjax_tokens_per_second", ())] == pytest.approx(4 / RATE_WINDOW_SECONDS)
    assert samples(other)[("kvjax_generated_tokens_total", ())] == 0  # a registry of its own
    now[0] += RATE_WINDOW_SECONDS / 2
    metrics.observe_tokens(6, 0.004)
    assert samples(metrics)[("kvjax_tokens_per_second", ())] == pytest.approx(
        10 / RATE_WINDOW_SECONDS)
    now[0] += RATE_WINDOW_SECONDS * 0.75  # the first four tokens left the window
    assert samples(metrics)[("kvjax_tokens_per_second", ())] == pytest.approx(
        6 / RATE_WINDOW_SECONDS)
    assert samples(metrics)[("kvjax_generated_tokens_total", ())] == 10
