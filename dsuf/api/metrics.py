"""Prometheus metrics of the server (names follow vLLM's, under the `dsuf:` prefix)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("dsuf:num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("dsuf:num_requests_waiting", "Requests waiting to be admitted", registry=r)
        self.prompt_tokens = Counter("dsuf:prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("dsuf:generation_tokens", "Tokens generated", registry=r)
        self.cache_hit_tokens = Counter("dsuf:prompt_cache_hit_tokens", "Prompt tokens served from a conversation cache", registry=r)
        self.ttft = Histogram("dsuf:time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.steps = Counter("dsuf:steps", "Steps the worker ran", registry=r)
        self.step_model_seconds = Counter("dsuf:step_model_seconds", "Worker-side time of the steps", registry=r)
        self.step_roundtrip_seconds = Counter(
            "dsuf:step_roundtrip_seconds", "Front-end time from sending a step to handling its result", registry=r
        )
        self.kv_bytes = Gauge("dsuf:kv_cache_bytes", "Host memory held by conversation-cache snapshots", registry=r)
        self.kv_entries = Gauge("dsuf:kv_cache_entries", "Conversation-cache snapshots held", registry=r)
        self.kv_events = Gauge(
            "dsuf:kv_cache_events", "Conversation-cache lookups and transfers since start, by kind", ["kind"], registry=r
        )
        self.worker_restarts = Gauge("dsuf:worker_restarts", "Times the workers were restarted after a crash, since start", registry=r)
        self.itl = Histogram("dsuf:inter_token_latency_seconds", "Time between tokens of a stream", buckets=_LATENCY_BUCKETS, registry=r)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
