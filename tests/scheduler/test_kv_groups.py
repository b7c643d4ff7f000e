"""Layer groups with sliding windows in the KV manager (conveyor/kv/layout.py), by property.

A state machine drives a KVCacheManager whose layout has local groups (windows of 2-6 tokens)
beside global ones, or local ones only (Mistral), through admissions with prefix-cache hits,
chunks, swap out/in and frees. It keeps a shadow of what every slot of every block holds (which
group wrote it, for which token sequence) and checks after every operation that:
- every position a request's next query can see, in every group, is in a block it owns and
  holds that group's K/V of the request's own tokens (a hit on the wrong block, a block given
  back too early, a wrong swap mapping are caught by content);
- a request holds exactly the blocks `KVLayout.blocks_for` counts (what admission and
  preemption plan with): global groups all, local groups only their window's;
- ref counts and null entries add up (`check_invariants`).
"""

from __future__ import annotations

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, multiple, rule

from conveyor.kv.layout import KVLayout, cdiv
from conveyor.kv.manager import KVCacheManager
from conveyor.model.config import FULL, SLIDING, ModelConfig
from conveyor.request import Request, RequestStatus
from conveyor.sampling.params import SamplingParams
from test_scheduler_props import Sim, make_request, windows_layout

PREFIXES = [[1 + (i * 5 + j * 3) % 7 for j in range(24)] for i in range(3)]
LAYOUTS = [(4,), (0, 3), (0, 5, 5), (2, 0, 2, 2), (6, 0, 0)]


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8, temperature=0))


class GroupedKV(RuleBasedStateMachine):
    requests = Bundle("requests")

    @initialize(windows=st.sampled_from(LAYOUTS), block_size=st.sampled_from([1, 2, 4]),
                num_blocks=st.integers(4, 40), num_host=st.integers(0, 12), caching=st.booleans())
    def setup(self, windows, block_size, num_blocks, num_host, caching):
        self.layout = windows_layout(windows)
        self.kv = KVCacheManager(num_blocks, block_size, num_host, caching, self.layout)
        self.bs, self.G = block_size, len(windows)
        # slot contents: (group, the token sequence up to and including this position)
        self.device = [[None] * block_size for _ in range(num_blocks)]
        self.host = [[None] * block_size for _ in range(num_host)]
        self.reqs: dict[str, Request] = {}
        self.swapped: set[str] = set()
        self.n = 0

    def _compute(self, req: Request, n: int) -> bool:
        """Allocate and 'run' the next n tokens: write their K/V in every group, then publish and
        slide as the scheduler does after a step."""
        kv, rid, bs = self.kv, req.request_id, self.bs
        if not kv.allocate(req, n):
            event("allocation refused")
            return False
        table = kv.block_table(rid)
        for p in range(req.num_computed_tokens, req.num_computed_tokens + n):
            for g in range(self.G):
                block = table[(p // bs) * self.G + g]
                assert block != kv.null_block, "a position being computed has no block"
                self.device[block][p % bs] = (g, tuple(req.all_token_ids[:p + 1]))
        req.num_computed_tokens += n
        kv.publish_full_blocks(req)
        kv.slide(req)
        return True

    @rule(target=requests, prefix=st.integers(0, len(PREFIXES) - 1), shared=st.integers(0, 24),
          suffix=st.lists(st.integers(1, 7), max_size=8), chunk=st.integers(1, 12))
    def admit(self, prefix, shared, suffix, chunk):
        tokens = PREFIXES[prefix][:shared] + suffix or [1]
        rid = f"r{self.n}"
        self.n += 1
        req = _request(rid, tokens)
        kv = self.kv
        hit = kv.find_cached_prefix(req)
        assert hit.num_blocks * self.bs <= req.num_tokens - 1 and len(hit) == hit.num_blocks * self.G
        if not kv.enable_prefix_caching:
            assert hit.num_blocks == 0
        if hit.num_blocks:
            event("prefix hit")
            if hit.pages < len(hit):
                event("prefix hit without the blocks before a window")
        req.num_computed_tokens = hit.num_blocks * self.bs
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        free = kv.num_free_blocks
        if not kv.allocate(req, 0, hit):
            assert kv.num_free_blocks == free
            return multiple()
        kv.record_prefix_lookup(req, hit)
        self.reqs[rid] = req
        self._compute(req, n)   # (if it does not fit, it stays admitted with its hit)
        return rid

    @rule(rid=requests, n=st.integers(1, 6))
    def compute(self, rid, n):
        req = self.reqs.get(rid)
        if req is None or rid in self.swapped:
            return
        left = req.num_tokens - req.num_computed_tokens
        if left == 0:   # decode: one more token
            req.append_token(1 + len(req.all_token_ids) % 5, 0.0)
            left = 1
        self._compute(req, min(n, left))

    @rule(rid=requests)
    def swap_out(self, rid):
        req, kv = self.reqs.get(rid), self.kv
        if req is None or rid in self.swapped or not kv.can_swap_out(req):
            return
        for dev, host in kv.swap_out(req):
            self.host[host] = list(self.device[dev])
        self.swapped.add(rid)
        event("swapped out")

    @rule(rid=requests)
    def swap_in(self, rid):
        req, kv = self.reqs.get(rid), self.kv
        if req is None or rid not in self.swapped or not kv.can_swap_in(req):
            return
        for host, dev in kv.swap_in(req):
            self.device[dev] = list(self.host[host])
        kv.end_step()
        self.swapped.discard(rid)

    @rule(rid=consumes(requests))
    def finish(self, rid):
        req = self.reqs.pop(rid, None)
        if req is None:
            return
        self.kv.free(req)
        self.kv.forget(req)
        self.swapped.discard(rid)

    @invariant()
    def consistent(self):
        if not hasattr(self, "kv"):
            return
        kv, bs, G = self.kv, self.bs, self.G
        kv.check_invariants(set(self.reqs))
        for rid, req in self.reqs.items():
            if rid in self.swapped:
                continue
            table = kv.tables.get(rid, [])
            c = req.num_computed_tokens
            assert len(table) == cdiv(c, bs) * G or not table
            if table:
                assert kv.num_held(rid) == self.layout.blocks_for(c, bs, c), "held blocks differ from the plan's count"
            for g, w in enumerate(self.layout.windows):
                for p in range(max(0, c - w + 1) if w else 0, c):   # what the next query can see
                    block = table[(p // bs) * G + g]
                    assert block != kv.null_block and kv.pool.blocks[block].ref_count > 0
                    assert self.device[block][p % bs] == (g, tuple(req.all_token_ids[:p + 1])), \
                        f"{rid} group {g} position {p}: wrong K/V"


TestGroupedKV = GroupedKV.TestCase
TestGroupedKV.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_layout_from_config_groups_layers_by_window():
    """Gemma 3's 5:1 pattern gives groups of the global layers' count; uneven counts pad; one
    kind gives one group (the classic layout when nothing is windowed)."""
    def cfg(types, window=512):
        return ModelConfig("gemma3_text", 256, 64, 128, len(types), 4, 1, 16, sliding_window=window,
                           layer_types=tuple(types))

    gemma = KVLayout.from_config(cfg([SLIDING] * 5 + [FULL] + [SLIDING] * 5 + [FULL] + [SLIDING] * 5 + [FULL]))
    assert gemma.slots == 3 and gemma.windows == (0,) + (512,) * 5
    assert [gemma.layer_group[i] for i in (5, 11, 17)] == [0, 0, 0]
    assert sorted(zip(gemma.layer_group, gemma.layer_slot)) == sorted({(g, s) for g in range(6) for s in range(3)})
    odd = KVLayout.from_config(cfg([SLIDING, SLIDING, FULL, SLIDING, SLIDING, SLIDING, FULL]))
    assert odd.slots == 2 and odd.windows == (0, 512, 512, 512)   # five local layers in three groups of two
    assert KVLayout.from_config(cfg([SLIDING] * 4)) == KVLayout.single(4, 512)
    assert KVLayout.from_config(cfg([FULL] * 4)).trivial
    # 4k tokens, blocks of 16: a global group holds 256 blocks, a local one 33 (a 512 window)
    assert gemma.blocks_for(4096, 16) == 256 + 5 * 33
    assert gemma.max_tokens(256 + 5 * 33, 16) == 4096


def test_a_window_larger_than_the_cache_caps_the_length():
    """Every layer windowed, but a window's blocks do not fit the cache: the length is capped where
    the cache is full (the request ends with 'length'), rather than preempting itself forever."""
    from conveyor.scheduler.config import SchedulerConfig

    assert KVLayout.single(2, 64).max_tokens(4, 8) == 32
    assert KVLayout.single(2, 8).max_tokens(4, 8) == 1 << 62   # a window's 2 blocks fit: no cap
    for mode in ("swap", "recompute"):
        sim = Sim(SchedulerConfig(preemption_mode=mode), num_blocks=4, block_size=8, num_host_blocks=8,
                  windows=(64,))
        req = sim.add(make_request("r", list(range(1, 11)), 40, ignore_eos=True))
        sim.run(200)
        assert req.status == RequestStatus.FINISHED_LENGTH and req.num_tokens == 32, mode
        assert sim.sched.stats.num_preemptions == 0


def test_lifetime_counts_a_prefill_chunk_in_local_groups():
    """While prompt chunks remain, a local group holds a chunk's blocks beyond its window: the
    lifetime footprint admission plans with covers what the chunks really hold."""
    lay, bs, chunk = windows_layout((0, 512)), 16, 2048
    held = max(lay.blocks_for(min(c + chunk, 4000), bs, c) for c in range(0, 4000, chunk))
    assert lay.blocks_for(4000, bs) < held <= lay.blocks_for(4000, bs, chunk=chunk)
