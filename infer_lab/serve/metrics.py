"""Prometheus metrics, named after vLLM's so that the same dashboards read both servers."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                    0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    """One registry per app, so two servers in one process (the tests) do not collide."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"infer_lab:{name}", doc, labels, registry=self.registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"infer_lab:{name}", doc, labels, registry=self.registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"infer_lab:{name}", doc, labels, buckets=_LATENCY_BUCKETS,
                             registry=self.registry)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_used = gauge("kv_cache_blocks_used", "KV cache blocks in use.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.requests_ok = counter("request_success", "Requests that finished.")
        self.requests_aborted = counter("request_aborted", "Requests aborted (disconnects).")
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Gap between consecutive tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.")
        self.model = model_name
        for metric in (self.running, self.waiting, self.kv_used, self.kv_usage,
                       self.prompt_tokens, self.generation_tokens, self.requests_ok,
                       self.requests_aborted, self.ttft, self.itl, self.e2e):
            self.labels(metric)  # export every series from the start, at zero

    def labels(self, metric):  # noqa: ANN001, ANN201 - prometheus metric types
        return metric.labels(model_name=self.model)
