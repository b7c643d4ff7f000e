"""Prometheus metrics (vLLM's names under `conveyor:`) and the periodic stats log line."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from conveyor.engine.outputs import RequestOutput
from conveyor.engine.stats import EngineStats

logger = logging.getLogger("conveyor.server")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class EngineStatsCollector(Collector):
    """Gauges and counters read from the engines' stats at scrape time, one series per replica
    (label ``replica``; a single engine is replica "0"): sum over it for the server's totals."""

    def __init__(self, replicas: Callable[[], list[tuple[EngineStats, bool]]], model_name: str):
        self.replicas = replicas
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        replicas = [(s, up, [self.model_name, str(i)]) for i, (s, up) in enumerate(self.replicas())]
        labels = ["model_name", "replica"]

        def gauge(name: str, doc: str, key: Callable[[EngineStats, bool], float]) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"conveyor:{name}", doc, labels=labels)
            for s, up, m in replicas:
                g.add_metric(m, key(s, up))
            return g

        def counter(name: str, doc: str, key: Callable[[EngineStats], float]) -> CounterMetricFamily:
            c = CounterMetricFamily(f"conveyor:{name}", doc, labels=labels)
            for s, _, m in replicas:
                c.add_metric(m, key(s))
            return c

        yield gauge("num_requests_running", "Sequences in the running batch.", lambda s, _: s.num_running)
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.", lambda s, _: s.num_waiting)
        yield gauge("num_requests_swapped", "Sequences swapped out to host memory.", lambda s, _: s.num_swapped)
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", lambda s, _: s.kv_usage)
        yield counter("prefix_cache_queries", "Prompt KV blocks looked up in the prefix cache.",
                      lambda s: s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt KV blocks found in the prefix cache.", lambda s: s.prefix_cache_hits)
        yield counter("prompt_tokens", "Prefill tokens computed (recomputation included, cache hits not).",
                      lambda s: s.prompt_tokens_total)
        yield counter("generation_tokens", "Tokens generated.", lambda s: s.generation_tokens_total)
        yield counter("prefix_cache_mismatches", "Prefix-cache keys that led to a block with other tokens or "
                      "another parent (a hash collision or a stale entry): counted as misses.",
                      lambda s: s.prefix_cache_mismatches)
        yield counter("preemption_blocks_swapped", "KV blocks copied to host memory by swap preemption (blocks "
                      "shared with other requests stay on the device).", lambda s: s.blocks_swapped_out)
        yield counter("preemption_tokens_recomputed", "Computed tokens thrown away by recompute preemption (less "
                      "the prefix other requests still hold).", lambda s: s.tokens_recomputed)
        yield counter("engine_step_failures", "Engine steps whose forward pass, sampling or swap copy raised "
                      "(their requests failed, the engine went on).", lambda s: s.step_failures)
        yield counter("request_queue_timeouts", "Requests failed because they waited longer than their "
                      "max_queue_time for their first scheduling (answered 503).", lambda s: s.num_queue_timeouts)
        yield counter("kv_invariant_violations", "Transitions to idle at which the KV cache was not whole (a "
                      "leaked block, a stray ref count or table; logged as errors, the engine went on).",
                      lambda s: s.kv_invariant_violations)
        yield gauge("engine_dead", "1 once the engine stopped serving (repeated step failures).",
                    lambda s, _: float(s.engine_dead))
        yield gauge("replica_up", "1 while the engine replica serves (0: stopped, died or shutting down).",
                    lambda _, up: float(up))
        pre = CounterMetricFamily("conveyor:num_preemptions", "Preemptions, by how the KV was given back.",
                                  labels=labels + ["mode"])
        for s, _, m in replicas:
            pre.add_metric(m + ["swap"], s.num_swaps_out)
            pre.add_metric(m + ["recompute"], s.num_recomputes)
        yield pre


class ServerMetrics:
    """One CollectorRegistry per app (never the global one), so several servers can share a process."""

    def __init__(self, replicas: Callable[[], list[tuple[EngineStats, bool]]], model_name: str):
        """`replicas`: per engine replica, (its stats, whether it serves)."""
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(replicas, model_name))
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(f"conveyor:{name}", doc, labels, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", E2E_BUCKETS)
        self._success = Counter("conveyor:request_success", "Sequences finished, by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)   # vLLM's label
        self._model_name = model_name

    def observe_finished(self, out: RequestOutput) -> None:
        """Per sequence of a finished request (aborted and failed ones are not counted)."""
        for c, m in zip(out.outputs, out.metrics):
            if c.finish_reason not in ("stop", "length"):
                continue
            self._success.labels(self._model_name, c.finish_reason).inc()
            for hist, value in ((self.ttft, m.ttft), (self.e2e, m.e2e), (self.queue, m.queue_time)):
                if value is not None:
                    hist.observe(value)
            for dt in m.inter_token_latencies:
                self.itl.observe(dt)

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def log_stats(stats: Callable[[], EngineStats], interval: float) -> None:
    """Every `interval` seconds while busy: throughput, queue sizes, KV usage, prefix hit rate."""
    prev, t_prev = stats(), time.monotonic()
    while True:
        await asyncio.sleep(interval)
        s, now = stats(), time.monotonic()
        dt = max(now - t_prev, 1e-9)
        prompt = s.prompt_tokens_total - prev.prompt_tokens_total
        gen = s.generation_tokens_total - prev.generation_tokens_total
        queries = s.prefix_cache_queries - prev.prefix_cache_queries
        hits = s.prefix_cache_hits - prev.prefix_cache_hits
        if prompt or gen or s.num_running or s.num_waiting or s.num_swapped:
            logger.info("prompt %.1f tok/s, generation %.1f tok/s | running %d, waiting %d, swapped %d | "
                        "KV %.1f%% | prefix cache hit rate %.1f%%", prompt / dt, gen / dt, s.num_running,
                        s.num_waiting, s.num_swapped, 100 * s.kv_usage,
                        100 * hits / queries if queries else 0.0)
        prev, t_prev = s, now
