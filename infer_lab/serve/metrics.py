"""Prometheus metrics, named after vLLM's so that the same dashboards read both servers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from infer_lab.engine.engine import EngineStats
    from infer_lab.engine.structured import StructuredStats

# Why a request was refused (``infer_lab:request_refused_total{reason=...}``): every bound of
# ServerLimits and of admission, plus the protocol-level refusals. Exported from the start at 0.
REFUSAL_REASONS = (
    "waiting_requests", "waiting_tokens", "inflight_tokens", "n", "logprobs", "compile_busy",
    "grammar_size", "schema_depth", "enum_values", "grammar_slow", "grammar_invalid",
    "template_output", "template_timeout", "unsupported_field", "send_timeout", "smuggling",
)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                    0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    """One registry per app, so two servers in one process (the tests) do not collide.

    With ``vllm_names`` the three gauges a router reads (waiting, running, KV usage) are also
    exported under vLLM's own names, so a router written for vLLM can balance over this server.
    """

    def __init__(self, model_name: str, vllm_names: bool = False) -> None:
        self.registry = CollectorRegistry()
        self.model = model_name
        labels = ["model_name"]

        def gauge(name: str, doc: str, prefix: str = "infer_lab") -> Gauge:
            return Gauge(f"{prefix}:{name}", doc, labels, registry=self.registry)

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
        self.requests_failed = counter("request_failed", "Requests the engine failed.")
        self.preemptions = counter("num_preemptions", "Sequences preempted for KV space.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found cached.")
        self.spec_drafts = counter("spec_decode_num_drafts", "Verifications carrying proposals.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Tokens proposed.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens",
                                     "Proposed tokens the model accepted.")
        self.refused = Counter("infer_lab:request_refused", "Requests refused, by reason.",
                               ["model_name", "reason"], registry=self.registry)
        for reason in REFUSAL_REASONS:
            self.refused.labels(model_name=model_name, reason=reason)
        self.grammar_cache_bytes = gauge("grammar_cache_bytes",
                                         "Bytes of compiled grammars kept for reuse.")
        self.structured = (
            counter("structured_requests", "Requests with an output constraint."),
            counter("structured_compile_seconds", "Time compiling grammars (cache misses)."),
            counter("structured_mask_seconds", "Time filling and applying token masks."),
            counter("structured_mask_rows", "Token masks applied (one per constrained row)."))
        self._structured_seen = (0, 0.0, 0.0, 0)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Gap between consecutive tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.")
        self.vllm: tuple[Gauge, Gauge, Gauge] | None = None
        if vllm_names:
            self.vllm = (gauge("num_requests_waiting", "Requests waiting.", "vllm"),
                         gauge("num_requests_running", "Requests running.", "vllm"),
                         gauge("kv_cache_usage_perc", "KV cache usage (0-1).", "vllm"))
        for metric in (self.running, self.waiting, self.kv_used, self.kv_usage,
                       self.prompt_tokens, self.generation_tokens, self.requests_ok,
                       self.requests_aborted, self.requests_failed, self.preemptions,
                       self.prefix_queries, self.prefix_hits, self.spec_drafts,
                       self.spec_draft_tokens, self.spec_accepted, self.ttft, self.itl, self.e2e,
                       self.grammar_cache_bytes,
                       *self.structured, *(self.vllm or ())):
            self.labels(metric)  # export every series from the start, at zero

    def labels(self, metric):  # noqa: ANN001, ANN201 - prometheus metric types
        return metric.labels(model_name=self.model)

    def refuse(self, reason: str) -> None:
        """Count one refused request under ``reason`` (one of ``REFUSAL_REASONS``)."""
        self.refused.labels(model_name=self.model, reason=reason).inc()

    def update(self, stats: EngineStats, seen: tuple[int, ...]) -> tuple[int, ...]:
        """Set the gauges from ``stats``; advance the counters by what grew since ``seen``
        (the engine's totals of preemptions, prefix queries, prefix hits and the speculative
        decoding counts); returns the totals."""
        usage = stats.num_kv_blocks_used / max(1, stats.num_kv_blocks_total)
        self.labels(self.running).set(stats.num_running)
        self.labels(self.waiting).set(stats.num_waiting)
        self.labels(self.kv_used).set(stats.num_kv_blocks_used)
        self.labels(self.kv_usage).set(usage)
        if self.vllm is not None:
            for gauge, value in zip(self.vllm, (stats.num_waiting, stats.num_running, usage)):
                self.labels(gauge).set(value)
        totals = (stats.num_preemptions, stats.prefix_cache_queries, stats.prefix_cache_hits,
                  stats.spec_num_drafts, stats.spec_num_draft_tokens,
                  stats.spec_num_accepted_tokens)
        seen = tuple(seen) + (0,) * (len(totals) - len(seen))
        for counter, now, before in zip((self.preemptions, self.prefix_queries,
                                         self.prefix_hits, self.spec_drafts,
                                         self.spec_draft_tokens, self.spec_accepted),
                                        totals, seen):
            if now > before:
                self.labels(counter).inc(now - before)
        return totals

    def update_structured(self, stats: StructuredStats, cache_bytes: int = 0) -> None:
        """Advance the constrained-decoding counters to the engine's totals."""
        self.labels(self.grammar_cache_bytes).set(cache_bytes)
        totals = (stats.constrained_requests, stats.compile_seconds, stats.mask_seconds,
                  stats.mask_rows)
        for counter, now, before in zip(self.structured, totals, self._structured_seen):
            if now > before:
                self.labels(counter).inc(now - before)
        self._structured_seen = totals
