"""Property tests of the scheduler + KV cache manager, stepped by the real EngineCore with a fake executor.

``Sim`` drives ``EngineCore.step()`` (the engine's only step loop) with a fake executor that
keeps a shadow copy of every KV slot: it writes the token of each computed position into
the slot the block table names, applies swap copies like the runner (out first, then in),
and checks that every position a sequence attends to holds that sequence's own token. So a
wrong prefix hit, a block shared while written, a bad swap mapping or a chunk that does not
start at ``num_computed_tokens`` shows up as wrong "KV" — not only as a broken counter.

The executor only sees the plan's plain data, and keeps each request's block table and output
count from the plans' deltas with the runner's own ``RunnerState`` (so wrong deltas show up as
wrong KV too, and the tables are checked against the KV manager's); to check the KV it reads the
true token sequence of a request from the test's own records (its oracle), never from the plan.
The sampled token of a request is a pure function of (seed, output index); the EOS lands at
a chosen output index, so each request's output is known in advance and must come out
identical whatever the batching, chunking, preemption or prefix-cache hits were.

Other files of this directory import ``Sim`` and ``make_request`` from here.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.core.engine_core import EngineCore
from conveyor.kv.layout import KVLayout
from conveyor.kv.manager import KVCacheManager
from conveyor.request import Request, RequestStatus
from conveyor.runner.state import RunnerState
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.admission import AdmissionPolicy
from conveyor.scheduler.config import SchedulerConfig
from conveyor.scheduler.output import ModelOutput, SchedulerOutput
from conveyor.scheduler.scheduler import Scheduler
from conveyor.spec.speculator import SpeculativeConfig, Speculator

EOS = 0
VOCAB = 50


def windows_layout(windows: tuple[int, ...]) -> KVLayout:
    """KV layer groups of these windows (0: global), one layer each: what the manager plans with."""
    return KVLayout(windows, tuple(range(len(windows))), (0,) * len(windows), 1)


def token_at(seed: int, k: int) -> int:
    """The non-EOS token a request with this seed samples at output index k."""
    return 1 + (seed * 7919 + k * 104729) % (VOCAB - 1)


@dataclass(slots=True, eq=False)
class OracleRequest(Request):
    """A request that knows its true output length (the test's oracle; the executor never sees it)."""

    out_len: int | None = None


def make_request(rid: str, prompt: list[int], max_tokens: int | None, *, out_len: int | None = None,
                 priority: int = 0, ignore_eos: bool = False, max_model_len: int | None = None,
                 seed: int = 0, leader: Request | None = None) -> OracleRequest:
    """A greedy request whose EOS comes at output index out_len - 1 (never if out_len is None)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, temperature=0)
    params.eos_token_ids = (EOS,)
    return OracleRequest(rid, list(prompt), params, seed=seed, priority=priority, max_model_len=max_model_len,
                         prefill_leader=leader, out_len=out_len)


def true_token(req: OracleRequest, k: int) -> int:
    """What the request samples at output index k."""
    return EOS if req.out_len is not None and k == req.out_len - 1 else token_at(req.seed, k)


class TruthProposer:
    """Speculative drafts that are right for a while, then wrong: the first m of up to k drafts are the
    request's true next tokens, m a pure function of (request, position) -- so drafts are accepted,
    refused, and accepted into a finish."""

    name = "truth"

    def propose(self, req: OracleRequest, k: int) -> list[int]:
        n = req.num_output_tokens
        m = zlib.crc32(f"{req.request_id}:{n}".encode()) % (k + 2)
        drafts = [true_token(req, n + j) for j in range(min(m, k))]
        if len(drafts) < k:
            drafts.append(1 + true_token(req, n + len(drafts)) % (VOCAB - 1))   # a wrong one
        return drafts

    def finished(self, req: OracleRequest) -> None:
        pass


def speculator(k: int):
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=k, adaptive=False))
    spec.proposer = TruthProposer()
    return spec


def expected_output(req: OracleRequest) -> list[int]:
    toks = []
    for k in range(req.max_tokens):
        eos = req.out_len is not None and k == req.out_len - 1
        toks.append(EOS if eos else token_at(req.seed, k))
        if eos and not req.params.ignore_eos:
            break
    return toks


class InjectedFault(RuntimeError):
    pass


class FakeExecutor:
    """Shadow KV memory + deterministic sampling, behind the engine core's Executor protocol.

    ``fault(phase)`` (phase "swap" or "execute") may return True to raise InjectedFault in that
    phase; "execute" faults strike after the step's KV writes, like a forward pass dying midway.
    ``on_call()`` runs at the start of every swap() and execute(), before anything of the step runs.
    """

    def __init__(self, kv: KVCacheManager, oracle: Callable[[str], OracleRequest]):
        self.kv = kv
        self.oracle = oracle
        bs = kv.block_size
        # a slot holds (layer group, token); with several groups, block b of group g is table[b * G + g]
        self.device: list[list[tuple[int, int] | None]] = [[None] * bs for _ in range(kv.num_blocks)]
        self.host: list[list[int | None]] = [[None] * bs for _ in range(kv.num_host_blocks)]
        self.fault: Callable[[str], bool] = lambda phase: False
        self.on_call: Callable[[], None] = lambda: None
        self.during_execute: Callable[[], None] = lambda: None
        self.state = RunnerState()   # what a runner keeps of each request, from the plans' deltas

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        self.on_call()
        swap_out_hosts = {h for _, h in swap_out}
        swap_in_hosts = {h for h, _ in swap_in}
        # Swap-outs are copied before swap-ins: a host block read by a swap-in must not be
        # overwritten by a swap-out of the same step.
        assert not swap_out_hosts & swap_in_hosts, "host block swapped out and in in one step"
        assert len(swap_out_hosts) == len(swap_out) and len(swap_in_hosts) == len(swap_in)
        for d, h in swap_out:
            self.host[h] = list(self.device[d])
        if self.fault("swap"):
            raise InjectedFault("injected swap failure")
        for h, d in swap_in:
            self.device[d] = list(self.host[h])

    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        self.on_call()
        self.state.apply(plan)
        self._check_state()
        bs, G, windows = self.kv.block_size, self.kv.num_groups, self.kv.windows
        # Writes first (a real forward writes every layer's new KV before attending), then reads.
        for s in plan.scheduled:
            truth = self.oracle(s.request_id).all_token_ids
            table = self.state.block_table(s.request_id)
            c, known = s.num_computed_tokens, s.num_tokens - s.num_drafts
            assert s.token_ids[:known] == truth[c:c + known], f"{s.request_id}: plan tokens are not its tokens"
            for pos in range(c, c + s.num_tokens):   # (drafts' KV too: a refused one's is garbage)
                for g in range(G):
                    b = table[pos // bs * G + g]
                    assert self.kv.ref_count(b) == 1, f"{s.request_id} writes into shared block {b}"
                    assert not self.kv.is_cached(b), f"{s.request_id} writes into cached block {b}"
                    self.device[b][pos % bs] = (g, s.token_ids[pos - c])
        self.during_execute()
        if self.fault("execute"):
            raise InjectedFault("injected forward failure")
        tokens, accepted = {}, {}
        for s in plan.scheduled:
            req = self.oracle(s.request_id)
            table = self.state.block_table(s.request_id)
            known = s.num_computed_tokens + s.num_tokens - s.num_drafts
            for g, w in enumerate(windows):   # what the chunk's known tokens see: all, or their windows
                for pos in range(max(0, s.num_computed_tokens - w + 1) if w else 0, known):
                    got = self.device[table[pos // bs * G + g]][pos % bs]
                    assert got == (g, req.all_token_ids[pos]), \
                        f"{s.request_id}: KV at position {pos} (group {g}) holds {got}, expected {req.all_token_ids[pos]}"
            if s.sample:
                row = self.state.row(s.request_id)
                k = row.num_output_tokens
                assert k == req.num_output_tokens
                if s.num_drafts:   # verification: the drafts that are its true next tokens, in order
                    drafts = s.token_ids[s.num_tokens - s.num_drafts:]
                    a = 0
                    while a < len(drafts) and drafts[a] == true_token(req, k + a):
                        a += 1
                    accepted[s.request_id] = a
                    self.state.accept(s.request_id, a)
                    k += a
                tokens[s.request_id] = true_token(req, k)
        return ModelOutput(tokens, prompt_logprobs=self._prompt_logprobs(plan) or None,
                           embeddings=self._embeddings(plan) or None, accepted=accepted or None)

    def _check_state(self) -> None:
        """After a plan, the runner holds running and swapped requests only, each running one with the KV
        manager's table."""
        for rid, held in self.state.requests.items():
            req = self.oracle(rid)
            assert req.status in (RequestStatus.RUNNING, RequestStatus.SWAPPED), \
                f"the runner still holds {rid} ({req.status})"
            if req.status == RequestStatus.RUNNING:   # a swapped one's table is replaced when it returns
                table, null = self.kv.block_table(rid), self.kv.null_block
                # (where a local group gave a block back, the runner keeps the old id and never reads it)
                assert len(held.block_ids) == len(table) and all(
                    b == t or t == null for b, t in zip(held.block_ids, table)), \
                    f"{rid}: the runner's table is not the KV manager's"

    @staticmethod
    def _prompt_logprobs(plan: SchedulerOutput) -> dict:
        """Prompt logprobs as a pure function of (position, token): the entry for prompt
        position p is {token: -p}. A chunk starting at c gives positions c+1 ... from its row
        prompt_targets_row on."""
        out = {}
        for s in plan.scheduled:
            if s.prompt_targets:
                c = s.num_computed_tokens + s.prompt_targets_row
                out[s.request_id] = [{t: -float(c + 1 + j)} for j, t in enumerate(s.prompt_targets)]
        return out

    def _embeddings(self, plan: SchedulerOutput) -> dict:
        """Hidden states as a pure function of (position, token): row p is token * (p + 1). The
        running sum is kept in the runner's state (a recompute starts it over, as the real runner);
        the chunk that ends the prompt returns [the sum] (mean) or [the last row] (last)."""
        out = {}
        for s in plan.scheduled:
            if s.pooling is not None:
                c = s.num_computed_tokens
                rows = range(c, c + s.num_tokens) if s.pooling == "mean" else [c + s.num_tokens - 1]
                held = self.state.requests[s.request_id]
                held.pooled = (held.pooled or 0.0) + float(sum(s.token_ids[p - c] * (p + 1) for p in rows))
                if s.pool_end:
                    out[s.request_id] = [held.pooled]
        return out


@dataclass
class StepLog:
    step: int
    scheduled: dict[str, int]                    # request id -> tokens this step
    sampled: set[str]
    swapped_out: set[str] = field(default_factory=set)
    preempted: set[str] = field(default_factory=set)   # recompute or swap
    admitted: set[str] = field(default_factory=set)    # WAITING -> RUNNING this step
    failed: set[str] = field(default_factory=set)      # finished with an error (injected fault)


class Sim:
    """EngineCore over the real scheduler and a fake executor, with invariant checks after every step."""

    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 prefix_caching: bool = True, admission: AdmissionPolicy | None = None, check: bool = True,
                 max_consecutive_failures: int = 3, windows: tuple[int, ...] = (0,), speculate: int = 0):
        """windows: the KV layer groups' (KVLayout; default one global group); speculate: up to this
        many speculative drafts per decode (TruthProposer's)."""
        self.config = config
        self.kv = KVCacheManager(num_blocks, block_size, num_host_blocks, prefix_caching, windows_layout(windows))
        self.sched = Scheduler(config, self.kv, admission)
        if speculate:
            self.sched.speculator = speculator(speculate)
        self.all: dict[str, OracleRequest] = {}
        self.exe = FakeExecutor(self.kv, self.all.__getitem__)
        self.core = EngineCore(self.sched, self.exe, clock=self._tick, max_consecutive_failures=max_consecutive_failures)
        self.check = check
        self.ended: set[str] = set()       # finished, aborted or failed
        self.embeddings: dict[str, list[float]] = {}   # embedding requests' results, as the core sent them
        self.log: list[StepLog] = []
        self.time = 0.0

    def _tick(self) -> float:
        self.time += 1e-3
        return self.time

    def add(self, req: OracleRequest) -> OracleRequest:
        self.core.add_request(req)
        self.all[req.request_id] = req
        return req

    def abort(self, rid: str) -> None:
        self.core.abort_requests([rid])
        self.ended.add(rid)

    def step(self, abort_mid: list[str] = ()) -> SchedulerOutput:
        before = {rid: (r.status, r.metrics.num_preemptions) for rid, r in self.all.items()}
        entries: list[StepLog] = []

        def on_call() -> None:   # the plan, checked before the executor runs any of it
            if not entries:
                entries.append(self._log_plan(self.core.last_plan, before))

        def abort_now() -> None:   # an abort that lands while the step executes
            for rid in abort_mid:
                self.abort(rid)

        self.exe.on_call, self.exe.during_execute = on_call, abort_now
        updates = self.core.step()
        out = self.core.last_plan
        if not entries:   # nothing ran: the plan is checked against the (unchanged) state now
            entries.append(self._log_plan(out, before))
        entry = entries[0]
        for u in updates:
            if u.error is not None:
                entry.failed.add(u.seq_id)
            if u.embedding is not None:
                assert u.seq_id not in self.embeddings, f"{u.seq_id}: two embeddings"
                self.embeddings[u.seq_id] = u.embedding
        for r in self.all.values():
            if r.is_finished:
                self.ended.add(r.request_id)
        if self.check:
            self.check_state()
        return out

    def _log_plan(self, out: SchedulerOutput, before: dict) -> StepLog:
        entry = StepLog(out.step, {s.request_id: s.num_tokens for s in out.scheduled},
                        {s.request_id for s in out.scheduled if s.sample})
        for rid, r in self.all.items():
            status, preemptions = before[rid]
            if r.metrics.num_preemptions != preemptions:
                assert r.metrics.num_preemptions == preemptions + 1, f"{rid} preempted twice in one step"
                entry.preempted.add(rid)
                if r.status == RequestStatus.SWAPPED:
                    entry.swapped_out.add(rid)
            if status == RequestStatus.WAITING and r.status == RequestStatus.RUNNING:
                entry.admitted.add(rid)
        self.log.append(entry)
        if self.check:
            self.check_plan(out, entry)
        return entry

    # ---- checks ------------------------------------------------------------------------------
    def check_plan(self, out: SchedulerOutput, entry: StepLog) -> None:
        cfg, kv = self.config, self.kv
        ids = [s.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids)), f"a request scheduled twice in one step: {ids}"
        assert len(ids) <= cfg.max_num_seqs
        total = sum(s.num_tokens for s in out.scheduled)
        assert total <= cfg.max_num_batched_tokens, f"{total} tokens > budget {cfg.max_num_batched_tokens}"
        assert total == out.num_tokens
        for s in out.scheduled:
            rid = s.request_id
            req = self.all[rid]
            assert rid not in self.ended, f"{rid} ran after it finished/aborted"
            assert req.status == RequestStatus.RUNNING, f"{rid} scheduled while {req.status}"
            assert rid not in entry.swapped_out
            assert req in self.sched.running
            assert s.num_tokens >= 1
            assert s.num_computed_tokens == req.num_computed_tokens
            known = s.num_tokens - s.num_drafts
            assert req.num_computed_tokens + known <= req.num_tokens
            assert s.sample == (req.num_computed_tokens + known == req.num_tokens and req.params.pooling is None)
            if s.num_drafts:   # drafts: a decode's, within its output limit
                assert known == 1 and req.num_output_tokens > 0
                assert req.num_output_tokens + 1 + s.num_drafts <= req.max_tokens
            held = [] if s.new is not None or s.replace_table else self.exe.state.block_table(rid)   # (before)
            rebuilt, table = held + s.new_block_ids, kv.block_table(rid)
            # (where a local group gave a block back the runner keeps the old id, never read again)
            assert len(rebuilt) == len(table) and all(b == t or t == kv.null_block for b, t in zip(rebuilt, table)), \
                f"{rid}: the delta does not rebuild its table"
            assert len(table) // kv.num_groups * kv.block_size >= req.num_computed_tokens + s.num_tokens
            assert s.num_tokens - s.num_drafts <= cfg.prefill_chunk_cap
        assert set(out.swapped_out_ids) == entry.swapped_out
        swapped_blocks = sum(kv.num_swapped_blocks(rid) for rid in entry.swapped_out)
        assert swapped_blocks == len(out.swap_out)
        self.check_state()

    def check_state(self) -> None:
        kv, sched = self.kv, self.sched
        live = {rid for rid, r in self.all.items() if not r.is_finished}
        assert set(sched.requests) == live
        kv.check_invariants(live)
        # every block is in exactly one place
        owned = {b for t in [*kv.tables.values(), *kv.swapped_tables.values()] for b in t
                 if b is not None and b != kv.null_block}
        free = set(kv.pool.free)
        assert not owned & free and owned | free == set(range(kv.num_blocks))
        assert len(set(kv.host.free_ids)) == len(kv.host.free_ids)
        host_used = [h for t in kv.host_tables.values() for h in t]
        assert len(set(host_used)) == len(host_used) and not set(host_used) & set(kv.host.free_ids)
        running, swapped = set(map(id, sched.running)), set(map(id, sched.swapped))
        assert len(running) == len(sched.running) and len(swapped) == len(sched.swapped)
        # requests (an n > 1 request once, by its leader), kept incrementally, equal a count from scratch
        group = lambda r: (r.prefill_leader or r).request_id   # noqa: E731
        assert sched.counts.live == len({group(r) for r in sched.requests.values()})
        assert sched.counts.running == len({group(r) for r in sched.running})
        assert len(sched.running) <= self.config.max_num_seqs
        # the tenants' ledger (scheduler/fairness.py), kept incrementally, equals a count from scratch
        assert sched.tenants.live == dict(Counter(r.tenant for r in sched.requests.values()))
        assert sched.tenants.running == dict(Counter(r.tenant for r in sched.running))
        n_waiting = 0
        for rid, r in self.all.items():
            if r.is_finished:
                assert rid not in kv.tables and rid not in kv.host_tables and rid not in kv.hashes
                assert id(r) not in running and id(r) not in swapped
            elif r.status == RequestStatus.RUNNING:
                assert id(r) in running
                assert rid not in kv.host_tables
                assert r.num_computed_tokens < r.num_tokens
                if self.config.scheduling_policy == "continuous":
                    assert kv.num_held(rid) >= 1
            elif r.status == RequestStatus.SWAPPED:
                assert id(r) in swapped and rid in kv.host_tables and rid not in kv.tables
            else:
                assert r.status == RequestStatus.WAITING
                n_waiting += 1
                assert id(r) not in running and id(r) not in swapped
                assert kv.num_held(rid) == 0 and rid not in kv.host_tables and r.num_computed_tokens == 0
            assert r.num_output_tokens <= r.max_tokens
        assert len(sched.waiting) == n_waiting
        if not sched.has_unfinished():
            self.check_idle()

    def check_idle(self) -> None:
        kv = self.kv
        assert kv.num_free_blocks == kv.num_blocks
        assert kv.num_free_host_blocks == kv.num_host_blocks
        assert not kv.tables and not kv.host_tables and not kv.swapped_tables and not kv.hashes
        assert not kv.num_registered
        assert not self.sched.running and not self.sched.swapped and len(self.sched.waiting) == 0

    def run(self, max_steps: int) -> int:
        """Step until every request has finished; returns the number of steps taken."""
        for n in range(max_steps):
            if not self.sched.has_unfinished():
                return n
            self.step()
        raise AssertionError(f"not done after {max_steps} steps: {self.core.engine_stats()}")

    def check_outputs(self) -> None:
        for rid, r in self.all.items():
            if r.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH) and r.params.pooling is None:
                assert r.output_token_ids == expected_output(r), rid


# ---- hypothesis-driven simulations ------------------------------------------------------------

@dataclass
class Arrival:
    step: int
    req: Request
    abort_at: int | None = None      # step (relative to the start) at which it is aborted
    abort_mid: bool = False          # abort while the step executes (between schedule and update)

    def __repr__(self) -> str:
        r, p = self.req, self.req.params
        lead = r.prefill_leader.request_id if r.prefill_leader else None
        return (f"Arrival(step={self.step}, {r.request_id}: prompt={r.prompt_token_ids}, max_tokens={p.max_tokens}, "
                f"out_len={r.out_len}, prio={r.priority}, ignore_eos={p.ignore_eos}, "
                f"max_model_len={r.max_model_len}, seed={r.seed}, leader={lead}, abort_at={self.abort_at}, "
                f"mid={self.abort_mid})")


PREFIXES = [[1 + (i * 13 + j * 7) % (VOCAB - 1) for j in range(64)] for i in range(3)]


@st.composite
def scenarios(draw, pressure: bool = False):
    """A random workload and configuration. pressure=True biases towards memory preemption:
    optimistic admission, many sequences, long outputs, everyone arriving early."""
    block_size = draw(st.sampled_from([1, 4, 16]))
    # KV layer groups: mostly one global group; else local ones (windows of 3-6 tokens) with or
    # without global ones, as sliding-window models have (conveyor/kv/layout.py)
    windows = draw(st.sampled_from([(0,), (0,), (0,), (5,), (0, 3), (0, 6, 6)]))
    # tiny pools relative to the workload, so that memory runs out and preemption happens
    num_blocks = draw(st.integers(8, {1: 64, 4: 24, 16: 10}[block_size])) * (len(windows) if 0 in windows else 1)
    capacity = min(windows_layout(windows).max_tokens(num_blocks, block_size), 10_000)
    budget = draw(st.sampled_from([1, 2, 5, 8, 16, 33, 64, 256]))
    cfg = SchedulerConfig(
        max_num_seqs=draw(st.integers(4, 8) if pressure else st.integers(1, 8)),
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=draw(st.sampled_from([0, 1, 3, 7, 32])),
        preemption_mode=draw(st.sampled_from(["recompute", "swap", "auto"])),
        admission_policy=draw(st.sampled_from(
            ["optimistic"] if pressure else ["optimistic", "conservative", "predictive"])),
        scheduling_policy=draw(st.sampled_from(["continuous"] if pressure else ["continuous", "continuous", "static"])),
        admission_quantile=draw(st.sampled_from([0.5, 0.9, 1.0])),
        reservation_buffer=draw(st.sampled_from([0.0, 0.05, 0.2])),
        min_resident_steps=draw(st.integers(0, 5)),
        swap_cost_per_block=draw(st.sampled_from([1e-4, 1e-2])),
    )
    num_host = draw(st.sampled_from([0, 2, 5, 16, 64]))
    caching = draw(st.booleans())
    arrivals = []
    leader, leader_step = None, 0
    for i in range(draw(st.integers(3 if pressure else 1, 12))):
        step = draw(st.integers(0, 2 if pressure else 8))
        max_prompt = min(capacity - 1, 48)
        plen = draw(st.integers(1, max_prompt))
        shared = draw(st.integers(0, plen))
        src = draw(st.integers(0, len(PREFIXES) - 1))
        prompt = PREFIXES[src][:shared] + [draw(st.integers(1, VOCAB - 1)) for _ in range(plen - shared)]
        max_tokens = draw(st.integers(1, min(40, capacity - plen)))
        out_len = draw(st.one_of(st.none(), st.integers(10 if pressure else 1, 40)))
        max_model_len = draw(st.one_of(st.none(), st.integers(plen + 1, plen + max_tokens)))
        sibling = leader is not None and draw(st.integers(0, 5)) == 0
        if sibling:   # an n > 1 sibling: same prompt and arrival, waits for the leader's prefill
            step, prompt = leader_step, list(leader.prompt_token_ids)
            max_tokens = min(max_tokens, capacity - len(prompt))
            max_model_len = None
        priority = leader.priority if sibling else draw(st.integers(0, 2))   # siblings share it
        req = make_request(f"r{i}", prompt, max_tokens, out_len=out_len, priority=priority,
                           ignore_eos=draw(st.booleans()), max_model_len=max_model_len,
                           seed=draw(st.integers(0, 1000)), leader=leader if sibling else None)
        if not sibling:
            leader, leader_step = req, step
        abort_at = draw(st.one_of(st.none(), st.none(), st.none(), st.integers(step, step + 40)))
        arrivals.append(Arrival(step, req, abort_at, draw(st.booleans())))
    return cfg, num_blocks, block_size, num_host, caching, arrivals, windows


def step_bound(arrivals: list[Arrival]) -> int:
    work = sum(a.req.num_prompt_tokens + a.req.max_tokens for a in arrivals)
    return 100 + max(a.step for a in arrivals) + 30 * work


def drive(cfg, num_blocks, block_size, num_host, caching, arrivals, windows=(0,), speculate=0) -> Sim:
    sim = Sim(cfg, num_blocks, block_size, num_host, caching, windows=windows, speculate=speculate)
    pending = sorted(arrivals, key=lambda a: a.step)
    aborts = {a.req.request_id: a for a in arrivals if a.abort_at is not None}
    bound = step_bound(arrivals)
    t = 0
    while pending or sim.sched.has_unfinished():
        assert t < bound, f"livelock/starvation: not done after {bound} steps, {sim.core.engine_stats()}"
        while pending and pending[0].step <= t:
            sim.add(pending.pop(0).req)
        mid = []
        for rid, a in list(aborts.items()):
            if a.abort_at == t and rid in sim.sched.requests:
                if a.abort_mid:
                    mid.append(rid)
                else:
                    sim.abort(rid)
                del aborts[rid]
        sim.step(abort_mid=mid)
        t += 1
    sim.check_idle()
    sim.check_outputs()
    return sim


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(scenarios(), scenarios(pressure=True)))
def test_random_workloads_keep_invariants_and_finish(scenario):
    sim = drive(*scenario)
    cfg = scenario[0]
    s = sim.sched.stats
    assert s.num_finished + s.num_aborted == len(sim.all)
    if cfg.preemption_mode == "recompute":
        assert s.num_swaps_out == 0
    assert s.num_swaps_in <= s.num_swaps_out
    # (a finished/aborted request never running again, and a swapped one never running in the
    # step it left, are checked in every step by Sim.check_plan)
    for entry in sim.log:
        assert not entry.swapped_out & set(entry.scheduled)
        # a recompute victim may be re-admitted within the step that preempted it (from scratch)
        for rid in entry.preempted & set(entry.scheduled):
            assert rid not in entry.swapped_out


SPEC_SEEN = {"accepted": 0, "refused": 0, "preempted": 0}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(scenarios(), scenarios(pressure=True)), st.integers(1, 6))
def test_random_workloads_with_speculation_give_the_same_outputs(scenario, k):
    """Speculative drafts, accepted and refused, in every situation the scenarios make (chunked
    prefill, preemption by swap and recompute, prefix sharing, aborts, layer groups): the same outputs,
    every invariant after every step (Sim's checks), the cache whole at the end."""
    sim = drive(*scenario, speculate=k)
    s = sim.sched.speculator.stats
    SPEC_SEEN["accepted"] += s.num_accepted_tokens
    SPEC_SEEN["refused"] += s.num_draft_tokens - s.num_accepted_tokens
    SPEC_SEEN["preempted"] += sim.sched.stats.num_preemptions if s.num_drafts else 0


def test_the_speculation_scenarios_exercised_acceptance_refusal_and_preemption():
    """(runs after the property test above, in file order)"""
    if not any(SPEC_SEEN.values()):
        pytest.skip("run with the property test above")
    assert SPEC_SEEN["accepted"] > 0 and SPEC_SEEN["refused"] > 0 and SPEC_SEEN["preempted"] > 0


@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("admission", ["optimistic", "conservative", "predictive"])
@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_every_policy_combination_finishes(mode, admission, caching, policy):
    """A fixed, memory-tight workload under every policy combination: all finish with the
    expected tokens, and the pool drains. The host pool (3 blocks) is too small for most
    victims, so swap falls back to recompute."""
    block_size = {"recompute": 1, "swap": 4, "auto": 16}[mode]
    num_blocks = max(8, 96 // block_size)
    cfg = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, preemption_mode=mode,
                          admission_policy=admission, min_resident_steps=2, long_prefill_token_threshold=8,
                          scheduling_policy=policy)
    sim = Sim(cfg, num_blocks, block_size, 3, caching)
    cap = num_blocks * block_size
    for i in range(12):
        plen = 3 + (i * 5) % 17
        prompt = PREFIXES[i % 2][:plen // 2] + [1 + (i + j) % 40 for j in range(plen - plen // 2)]
        sim.add(make_request(f"r{i}", prompt, min(40, cap - plen), out_len=5 + (i * 11) % 30, seed=i,
                             priority=i % 2))
    sim.run(5000)
    sim.check_outputs()
    assert sim.sched.stats.num_finished == 12


def test_a_request_that_gives_way_to_itself_keeps_its_swap_out():
    """Found by Hypothesis. Two n > 1 siblings share their leader's prompt blocks (hybrid KV: one global,
    two local groups); one is swapped out, so the shared blocks stay pinned on the device. The other,
    alone and short of memory, swaps itself out: nothing runs. Dropping pinned swapped requests then
    must spare the one whose swap-out copies this very plan carries (it used to free its host blocks
    under the plan: swapped_out_ids named a request that was WAITING again); it is dropped later if
    still stuck."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2, long_prefill_token_threshold=0,
                          preemption_mode="swap", victim_policy="cost", admission_policy="optimistic",
                          min_resident_steps=0, swap_cost_per_block=1e-4)
    r0 = make_request("r0", [1] * 6, 1)
    arrivals = [Arrival(0, r0), Arrival(0, make_request("r1", [1] * 6, 4, leader=r0)),
                Arrival(0, make_request("r2", [1] * 6, 2, leader=r0))]
    sim = drive(cfg, 24, 1, 16, True, arrivals, windows=(0, 6, 6))   # checks every plan against the state
    gave_way = [e for e in sim.log if e.swapped_out and not e.scheduled]
    assert gave_way and sim.sched.stats.num_swaps_dropped >= 1
    assert sim.sched.stats.num_finished == 3


def test_a_running_request_without_blocks_gives_way_by_recompute():
    """Found by Hypothesis. Static batching admits a batch before its first chunks' blocks exist;
    with a sliding window the admission check counts a window's blocks while a prompt's chunk needs
    a block per token during its step, so a member can fail to grow and give way to itself holding
    no KV. Swap mode used to swap it out (no table: KeyError, the engine died); it is recomputed."""
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, long_prefill_token_threshold=0,
                          preemption_mode="swap", admission_policy="optimistic", scheduling_policy="static",
                          min_resident_steps=0)
    r0 = make_request("r0", [1] * 8, 1)
    arrivals = [Arrival(0, r0), Arrival(0, make_request("r1", [1] * 8, 1, leader=r0)),
                Arrival(0, make_request("r2", [1], 1))]
    sim = drive(cfg, 8, 1, 0, False, arrivals, windows=(5,))   # checks every plan against the state
    assert sim.sched.stats.num_finished == 3 and sim.sched.stats.num_errors == 0
    assert sim.sched.stats.num_recomputes >= 1 and sim.sched.stats.num_swaps_out == 0


def test_static_batching_brings_its_swapped_members_back():
    """Found by Hypothesis. A static batch's member short of memory swaps others out; once the rest
    of the batch finished, nothing ran and no new batch could start while they were out, and
    nothing brought them back: a livelock. They are swapped back in (rank order, as memory allows)."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, long_prefill_token_threshold=0,
                          preemption_mode="swap", admission_policy="optimistic", scheduling_policy="static",
                          min_resident_steps=0)
    arrivals = [Arrival(0, make_request(f"r{i}", [1 + i] * p, m, ignore_eos=True, seed=i))
                for i, (p, m) in enumerate([(10, 13), (5, 9), (8, 12), (3, 6), (5, 9)])]
    sim = drive(cfg, 12, 1, 64, False, arrivals, windows=(3,))   # every plan checked; bounded steps
    s = sim.sched.stats
    assert s.num_finished == 5 and s.num_swaps_out >= 1 and s.num_swaps_in == s.num_swaps_out


def test_abort_in_every_state_frees_everything():
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, preemption_mode="swap",
                          admission_policy="optimistic", min_resident_steps=0)
    sim = Sim(cfg, num_blocks=8, block_size=2, num_host_blocks=16)
    for i in range(6):
        sim.add(make_request(f"r{i}", [1 + i] * 5, 11, ignore_eos=True, seed=i))   # 16 tokens fill the cache
    seen = set()
    for _ in range(200):
        if not sim.sched.has_unfinished():
            break
        sim.step()
        for rid, r in sim.all.items():
            if not r.is_finished and r.status not in seen:
                seen.add(r.status)
                sim.abort(rid)
                sim.check_state()
    assert {RequestStatus.RUNNING, RequestStatus.WAITING} <= seen
    sim.run(1000)
    sim.check_idle()


def test_abort_mid_step_skips_update():
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    sim = Sim(cfg, num_blocks=16, block_size=4)
    a = sim.add(make_request("a", [1, 2, 3], 10, ignore_eos=True))
    sim.add(make_request("b", [4, 5, 6], 10, ignore_eos=True))
    sim.step()
    n = a.num_output_tokens
    sim.step(abort_mid=["a"])
    assert a.num_output_tokens == n and a.status == RequestStatus.FINISHED_ABORTED
    sim.run(100)
    sim.check_outputs()


def test_idle_engine_holds_no_blocks_after_prefix_sharing_and_swaps():
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, preemption_mode="swap",
                          admission_policy="optimistic", min_resident_steps=0)
    sim = Sim(cfg, num_blocks=12, block_size=4, num_host_blocks=8)
    for i in range(8):
        sim.add(make_request(f"r{i}", PREFIXES[0][:13], 16, ignore_eos=True, seed=i))
    sim.run(2000)
    sim.check_outputs()
    st_ = sim.core.engine_stats()
    assert st_.prefix_cache_hits > 0
    assert st_.num_preemptions > 0
    assert st_.num_free_kv_blocks == st_.num_kv_blocks


def test_static_policy_runs_one_batch_at_a_time():
    cfg = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, scheduling_policy="static")
    sim = Sim(cfg, num_blocks=64, block_size=4)
    for i in range(7):
        sim.add(make_request(f"r{i}", [1 + i] * 4, 12, out_len=2 + 3 * i, seed=i))
    sim.run(500)
    sim.check_outputs()
    batch: set[str] = set()
    for entry in sim.log:
        if entry.admitted:
            # admissions happen only into an empty engine
            assert all(sim.all[r].is_finished for r in batch)
            assert not (set(entry.scheduled) - entry.admitted)
            batch = set(entry.admitted)
        else:
            assert set(entry.scheduled) <= batch


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_request_larger_than_the_cache_is_reported(mode):
    """A lone request whose prompt + max_tokens cannot fit in the whole cache must still end
    (rejected up front, or finished by length when it runs out of room), not loop forever."""
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, preemption_mode=mode)
    sim = Sim(cfg, num_blocks=4, block_size=2, num_host_blocks=8)
    big = sim.add(make_request("big", [1, 2, 3], 20, ignore_eos=True))
    sim.run(200)
    # it ran until the whole cache (8 tokens) was full, was never preempted, and ended by length
    assert big.status == RequestStatus.FINISHED_LENGTH and big.num_tokens == 8
    assert big.metrics.num_preemptions == 0 and big.output_token_ids == expected_output(big)
    with pytest.raises(ValueError, match="KV blocks"):   # a prompt that alone exceeds the cache: refused
        sim.add(make_request("huge", list(range(1, 10)), 1))
    sim.check_idle()
