"""What `GET /metrics` reports, in Prometheus' text format.

Each server has a registry of its own (two apps in one process do not share counters):

  kvjax_queue_length                 requests waiting for a slot
  kvjax_live_slots                   slots generating
  kvjax_generated_tokens_total       tokens made (rate() of it is the throughput)
  kvjax_prompt_tokens_total          prompt tokens of the requests staged, whether prefilled
                                     or reused from kept prefixes
  kvjax_tokens_per_second            tokens made per second over the last 10 seconds
  kvjax_requests_total{outcome}      requests answered, by how they ended
  kvjax_model_requests_total{model}  requests taken for each served name: the model's and
                                     each LoRA adapter's (`--lora-modules`)
  kvjax_time_to_first_token_seconds  from a request's arrival to its first token
  kvjax_inter_token_latency_seconds  between a sample's consecutive tokens (a chunk's tokens
                                     arrive together; each counts its share of the wait)
  kvjax_request_latency_seconds      from a request's arrival to its last sample's end
  kvjax_prefix_cache_hits_total      prompts that started with a kept prefix
  kvjax_prefix_cache_tokens_total    prompt tokens those reused instead of prefilling
"""

from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

RATE_WINDOW_SECONDS = 10.0
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0)


class ServeMetrics:
    """The engine reports to it (from its thread) and the server counts answers."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = CollectorRegistry()
        self.queue_length = Gauge("kvjax_queue_length", "Requests waiting for a slot",
                                  registry=self.registry)
        self.live_slots = Gauge("kvjax_live_slots", "Slots generating", registry=self.registry)
        self.cache_pages_used = Gauge("kvjax_cache_pages_used",
                                      "Pages of the slots' paged cache that requests hold",
                                      registry=self.registry)
        self.generated_tokens = Counter("kvjax_generated_tokens", "Tokens generated",
                                        registry=self.registry)
        self.prompt_tokens = Counter("kvjax_prompt_tokens", "Prompt tokens of staged requests",
                                     registry=self.registry)
        self.tokens_per_second = Gauge(
            "kvjax_tokens_per_second",
            f"Tokens generated per second, over the last {RATE_WINDOW_SECONDS:g} seconds",
            registry=self.registry)
        self.tokens_per_second.set_function(self._recent_rate)
        self.requests = Counter("kvjax_requests", "Requests answered, by outcome",
                                ["outcome"], registry=self.registry)
        self.model_requests = Counter("kvjax_model_requests",
                                      "Requests taken, by the served name they asked for",
                                      ["model"], registry=self.registry)
        self.time_to_first_token = Histogram(
            "kvjax_time_to_first_token_seconds", "Arrival to first token",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram(
            "kvjax_inter_token_latency_seconds", "Time between a sample's tokens",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.request_latency = Histogram(
            "kvjax_request_latency_seconds", "Arrival to the end of a request's last sample",
            buckets=LATENCY_BUCKETS + (60.0, 120.0, 300.0), registry=self.registry)
        self.prefix_cache_hits = Counter(
            "kvjax_prefix_cache_hits", "Prompts that started with a kept prefix",
            registry=self.registry)
        self.prefix_cache_tokens = Counter(
            "kvjax_prefix_cache_tokens", "Prompt tokens reused from kept prefixes",
            registry=self.registry)
        self.preemptions = Counter(
            "kvjax_preemptions", "Samples that gave their pages back, to go on later",
            registry=self.registry)
        self._lock = threading.Lock()
        self._recent: collections.deque[tuple[float, int]] = collections.deque()

    def set_load(self, queued: int, live: int, pages_used: int | None = None) -> None:
        self.queue_length.set(queued)
        self.live_slots.set(live)
        if pages_used is not None:
            self.cache_pages_used.set(pages_used)

    def observe_first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)
        self._count_tokens(1)

    def observe_tokens(self, count: int, seconds_each: float) -> None:
        for _ in range(count):
            self.inter_token_latency.observe(seconds_each)
        self._count_tokens(count)

    def count_prompt_tokens(self, count: int) -> None:
        self.prompt_tokens.inc(count)

    def observe_request(self, seconds: float) -> None:
        self.request_latency.observe(seconds)

    def count_prefix_hits(self, prompts: int, tokens: int) -> None:
        self.prefix_cache_hits.inc(prompts)
        self.prefix_cache_tokens.inc(tokens)

    def count_preemptions(self, samples: int) -> None:
        self.preemptions.inc(samples)

    def count_request(self, outcome: str) -> None:
        self.requests.labels(outcome=outcome).inc()

    def count_model_request(self, model: str) -> None:
        self.model_requests.labels(model=model).inc()

    def _count_tokens(self, count: int) -> None:
        self.generated_tokens.inc(count)
        with self._lock:
            self._recent.append((time.monotonic(), count))

    def _recent_rate(self) -> float:
        """Tokens per second over the last `RATE_WINDOW_SECONDS`, read at each scrape."""
        with self._lock:
            horizon = time.monotonic() - RATE_WINDOW_SECONDS
            while self._recent and self._recent[0][0] < horizon:
                self._recent.popleft()
            return sum(count for _, count in self._recent) / RATE_WINDOW_SECONDS

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
