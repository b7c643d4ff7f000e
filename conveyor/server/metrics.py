"""Prometheus metrics (vLLM's names under `conveyor:`, and vLLM's own `vllm:` names beside them for the
routers and autoscalers that read those) and the periodic stats log line.

The `vllm:` series follow vLLM's types and labels (``model_name``, ``engine``: the replica): what the
Gateway API Inference Extension's endpoint picker (llm-d), vLLM production-stack's router and KEDA
recipes read. Differences from the `conveyor:` series of the same name: ``vllm:num_requests_running``
/ ``_waiting`` count requests (an n=4 request is one) where `conveyor:` counts sequences, a swapped
request is waiting, and the prefix-cache counters are in tokens (whole blocks x block size) where
`conveyor:` counts blocks. A replica that is down has no load gauges at all (a 0 would read as idle to a
picker taking the least loaded; its last stats are stale), only ``conveyor:replica_up 0`` and
``conveyor:engine_dead``; counters keep their totals."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from conveyor.frontend.outputs import RequestOutput
from conveyor.core.stats import EngineStats

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
        states = self.replicas()
        replicas = [(s, up, [self.model_name, str(i)]) for i, (s, up) in enumerate(states)]
        labels = ["model_name", "replica"]
        yield from self._conveyor(replicas, labels)
        yield from vllm_families(states, self.model_name)

    @staticmethod
    def _conveyor(replicas: list[tuple[EngineStats, bool, list[str]]], labels: list[str]) -> Iterator[Metric]:
        def gauge(name: str, doc: str, key: Callable[[EngineStats, bool], float],
                  load: bool = True) -> GaugeMetricFamily:
            """`load`: the replica's current work, left out while it is down."""
            g = GaugeMetricFamily(f"conveyor:{name}", doc, labels=labels)
            for s, up, m in replicas:
                if up or not load:
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
        group_hits = CounterMetricFamily(
            "conveyor:prefix_cache_group_hits", "Prompt KV blocks each layer group could have supplied from the "
            "prefix cache alone (a hit needs every group; window 0: a global group; one group unless the model "
            "has sliding-window layers).", labels=labels + ["group", "window"])
        for s, _, m in replicas:
            for g, (hits, window) in enumerate(zip(s.prefix_cache_group_hits, s.kv_group_windows)):
                group_hits.add_metric(m + [str(g), str(window)], hits)
        yield group_hits
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
        # Resident bytes: none for a replica that is down (its process, and its memory, are gone).
        yield gauge("weight_bytes", "Bytes of model weights held in memory: quantized blocks as stored, dense "
                    "weights and any prepacked or dense copies (docs/models.md).", lambda s, _: s.weight_bytes)
        yield gauge("kv_cache_bytes", "Bytes of the device KV cache.", lambda s, _: s.kv_cache_bytes)
        yield gauge("engine_dead", "1 once the engine stopped serving (repeated step failures).",
                    lambda s, _: float(s.engine_dead), load=False)
        yield gauge("replica_up", "1 while the engine replica serves (0: stopped, died or shutting down).",
                    lambda _, up: float(up), load=False)
        pre = CounterMetricFamily("conveyor:num_preemptions", "Preemptions, by how the KV was given back.",
                                  labels=labels + ["mode"])
        for s, _, m in replicas:
            pre.add_metric(m + ["swap"], s.num_swaps_out)
            pre.add_metric(m + ["recompute"], s.num_recomputes)
        yield pre


def vllm_families(states: list[tuple[EngineStats, bool]], model_name: str) -> Iterator[Metric]:
    """vLLM's scheduler, cache and token series, one per replica (label ``engine``, as vLLM labels its
    data-parallel engines). A replica that is down has no gauges (its counters stay)."""
    labels = ["model_name", "engine"]
    rows = [(s, up, [model_name, str(i)]) for i, (s, up) in enumerate(states)]

    def gauge(name: str, doc: str, key: Callable[[EngineStats], float]) -> GaugeMetricFamily:
        g = GaugeMetricFamily(f"vllm:{name}", doc, labels=labels)
        for s, up, m in rows:
            if up:
                g.add_metric(m, float(key(s)))
        return g

    def counter(name: str, doc: str, key: Callable[[EngineStats], float]) -> CounterMetricFamily:
        c = CounterMetricFamily(f"vllm:{name}", doc, labels=labels)
        for s, _, m in rows:
            c.add_metric(m, float(key(s)))
        return c

    def block_tokens(blocks: int, s: EngineStats) -> float:
        return float(blocks * s.block_size)

    yield gauge("num_requests_running", "Number of requests in model execution batches (an n > 1 request "
                "counts once).", lambda s: s.num_running_requests)
    yield gauge("num_requests_waiting", "Number of requests waiting to be processed (queued or swapped out).",
                lambda s: s.num_waiting_requests)
    yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lambda s: s.kv_usage)
    yield gauge("gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage. DEPRECATED (vLLM): use "
                "vllm:kv_cache_usage_perc.", lambda s: s.kv_usage)
    yield gauge("gpu_prefix_cache_hit_rate", "Prefix-cache hit rate since start (hits / queries, 0..1). "
                "DEPRECATED (vLLM): use vllm:prefix_cache_hits / vllm:prefix_cache_queries.",
                lambda s: s.prefix_cache_hit_rate)
    for prefix, note in (("", ""), ("gpu_", " DEPRECATED (vLLM): use vllm:prefix_cache_")):
        yield counter(f"{prefix}prefix_cache_queries", "Prefix cache queries, in tokens (whole prompt blocks "
                      "looked up x block size)." + (note and note + "queries."),
                      lambda s: block_tokens(s.prefix_cache_queries, s))
        yield counter(f"{prefix}prefix_cache_hits", "Prefix cache hits, in tokens (blocks found x block size)."
                      + (note and note + "hits."), lambda s: block_tokens(s.prefix_cache_hits, s))
    yield counter("num_preemptions", "Cumulative number of preemptions from the engine.",
                  lambda s: s.num_preemptions)
    yield counter("prompt_tokens", "Number of prefill tokens processed (each prompt whole, once, when its "
                  "first token is out: prefix-cache hits included, recomputation not; as vLLM counts).",
                  lambda s: s.prompt_tokens_started)
    yield counter("prompt_tokens_cached", "Number of cached prompt tokens (read from the prefix cache), of "
                  "vllm:prompt_tokens.", lambda s: s.prompt_tokens_cached)
    yield counter("generation_tokens", "Number of generation tokens processed.",
                  lambda s: s.generation_tokens_total)
    yield from _spec_decode_families(rows, labels)
    info = GaugeMetricFamily("vllm:cache_config_info", "Information of the engine's cache config (always 1).",
                             labels=["block_size", "num_gpu_blocks", "num_cpu_blocks", "engine"])
    for i, (s, _) in enumerate(states):
        info.add_metric([str(s.block_size), str(s.num_kv_blocks), str(s.num_host_kv_blocks), str(i)], 1.0)
    yield info
    lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests: adapters with sequences "
                             "queued and running (comma-separated names; the value is the time of the scrape).",
                             labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
    total = EngineStats.combine([s for s, _ in states]) if states else EngineStats()
    lora.add_metric([str(total.max_lora), ",".join(total.lora_waiting), ",".join(total.lora_running)], time.time())
    yield lora


def _spec_decode_families(rows: list[tuple[EngineStats, bool, list[str]]], labels: list[str]) -> Iterator[Metric]:
    """vLLM's speculative-decoding counters (its SpecDecodingProm), served only while speculation is on,
    as vLLM registers them only with a speculative config. On: some replica's stats have a position
    per speculative token (``spec_accepted_per_pos``, from its first report on, at 0). Per-position
    series: ``position`` 0..num_speculative_tokens-1, each from the start (at 0), as vLLM's. PromQL:
    acceptance rate ``rate(vllm:spec_decode_num_accepted_tokens_total[5m]) /
    rate(vllm:spec_decode_num_draft_tokens_total[5m])``; mean acceptance length (the bonus token
    included) ``1 + rate(..._num_accepted_tokens_total) / rate(..._num_drafts_total)``."""
    positions = max((len(s.spec_accepted_per_pos) for s, _, _ in rows), default=0)
    if not positions:
        return
    for name, doc, key in (
            ("num_drafts", "Number of spec decoding drafts.", lambda s: s.spec_num_drafts),
            ("num_draft_tokens", "Number of draft tokens.", lambda s: s.spec_num_draft_tokens),
            ("num_accepted_tokens", "Number of accepted tokens.", lambda s: s.spec_num_accepted_tokens)):
        c = CounterMetricFamily(f"vllm:spec_decode_{name}", doc, labels=labels)
        for s, _, m in rows:
            c.add_metric(m, float(key(s)))
        yield c
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Accepted tokens per draft position.", labels=labels + ["position"])
    for s, _, m in rows:
        counts = s.spec_accepted_per_pos
        for pos in range(positions):
            per_pos.add_metric(m + [str(pos)], float(counts[pos] if pos < len(counts) else 0))
    yield per_pos


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
        # vLLM's names for the same observations, labelled with the engine replica that served them
        vlabels = ["model_name", "engine"]

        def vhist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(f"vllm:{name}", doc, vlabels, buckets=buckets, registry=self.registry)

        self._vllm_hists = (
            (vhist("time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS),
             lambda m: m.ttft),
            (vhist("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", E2E_BUCKETS),
             lambda m: m.e2e),
            (vhist("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                   E2E_BUCKETS), lambda m: m.queue_time))
        self._vllm_itl = vhist("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                               ITL_BUCKETS)
        self.registry.register(_Renamed(self._vllm_itl, "vllm:time_per_output_token_seconds",
                                        "Histogram of time per output token in seconds (the inter-token "
                                        "latencies: vLLM's older name of vllm:inter_token_latency_seconds)."))
        self._vllm_success = Counter("vllm:request_success", "Count of successfully processed requests (per "
                                     "sequence, as vLLM counts an n > 1 request's children).",
                                     vlabels + ["finished_reason"], registry=self.registry)
        self._touch(0)

    def observe_finished(self, out: RequestOutput, engine: int = 0) -> None:
        """Per sequence of a finished request (aborted and failed ones are not counted); `engine`: the
        data-parallel replica that served it (the `vllm:` series' label)."""
        for c, m in zip(out.outputs, out.metrics):
            if c.finish_reason not in ("stop", "length"):
                continue
            self._success.labels(self._model_name, c.finish_reason).inc()
            self._vllm_success.labels(self._model_name, str(engine), c.finish_reason).inc()
            for hist, value in ((self.ttft, m.ttft), (self.e2e, m.e2e), (self.queue, m.queue_time)):
                if value is not None:
                    hist.observe(value)
            for vh, key in self._vllm_hists:
                value = key(m)
                if value is not None:
                    vh.labels(self._model_name, str(engine)).observe(value)
            vitl = self._vllm_itl.labels(self._model_name, str(engine))
            for dt in m.inter_token_latencies:
                self.itl.observe(dt)
                vitl.observe(dt)

    def finished_listeners(self, replicas: int) -> list[Callable[[RequestOutput], None]]:
        """One finished-request listener per engine replica (each labels its `vllm:` series with its index)."""
        for i in range(replicas):
            self._touch(i)
        return [functools.partial(self.observe_finished, engine=i) for i in range(replicas)]

    def _touch(self, engine: int) -> None:
        """An engine's `vllm:` request series exist (at 0) before its first request, as vLLM's do."""
        labels = (self._model_name, str(engine))
        for hist in [h for h, _ in self._vllm_hists] + [self._vllm_itl]:
            hist.labels(*labels)
        for reason in ("stop", "length"):
            self._vllm_success.labels(*labels, reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Renamed(Collector):
    """Another metric's series under a second name (an older name kept for the readers that use it),
    copied at scrape time rather than observed twice."""

    def __init__(self, source: Collector, name: str, doc: str):
        self.source, self.name, self.doc = source, name, doc

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            out = Metric(self.name, self.doc, family.type)
            out.samples = [s._replace(name=self.name + s.name[len(family.name):]) for s in family.samples]
            yield out


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
