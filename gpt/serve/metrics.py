"""The server's Prometheus series, in a registry of the app's own (so that several apps can live in one
process): queue depth, live slots, tokens and tokens/s, time to first token, inter-token latency, the
completion requests by status and the prompt positions the prefix cache saved."""

from __future__ import annotations

import collections
import threading
import time

import prometheus_client

from gpt.inference.engine import Engine

__all__ = ["Metrics"]


class Metrics:
    """The Prometheus series, in a registry of the app's own (so that several apps can live in one process)."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self.registry = registry = prometheus_client.CollectorRegistry()
        prometheus_client.Gauge("gpt_queue_depth", "Requests waiting for a slot", registry=registry
                                ).set_function(lambda: engine.queue_depth)
        prometheus_client.Gauge("gpt_live_slots", "Slots holding a running request", registry=registry
                                ).set_function(lambda: engine.live_slots)
        self.tokens = prometheus_client.Counter("gpt_generated_tokens", "Tokens generated", registry=registry)
        prometheus_client.Gauge("gpt_tokens_per_second", "Tokens generated per second over the last 10 s",
                                registry=registry).set_function(self._rate)
        self.ttft = prometheus_client.Histogram(
            "gpt_time_to_first_token_seconds", "From a request's arrival to its first token", registry=registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.itl = prometheus_client.Histogram(
            "gpt_inter_token_latency_seconds", "Between a request's consecutive tokens", registry=registry,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.requests = prometheus_client.Counter("gpt_requests", "Completion requests by HTTP status (499: the "
                                                  "client left before its reply)", ["status"], registry=registry)
        prometheus_client.Gauge("gpt_prompt_tokens_reused", "Prompt positions loaded from the prefix cache, not run",
                                registry=registry).set_function(lambda: engine.prompt_tokens_reused)
        policy = engine.draft_policy
        prometheus_client.Gauge("gpt_draft_tokens", "Drafted tokens verified (--draft)", registry=registry
                                ).set_function(lambda: policy.tokens_drafted if policy else 0)
        prometheus_client.Gauge("gpt_draft_tokens_accepted", "Drafted tokens that stood (--draft)", registry=registry
                                ).set_function(lambda: policy.drafts_accepted if policy else 0)
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()

    def status_line(self) -> str:
        """The state now, in a line: "serving: 3 running, 1 waiting; 15.2 tokens/s over the last 10 s; 480 tokens
        and 7 requests answered in all (1 refused)" (refused: a 4xx)."""
        answered = _totals(self.requests)
        requests, refused = sum(answered.values()), sum(n for labels, n in answered.items() if labels[0].startswith("4"))
        return (f"serving: {self._engine.live_slots} running, {self._engine.queue_depth} waiting; "
                f"{self._rate():,.1f} tokens/s over the last 10 s; {sum(_totals(self.tokens).values()):,.0f} tokens "
                f"and {requests:,.0f} request{'s' * (requests != 1)} answered in all ({refused:,.0f} refused)")

    def record_tokens(self, count: int) -> None:
        self.tokens.inc(count)
        with self._lock:
            self._recent.append((time.monotonic(), count))

    def _rate(self) -> float:
        with self._lock:
            now = time.monotonic()
            while self._recent and self._recent[0][0] < now - 10:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / 10.0


def _totals(counter: prometheus_client.Counter) -> dict[tuple[str, ...], float]:
    """A counter's total by its labels' values (one entry, for (), when it has no labels)."""
    return {tuple(sample.labels.values()): sample.value for metric in counter.collect() for sample in metric.samples
            if sample.name.endswith("_total")}
