"""The scheduler's promises under adversarial traffic (issue 16), on the real EngineCore +
Scheduler + KVCacheManager with the fake executor of test_scheduler_props:

- a preempted request (swap or recompute) keeps its place by (priority, arrival): nobody
  ranked below it gets the memory, the slot or the budget it waits for, and it comes back;
- preemption, at any point of a prompt, leaves every per-request result unchanged;
- a request is never preempted in favour of worse-priority work;
- priority preemption counts only the blocks it really frees;
- the token budget goes by priority after the decodes;
- predictive admission forgets an old workload;
- auto preemption decides per victim from what each option costs it.

Each regression test below failed on the scheduler before this change.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.kv.manager import KVCacheManager
from conveyor.request import RequestStatus
from conveyor.sampling.params import SamplingParams
from conveyor.sampling.structured import GrammarBackend
from conveyor.scheduler.admission import OutputLengthProfile, PredictiveAdmission
from conveyor.scheduler.config import SchedulerConfig
from conveyor.scheduler.preemption import PreemptionCosts, victim_cost
from test_scheduler_props import EOS, PREFIXES, OracleRequest, Sim, make_request


def scheduled(out) -> set[str]:
    return {s.request_id for s in out.scheduled}


# ---- 1. a swapped request keeps its place ------------------------------------------------------

def test_swapped_request_is_not_starved_by_a_stream_of_lower_priority_work():
    """A priority-1 request swapped out for a priority-0 one came back only if its whole footprint
    happened to be free, while a stream of priority-2 requests kept taking the memory: after 400
    steps it was still swapped. Now it is queued by (priority, arrival) like a recompute victim."""
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, preemption_mode="swap",
                          admission_policy="optimistic", min_resident_steps=1)
    sim = Sim(cfg, 16, 4, num_host_blocks=32)
    mid = sim.add(make_request("mid", [1] * 24, 40, ignore_eos=True, priority=1))
    for _ in range(8):
        sim.step()
    high = sim.add(make_request("high", [2] * 20, 12, ignore_eos=True, priority=0))
    swapped_at = None
    for t in range(400):
        sim.add(make_request(f"low{t}", [3 + t % 40] * 3, 3, ignore_eos=True, priority=2, seed=t))
        sim.step()
        if swapped_at is None and mid.status == RequestStatus.SWAPPED:
            swapped_at = sim.sched.step
        if mid.is_finished:
            break
    assert swapped_at is not None, "the scenario must swap the priority-1 request out"
    assert high.is_finished and mid.is_finished, f"mid still {mid.status} after 400 steps"
    # while mid was queued, no lower-ranked request was admitted
    back = next(e.step for e in sim.log if e.step > swapped_at and "mid" in e.scheduled)
    for e in sim.log:
        if swapped_at < e.step < back:
            assert not {r for r in e.admitted if sim.all[r].priority == 2}, e
    sim.run(2000)
    sim.check_outputs()


def test_a_swapped_request_triggers_priority_preemption():
    """A swapped priority-0 request at the head of the queue preempts running priority-1 work."""
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, preemption_mode="swap",
                          admission_policy="optimistic", min_resident_steps=0)
    sim = Sim(cfg, 64, 4, num_host_blocks=64)
    a = sim.add(make_request("A", [1] * 4, 30, ignore_eos=True, priority=0))
    sim.add(make_request("B", [2] * 4, 30, ignore_eos=True, priority=0))
    sim.step()
    sim.add(make_request("X", [3] * 4, 3, ignore_eos=True, priority=-1))   # pushes B (latest) out
    sim.step()
    b = sim.all["B"]
    assert b.status == RequestStatus.SWAPPED
    low = sim.add(make_request("L", [4] * 4, 30, ignore_eos=True, priority=1))
    while not sim.all["X"].is_finished:
        sim.step()
    # B (priority 0, swapped) comes back before L (priority 1, waiting); if L ran, B takes its place
    out = sim.step()
    assert "B" in scheduled(out)
    sim.run(500)
    sim.check_outputs()
    assert b.metrics.finished_time <= low.metrics.finished_time and a.is_finished


# ---- 2. preemption leaves per-request results unchanged -----------------------------------------

def _pooling_request(rid: str, prompt: list[int], *, pooling: str | None = None, prompt_logprobs: int | None = None,
                     max_tokens: int = 1, priority: int = 0, seed: int = 0) -> OracleRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0, pooling=pooling,
                            prompt_logprobs=prompt_logprobs)
    params.eos_token_ids = (EOS,)
    return OracleRequest(rid, list(prompt), params, seed=seed, priority=priority)


def _expected_pooled(prompt: list[int], pooling: str) -> float:
    if pooling == "mean":
        return float(sum(t * (p + 1) for p, t in enumerate(prompt)))
    return float(prompt[-1] * len(prompt))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("kind", ["mean", "last", "prompt_logprobs"])
def test_preemption_mid_prompt_keeps_embeddings_and_prompt_logprobs(mode, kind):
    """A long prompt computed in chunks is preempted in the middle by a better-priority request
    (recompute: it starts over). Its pooled sum and prompt logprobs must equal an unpreempted
    run's (recompute used to double-count the mean pool, and to lose prompt-logprob entries:
    28 of 40 here)."""
    prompt = [1 + (7 * i) % 40 for i in range(40)]
    kw = {"pooling": kind} if kind != "prompt_logprobs" else {"prompt_logprobs": 1, "max_tokens": 3}
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, long_prefill_token_threshold=8,
                          preemption_mode=mode, admission_policy="optimistic", min_resident_steps=0)
    sim = Sim(cfg, 14, 4, num_host_blocks=32, prefix_caching=False)
    # a decode beside it takes one token of each step's budget, so R's chunks after a restart
    # do not fall where they fell before
    sim.add(make_request("D", [3, 4], 40, ignore_eos=True, priority=0))
    req = sim.add(_pooling_request("R", prompt, priority=1, **kw))
    for _ in range(4):                                  # 27 of its 40 prompt tokens computed
        sim.step()
    assert 0 < req.num_computed_tokens < len(prompt)
    sim.add(make_request("H", [5] * 30, 6, ignore_eos=True, priority=0))   # needs the memory R holds
    sim.run(500)
    sim.check_outputs()
    assert req.metrics.num_preemptions >= 1, "the scenario must preempt R mid-prompt"
    if kind == "prompt_logprobs":
        assert req.prompt_logprobs == [None] + [{prompt[p]: -float(p)} for p in range(1, len(prompt))]
    else:
        assert sim.embeddings["R"] == [_expected_pooled(prompt, kind)]


# ---- 3. never preempted in favour of worse-priority work -----------------------------------------

@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_high_priority_never_preempts_itself_for_freshly_admitted_low_priority(mode):
    """The residency rule used to leave no eligible victim when the only lower-priority request
    had been admitted one step earlier, so the high-priority one preempted itself."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, preemption_mode=mode,
                          admission_policy="optimistic", min_resident_steps=10, reservation_buffer=0.0)
    sim = Sim(cfg, 7, 4, num_host_blocks=32, prefix_caching=False)
    high = sim.add(make_request("H", [1] * 16, 20, ignore_eos=True, priority=0))
    sim.step()
    sim.add(make_request("L", [2] * 5, 20, ignore_eos=True, priority=1))
    sim.step()                       # L admitted now and the cache is full; both need a block at
    assert sim.all["L"].status == RequestStatus.RUNNING and sim.kv.num_free_blocks == 0   # step 6
    while not high.is_finished:
        sim.step()
    assert high.metrics.num_preemptions == 0
    assert sim.all["L"].metrics.num_preemptions >= 1
    sim.run(500)
    sim.check_outputs()


# ---- 4. priority preemption counts what it really frees ----------------------------------------

def test_priority_preemption_counts_only_blocks_really_freed():
    """Two low-priority requests share a long prefix. Preempting the later one alone frees only
    its own tail; it used to be preempted for a high-priority request that then still did not
    fit. Now victims are taken until the blocks really freed suffice, or nobody is preempted."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, admission_policy="optimistic",
                          min_resident_steps=0)
    sim = Sim(cfg, 16, 4)
    shared = PREFIXES[0][:40]
    sim.add(make_request("L1", shared + [7], 8, ignore_eos=True, priority=1))
    sim.step()
    sim.add(make_request("L2", shared + [9], 8, ignore_eos=True, priority=1))
    sim.step()
    assert sim.kv.num_free_blocks == 4 and sim.kv.num_unshared("L2") == 1
    h = sim.add(make_request("H", [3] * 24, 2, ignore_eos=True, priority=0))   # 6 blocks
    out = sim.step()
    assert sim.sched.stats.num_priority_preemptions, "preempting both low-priority requests makes room"
    assert "H" in scheduled(out), "victims preempted, yet the head did not come in"
    sim.run(500)
    sim.check_outputs()
    assert h.is_finished


# ---- 5. the token budget goes by priority ---------------------------------------------------------

def test_high_priority_arrival_gets_budget_before_low_priority_prefill_chunks():
    """Running low-priority prefills used to take the whole budget before any admission: a
    priority-0 request with an 8-token prompt waited 25 steps while memory and slots were free."""
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=64,
                          admission_policy="optimistic")
    sim = Sim(cfg, 512, 4, prefix_caching=False)
    for i in range(3):
        sim.add(make_request(f"L{i}", [1 + i] * 400, 4, ignore_eos=True, priority=1, seed=i))
    sim.step()
    sim.step()
    high = sim.add(make_request("H", [9] * 8, 4, ignore_eos=True, priority=0))
    out = sim.step()
    assert "H" in scheduled(out) and high.status == RequestStatus.RUNNING
    sim.run(500)
    sim.check_outputs()


def test_decodes_are_scheduled_before_better_ranked_prefills():
    """Priority orders the budget after the decodes: a running decode is never starved."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4, long_prefill_token_threshold=4,
                          admission_policy="optimistic")
    sim = Sim(cfg, 64, 4)
    low = sim.add(make_request("L", [1] * 2, 30, ignore_eos=True, priority=1))
    sim.step()
    sim.add(make_request("H", [2] * 40, 2, ignore_eos=True, priority=0))
    for _ in range(5):
        out = sim.step()
        assert "L" in scheduled(out) and "H" in scheduled(out)
    sim.run(500)
    sim.check_outputs()
    assert low.is_finished


# ---- 6. predictive admission forgets ---------------------------------------------------------------

def test_profile_adapts_to_a_shift_in_output_lengths():
    """After 10,000 short outputs, how many long ones until the 0.9 quantile moves? With a
    half-life of h observations the old mass weighs (d^k) after k new ones (d = 2^(-1/h)), so the
    quantile moves once d^k < 0.9: k = ceil(log(0.9) / log(d)) = 39 for h = 256 (it was 1,108
    before, when nothing was forgotten)."""
    for half_life, bound in ((256.0, 40), (0.0, 1200)):
        p = OutputLengthProfile(half_life=half_life)
        for _ in range(10_000):
            p.observe(8)
        k = 0
        while p.quantile(0.9) < 300:
            p.observe(300)
            k += 1
        assert k <= bound, (half_life, k)
        if half_life:
            assert k >= 30   # not a jump on the first long output either
    assert k > 1000   # the undecayed profile needs over a thousand


def test_cold_start_prior_predicts_its_documented_length():
    p = OutputLengthProfile()            # prior: 4 pseudo-observations at 512
    assert p.quantile(0.5) == 512 and p.quantile(0.9) == 512
    adm = PredictiveAdmission(0.9, 0.0)
    req = make_request("r", [1] * 10, 10_000)
    assert adm.predicted_total(req) == 10 + 512


def test_predictive_admission_stops_preempting_after_a_workload_shift():
    """An engine that learned short outputs meets long ones: once it has seen a few dozen long
    outputs it admits as carefully as a fresh engine (no preemptions in the later half)."""
    def run(warm: bool) -> list[int]:
        cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, admission_quantile=0.9,
                              reservation_buffer=0.0, preemption_mode="recompute")
        adm = PredictiveAdmission(0.9, 0.0)
        if warm:
            for _ in range(10_000):
                adm.observe(SimpleNamespace(num_output_tokens=4, params=SimpleNamespace(pooling=None)))
        sim = Sim(cfg, 64, 4, admission=adm, check=False)
        for i in range(160):
            sim.add(make_request(f"r{i}", [1 + i % 40] * 4, 60, out_len=60, seed=i))
        sim.run(20_000)
        sim.check_outputs()
        return [sim.all[f"r{i}"].metrics.num_preemptions for i in range(160)]

    fresh, warmed = run(False), run(True)
    assert sum(fresh[80:]) == 0
    assert sum(warmed[80:]) == 0, warmed


# ---- 7. auto decides per victim ------------------------------------------------------------------

def _victim(kv: KVCacheManager, rid: str, prompt: list[int]) -> OracleRequest:
    req = make_request(rid, prompt, 8)
    cached = kv.find_cached_prefix(req)
    req.num_computed_tokens = len(cached) * kv.block_size
    assert kv.allocate(req, req.num_tokens - req.num_computed_tokens, cached)
    req.num_computed_tokens = req.num_tokens
    kv.publish_full_blocks(req)
    return req


def test_auto_chooses_per_victim_from_what_each_option_costs():
    """Recompute costs the tokens not covered by blocks others still hold; swap copies only the
    blocks nobody else holds. With a cost model where a short recomputation is cheap and a long
    one expensive (attention grows with the context), the choice differs between victims."""
    kv = KVCacheManager(64, 4, num_host_blocks=64)
    costs = PreemptionCosts(swap_block=1.0, recompute_time=lambda n: 0.1 * n * n)   # quadratic
    owner = _victim(kv, "owner", PREFIXES[0][:40])
    sharer = _victim(kv, "sharer", PREFIXES[0][:40] + [5, 6])     # 10 of its 11 blocks shared
    loner = _victim(kv, "loner", PREFIXES[1][:44])                # nothing shared
    assert owner.num_tokens == 40
    s, l_ = victim_cost("auto", sharer, kv, costs), victim_cost("auto", loner, kv, costs)
    assert (s.mode, s.freed, s.recomputed) == ("recompute", 1, 2)
    assert (l_.mode, l_.freed, l_.copied) == ("swap", 11, 11)
    # no room on the host: recompute, whatever it costs
    small = KVCacheManager(64, 4, num_host_blocks=4)
    big = _victim(small, "big", PREFIXES[1][:44])
    assert victim_cost("auto", big, small, costs).mode == "recompute"
    assert victim_cost("swap", big, small, costs).mode == "recompute"


def test_swap_copies_only_unshared_blocks():
    """A victim sharing most of its blocks copies only its own to the host (it used to copy
    all 15 to free 3); the shared ones stay on the device and it gets them back on swap-in."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, preemption_mode="swap",
                          admission_policy="optimistic", min_resident_steps=0, reservation_buffer=0.0)
    sim = Sim(cfg, 24, 4, num_host_blocks=32)
    prefix = PREFIXES[0][:48]                                      # 12 shared blocks
    sim.add(make_request("A", prefix + [1] * 10, 4, ignore_eos=True, priority=1))
    sim.step()
    b = sim.add(make_request("B", prefix + [2] * 10, 4, ignore_eos=True, priority=1))
    sim.step()
    assert sim.kv.num_held("B") == 15 and sim.kv.num_unshared("B") == 3
    sim.add(make_request("H", [3] * 28, 8, ignore_eos=True, priority=0))   # 7 blocks, 6 free
    sim.step()
    assert sim.log[-1].swapped_out == {"B"}
    assert sim.sched.stats.blocks_swapped_out == 3 and sim.kv.num_pinned("B") == 12
    sim.run(500)
    sim.check_outputs()
    assert b.is_finished


def test_user_set_costs_win_over_the_profile():
    from conveyor.sim.cost import StepCostModel, with_preemption_costs

    model = StepCostModel(swap_block=0.5)
    assert with_preemption_costs(SchedulerConfig(swap_cost_per_block=3e-4), model).swap_cost_per_block == 3e-4
    assert with_preemption_costs(SchedulerConfig(), model).swap_cost_per_block == 0.5


# ---- properties over random adversarial workloads -------------------------------------------------

@st.composite
def adversarial(draw):
    block_size = draw(st.sampled_from([2, 4]))
    num_blocks = draw(st.integers(10, 24))
    cfg = SchedulerConfig(
        max_num_seqs=draw(st.integers(2, 6)), max_num_batched_tokens=draw(st.sampled_from([4, 8, 16, 32])),
        long_prefill_token_threshold=draw(st.sampled_from([0, 4, 8])),
        preemption_mode=draw(st.sampled_from(["recompute", "swap", "auto"])),
        admission_policy=draw(st.sampled_from(["optimistic", "predictive"])),
        min_resident_steps=draw(st.integers(0, 4)), swap_cost_per_block=draw(st.sampled_from([1e-4, 1e-2])))
    num_host = draw(st.sampled_from([0, 3, 8, 64]))
    capacity = num_blocks * block_size
    reqs = []
    for i in range(draw(st.integers(2, 10))):
        plen = draw(st.integers(1, min(30, capacity // 2)))
        shared = draw(st.integers(0, plen))
        prompt = PREFIXES[draw(st.integers(0, 2))][:shared] + [draw(st.integers(1, 49)) for _ in range(plen - shared)]
        kind = draw(st.sampled_from(["gen", "gen", "gen", "mean", "prompt_logprobs"]))
        max_tokens = draw(st.integers(1, min(24, capacity - plen)))
        priority = draw(st.integers(0, 2))
        step = draw(st.integers(0, 10))
        abort = draw(st.one_of(st.none(), st.none(), st.none(), st.integers(step, step + 30)))
        reqs.append((step, i, prompt, kind, max_tokens, priority, abort))
    return cfg, num_blocks, block_size, num_host, reqs


def _build(i, prompt, kind, max_tokens, priority):
    if kind == "gen":
        return make_request(f"r{i}", prompt, max_tokens, ignore_eos=True, priority=priority, seed=i)
    if kind == "mean":
        return _pooling_request(f"r{i}", prompt, pooling="mean", priority=priority, seed=i)
    return _pooling_request(f"r{i}", prompt, prompt_logprobs=1, max_tokens=max_tokens, priority=priority, seed=i)


def _check_no_lower_ranked_overtaking(sim: Sim) -> None:
    """After a step, a queued request that did not come in was not passed over in favour of a
    worse-priority one: nobody of worse priority was admitted in this step, and no worse-priority
    prefill chunk ran while it waited with the budget being the only thing missing."""
    entry = sim.log[-1]
    queued = [r for r in sim.sched.requests.values()
              if r.status in (RequestStatus.WAITING, RequestStatus.SWAPPED) and r.preempted_step != entry.step
              and not sim.sched._waits_for_leader(r)]
    if not queued:
        return
    best = min(queued, key=lambda r: (r.priority, r.arrival_seq))
    for rid in entry.admitted:
        assert sim.all[rid].priority <= best.priority, f"{rid} admitted over the better-ranked {best.request_id}"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(adversarial())
def test_every_request_finishes_in_bound_and_results_equal_an_unpreempted_run(scenario):
    """Under any of these workloads every request finishes within a derived bound, nobody of worse
    priority is admitted while a better one waits, and per-request results (tokens, pooled sums,
    prompt logprobs) equal those of the same request run alone with ample memory.

    The bound: the best-ranked live request is never a victim (victims rank below whoever
    preempts them), so it runs to completion in at most (its tokens + 1) steps once it is
    admitted; it is admitted once the requests of better rank have finished. So the queue
    drains within sum over requests of (prompt + max_tokens + 2) steps after the last
    arrival (each token of each request needs a step, plus admission and a preemption step),
    which we allow twice over."""
    cfg, num_blocks, block_size, num_host, reqs = scenario
    sim = Sim(cfg, num_blocks, block_size, num_host)
    pending = sorted(reqs)
    aborts = {f"r{i}": abort for _, i, *_rest, abort in reqs if abort is not None}
    bound = max(r[0] for r in reqs) + 2 * sum(len(r[2]) + r[4] + 2 for r in reqs)
    t = 0
    while pending or sim.sched.has_unfinished():
        assert t <= bound, f"not done after {bound} steps: {sim.core.engine_stats()}"
        while pending and pending[0][0] <= t:
            _, i, prompt, kind, max_tokens, priority, _ = pending.pop(0)
            sim.add(_build(i, prompt, kind, max_tokens, priority))
        for rid, at in list(aborts.items()):
            if at == t and rid in sim.sched.requests:
                sim.abort(rid)
        sim.step()
        _check_no_lower_ranked_overtaking(sim)
        t += 1
    sim.check_idle()
    sim.check_outputs()
    for _, i, prompt, kind, max_tokens, priority, _ in reqs:
        req = sim.all[f"r{i}"]
        if req.status != RequestStatus.FINISHED_STOPPED and req.status != RequestStatus.FINISHED_LENGTH:
            continue
        alone = Sim(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64), 64, block_size)
        ref = alone.add(_build(i, prompt, kind, max_tokens, priority))
        alone.run(500)
        assert req.output_token_ids == ref.output_token_ids
        assert req.prompt_logprobs == ref.prompt_logprobs
        if kind == "mean":
            assert sim.embeddings[req.request_id] == alone.embeddings[ref.request_id]


# ---- found in review --------------------------------------------------------------------------------

def test_victims_sharing_blocks_in_mixed_modes_never_kill_the_engine():
    """Two victims share a prompt; under auto with a tiny host pool one is swapped and one
    recomputed. The room they make depends on their order (a swapped one keeps the shared
    blocks): counted in one order and preempted in another, the scheduler used to raise and the
    core died, failing every request."""
    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, long_prefill_token_threshold=32,
                          preemption_mode="auto", admission_policy="optimistic", min_resident_steps=2,
                          reservation_buffer=0.0, swap_cost_per_block=2e-4)
    sim = Sim(cfg, 59, 4, num_host_blocks=2)
    shared = PREFIXES[1][:34]
    plan = {1: [make_request(f"G{k}", [7 + k] * 10, 60, ignore_eos=True, seed=10 + k) for k in range(5)],
            2: [make_request("N1", [31] * 48, 5, ignore_eos=True, seed=21)],
            4: [make_request("N3", [33] * 60, 6, ignore_eos=True, seed=23)],
            5: [make_request("V1", shared, 13, ignore_eos=True, priority=1, seed=1)],
            8: [make_request("V2", shared, 16, ignore_eos=True, priority=1, seed=2)],
            9: [make_request("N2", [32] * 88, 5, ignore_eos=True, seed=22)],
            13: [make_request("N0", [30] * 29, 8, ignore_eos=True, seed=20)]}
    for t in range(1, 40):
        for r in plan.get(t - 1, []):
            sim.add(r)
        sim.step()
        assert not sim.core.dead, sim.core.dead_reason
    sim.run(2000)
    sim.check_outputs()
    assert all(r.status != RequestStatus.FINISHED_ERROR for r in sim.all.values())


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_priority_preemption_does_not_count_the_heads_own_prefix_hits_as_room(mode):
    """The only low-priority request holds the high-priority head's prefix. Preempting it puts
    those blocks in the free queue, but the head must take them back: no room gained. It used to
    be preempted anyway, and the head still did not fit."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, admission_policy="optimistic",
                          preemption_mode=mode, min_resident_steps=0, reservation_buffer=0.0)
    sim = Sim(cfg, 10, 4, num_host_blocks=32)
    prefix = list(range(1, 17))
    low = sim.add(make_request("V", prefix, 20, ignore_eos=True, priority=1))
    sim.add(make_request("F", [40] * 12, 30, ignore_eos=True, priority=0))
    sim.step()
    sim.step()
    sim.add(make_request("H", prefix + [45] * 12, 4, ignore_eos=True, priority=0))
    sim.step()
    assert sim.sched.stats.num_priority_preemptions == 0 and low.metrics.num_preemptions == 0
    sim.run(500)
    sim.check_outputs()


def test_the_best_ranked_request_never_steps_back_for_a_later_arrival():
    """Residency used to leave the first-come request no victim but itself when the only later
    arrival of its priority had just been admitted: it recomputed and waited for that one. Now a
    resident victim of its own priority is taken when nothing else makes room."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, admission_policy="optimistic",
                          preemption_mode="recompute", min_resident_steps=4, reservation_buffer=0.0)
    sim = Sim(cfg, 6, 4, prefix_caching=False)
    first = sim.add(make_request("R", [1] * 7, 20, ignore_eos=True))
    sim.step()
    later = sim.add(make_request("X", [2] * 16, 20, ignore_eos=True))
    sim.run(500)
    sim.check_outputs()
    assert first.metrics.num_preemptions == 0 and later.metrics.num_preemptions >= 1
    assert sim.sched.stats.residency_overrides >= 1


def test_a_failed_mask_step_still_copies_its_swap_outs():
    """A structured-output mask failure used to return before the step's swap copies ran, so a
    request swapped out in that step came back with garbage KV."""

    class FailingGrammars(GrammarBackend):   # the real step logic, a failing mask fill
        fail = False

        def __init__(self):
            pass

        def fill_bitmasks(self, matchers):
            if self.fail:
                raise RuntimeError("mask failure")

    class Matcher:
        def consume_token(self, token):
            return True

        def is_stopped(self):
            return False

    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, admission_policy="optimistic",
                          preemption_mode="swap", min_resident_steps=0, reservation_buffer=0.0)
    sim = Sim(cfg, 8, 4, num_host_blocks=16, prefix_caching=False)
    sim.core.grammars = grammars = FailingGrammars()
    victim = sim.add(make_request("V", [1] * 12, 20, ignore_eos=True, priority=1))
    for _ in range(3):
        sim.step()
    head = sim.add(make_request("H", [2] * 20, 3, ignore_eos=True, priority=0))
    head.grammar = Matcher()
    grammars.fail = True
    sim.step()
    grammars.fail = False
    assert sim.log[-1].swapped_out == {"V"} and head.status == RequestStatus.FINISHED_ERROR
    sim.run(100)   # the fake executor checks every position V attends to
    sim.check_outputs()
    assert victim.status == RequestStatus.FINISHED_LENGTH


def test_zero_costs_set_by_the_user_are_kept():
    from conveyor.scheduler.scheduler import Scheduler
    from conveyor.sim.cost import StepCostModel, preemption_costs

    cfg = SchedulerConfig(swap_cost_per_block=0.0, recompute_cost_per_token=0.0)
    assert (Scheduler(cfg, KVCacheManager(8, 4)).costs.swap(5), preemption_costs(cfg, StepCostModel()).swap(5)) == (0, 0)
    assert preemption_costs(cfg, StepCostModel()).recompute(100) == 0
