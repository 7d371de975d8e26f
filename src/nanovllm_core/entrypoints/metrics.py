"""``GET /metrics``: the engine's counters in Prometheus text format, with vLLM's metric names.

A dashboard built for vLLM reads these unchanged. Counters and gauges are the engine's own
figures (``LLMEngine.stats()``, taken on the engine thread after each step and kept by the
controller: ``EngineController.stats()``, so a scrape never waits for a step), so they agree with
``llm.stats()`` exactly; latency histograms are filled from each finished request's metrics.

``n`` samples count as vLLM V1 counts them, which fans a request out into ``n`` child requests
(``vllm/v1/engine/parallel_sampling.py``): ``vllm:prompt_tokens`` adds each child's prompt length at its
first output (``vllm/v1/metrics/stats.py``, ``IterationStats.update_from_output``) and
``vllm:prefix_cache_queries`` each child's tokens at its lookup (``vllm/v1/core/kv_cache_manager.py``,
``get_computed_blocks``), so an ``n=2`` request on a 5-token prompt adds 10 to both; ``usage`` in a
response counts the prompt once, as vLLM's does. Each child is also a finished request of its own
(``vllm/v1/metrics/loggers.py``): ``vllm:request_success`` counts each sample under its own finish
reason, and the latency histograms get one observation per sample, its own TTFT, TPOT and e2e.

| metric | kind | from |
|---|---|---|
| ``vllm:num_requests_running`` / ``_waiting`` | gauge | scheduler queues |
| ``vllm:kv_cache_usage_perc`` | gauge | used KV blocks / all (0..1) |
| ``vllm:prefix_cache_queries`` / ``_hits`` | counter | tokens looked up / found in the prefix cache, per sequence admitted (a sample of ``n`` counts its prompt) |
| ``vllm:num_preemptions`` | counter | preemptions |
| ``vllm:prompt_tokens`` / ``vllm:generation_tokens`` | counter | prompt tokens of each sequence (each of ``n`` samples) at its first token / tokens generated |
| ``vllm:request_success`` | counter | finished samples (each of ``n``) by their own ``finished_reason`` |
| ``vllm:time_to_first_token_seconds`` | histogram | one observation per sample (each of ``n``) in the step that gave its first token |
| ``vllm:time_per_output_token_seconds``, ``vllm:e2e_request_latency_seconds`` | histogram | one observation per finished sample (each of ``n``), its own times |
| ``nanovllm:kv_blocks_total`` / ``_used`` / ``_cached``, ``nanovllm:steps`` | gauge / counter | no vLLM equivalent (``steps``: steps run; events number them from 0) |
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nanovllm_core.outputs import RequestOutput

# vLLM's bucket boundaries (seconds), so histograms from both servers line up.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _StatsCollector:
    """Yields the engine's counters and gauges from the newest ``stats()`` snapshot."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict[str, Any] = {}

    def collect(self):
        s, labels = self.stats, [self.model_name]
        if not s:
            return

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", s["num_running"])
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s["num_waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s["kv_cache_usage"])
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      s["prefix_cache_queries"])
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      s["prefix_cache_hits"])
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", s["num_preemptions"])
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed: each sample's prompt, counted at its first token.", s["total_prompt_tokens"])
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", s["total_output_tokens"])
        yield counter("nanovllm:steps", "Engine steps run (one scheduler plan and forward pass each); events and the "
                      "app number steps from 0, so after step N this is N + 1.", s["steps"])
        yield gauge("nanovllm:kv_blocks_total", "KV blocks in the pool.", s["kv_blocks_total"])
        yield gauge("nanovllm:kv_blocks_used", "KV blocks held by live requests.", s["kv_blocks_used"])
        yield gauge("nanovllm:kv_blocks_cached", "Free KV blocks still holding a cached prefix.", s["kv_blocks_cached"])
        if "paused" in s:  # the server adds it (the engine's stats do not know of the controller's pause)
            yield gauge("nanovllm:engine_paused", "1 while the engine is paused (requests wait for a resume), else 0.",
                        float(s["paused"]))


# The finish reasons this engine gives a sample that ran, vLLM's FinishReason values (stop, length, abort, error)
FINISHED_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    """The server's Prometheus registry (one per server, so several can live in one process).

    ``observe(output)`` records a finished request (thread-safe; the engine thread calls it);
    ``render(stats)`` returns the exposition text for an ``LLMEngine.stats()`` snapshot.
    """

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._stats = _StatsCollector(model_name)
        self.registry.register(self._stats)
        labels = ["model_name"]
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                labels + ["finished_reason"], registry=self.registry)
        for reason in FINISHED_REASONS:  # each series from the first scrape, at 0, as vLLM creates them for every
            self._success.labels(model_name, reason)  # FinishReason (trial 35c: a dashboard read "no data", not 0)
        self._ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                               labels, buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self._tpot = Histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                               labels, buckets=TPOT_BUCKETS, registry=self.registry).labels(model_name)
        self._e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                              labels, buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        self.model_name = model_name
        self._first_seen: set[tuple[str, int]] = set()  # (request id, sample) whose TTFT is observed already
        self._lock = threading.Lock()  # progress() and observe() run on the engine thread; kept simple and safe

    def progress(self, output: RequestOutput) -> None:
        """A request's output after a step: each sample's TTFT is observed in the step that gave its
        first token, as vLLM V1 records ``time_to_first_token_seconds`` in the iteration that produced it
        (``IterationStats``), not when the sample finishes (trial 30c: the count read 0 while two running
        requests held their first tokens and ``prompt_tokens_total`` counted both)."""
        for index, sample in enumerate(output.outputs):
            m = sample.metrics if sample.metrics is not None else output.metrics
            if m is None or m.time_to_first_token is None or sample.finish_reason == "rejected":
                continue
            key = (output.request_id, getattr(sample, "index", index))
            with self._lock:
                if key in self._first_seen:
                    continue
                self._first_seen.add(key)
            self._ttft.observe(m.time_to_first_token)

    def observe(self, output: RequestOutput) -> None:
        """Count one finished request, sample by sample: each sample's finish reason and, if it ran,
        its own TTFT, TPOT and latency.

        vLLM V1 runs ``n`` samples as ``n`` child requests (``vllm/v1/engine/parallel_sampling.py``)
        and records each child as it finishes (``vllm/v1/metrics/loggers.py``
        ``PrometheusStatLogger.record``, one observation per finished request): an ``n=3`` request
        whose samples end ``stop``, ``length``, ``length`` adds 1 to ``finished_reason="stop"``, 2 to
        ``"length"`` and 3 observations to each histogram, the longest as long as the whole request.
        A request the engine refused never ran: it is not counted (vLLM refuses such requests
        before they reach its engine).
        """
        self.progress(output)  # a TTFT no earlier output carried (a request that ended in its first step)
        for index, sample in enumerate(output.outputs):
            with self._lock:
                self._first_seen.discard((output.request_id, getattr(sample, "index", index)))
            reason = sample.finish_reason
            if reason == "rejected":
                continue
            self._success.labels(self.model_name, reason or "unknown").inc()
            m = sample.metrics if sample.metrics is not None else output.metrics
            if m.time_per_output_token is not None:
                self._tpot.observe(m.time_per_output_token)
            if m.finished_time is not None and m.arrival_time:
                self._e2e.observe(m.finished_time - m.arrival_time)

    def render(self, stats: dict[str, Any]) -> bytes:
        self._stats.stats = stats
        return generate_latest(self.registry)
