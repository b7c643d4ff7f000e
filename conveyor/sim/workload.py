"""Workloads for the simulator (and for replaying them on the real engine): arrivals, lengths,
shared prefixes, priorities — from distributions, or from a JSONL trace. No torch here.

Length distributions are written as strings: ``"32:256"`` / ``"uniform:32:256"`` (inclusive),
``"128"`` / ``"fixed:128"``, ``"lognormal:MEDIAN:SIGMA[:MAX]"``, ``"exp:MEAN[:MAX]"``.
Arrival processes: ``"poisson"``, ``"gamma:CV"`` (gaps with coefficient of variation CV; 1 is
Poisson, above 1 is burstier), ``"constant"``; a rate of ``inf`` puts every arrival at 0.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

TOKEN_RANGE = (1000, 30000)   # synthetic prompt token ids: ordinary words of a 32k+ vocabulary


@dataclass(slots=True)
class SimRequest:
    arrival: float                 # seconds after the start of the run
    prompt_len: int
    output_len: int                # true output length: the request ends after this many tokens
    max_tokens: int | None = None  # the client's cap (None: = output_len); the admission policies see it
    priority: int = 0
    prefix_group: int | None = None   # requests of one group share their first prefix_len prompt tokens
    prefix_len: int = 0
    tenant: str = ""               # who it is served for (fair scheduling)
    adapter: int = 0               # the LoRA adapter it runs under (1, 2, ...; 0: the base model)

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(f"prompt_len and output_len must be >= 1: {self}")
        self.prefix_len = min(self.prefix_len, self.prompt_len) if self.prefix_group is not None else 0

    @property
    def cap(self) -> int:
        return self.max_tokens if self.max_tokens is not None else self.output_len

    def prompt_token_ids(self, index: int, seed: int = 0, token_range: tuple[int, int] = TOKEN_RANGE) -> list[int]:
        """Deterministic prompt tokens: the group's shared prefix, then tokens of this request alone."""
        lo, hi = token_range
        ids: list[int] = []
        if self.prefix_group is not None:
            g = random.Random(f"prefix/{seed}/{self.prefix_group}")
            ids = [g.randint(lo, hi) for _ in range(self.prefix_len)]
        own = random.Random(f"prompt/{seed}/{index}")
        return ids + [own.randint(lo, hi) for _ in range(self.prompt_len - len(ids))]


# ---- distributions ---------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class LengthDist:
    kind: str
    a: float
    b: float = 0.0
    cap: int | None = None

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        parts = str(text).split(":")
        try:
            if parts[0].isdigit():
                parts = (["fixed"] if len(parts) == 1 else ["uniform"]) + parts
            kind, nums = parts[0], [float(p) for p in parts[1:]]
            if kind == "fixed" and len(nums) == 1:
                return cls.check(cls(kind, nums[0]))
            if kind == "uniform" and len(nums) == 2:
                return cls.check(cls(kind, nums[0], nums[1]))
            if kind == "lognormal" and len(nums) in (2, 3):
                return cls.check(cls(kind, nums[0], nums[1], int(nums[2]) if len(nums) == 3 else None))
            if kind == "exp" and len(nums) in (1, 2):
                return cls.check(cls(kind, nums[0], 0.0, int(nums[1]) if len(nums) == 2 else None))
        except ValueError:
            pass
        raise ValueError(f"bad length distribution {text!r}: use LO:HI, N, lognormal:MEDIAN:SIGMA[:MAX] "
                         "or exp:MEAN[:MAX]")

    @staticmethod
    def check(d: LengthDist) -> LengthDist:
        if d.a < 1 or (d.kind == "uniform" and d.b < d.a) or (d.cap is not None and d.cap < 1):
            raise ValueError(f"bad length distribution {d}")
        return d

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            n = self.a
        elif self.kind == "uniform":
            n = rng.randint(int(self.a), int(self.b))
        elif self.kind == "lognormal":
            n = math.exp(rng.gauss(math.log(self.a), self.b))
        else:
            n = rng.expovariate(1.0 / self.a)
        n = max(1, int(round(n)))
        return min(n, self.cap) if self.cap is not None else n

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        if self.kind == "uniform":
            return f"{int(self.a)}:{int(self.b)}"
        tail = f":{self.cap}" if self.cap is not None else ""
        return f"{self.kind}:{self.a:g}" + (f":{self.b:g}" if self.kind == "lognormal" else "") + tail


def arrival_times(n: int, rate: float, process: str, rng: random.Random) -> list[float]:
    """n arrival offsets (the first at 0) at `rate` req/s."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    kind, _, arg = process.partition(":")
    times, t = [], 0.0
    for i in range(n):
        if i:
            if kind == "poisson":
                t += rng.expovariate(rate)
            elif kind == "gamma":
                cv = float(arg or 1.0)
                shape = 1.0 / (cv * cv)
                t += rng.gammavariate(shape, 1.0 / (rate * shape))
            elif kind == "constant":
                t += 1.0 / rate
            else:
                raise ValueError(f"unknown arrival process {process!r}: poisson, gamma:CV or constant")
        times.append(t)
    return times


@dataclass(slots=True)
class WorkloadSpec:
    num_requests: int = 200
    rate: float = math.inf                 # req/s
    arrival: str = "poisson"
    prompt_len: str = "32:256"
    output_len: str = "16:256"
    max_tokens: str | None = None          # the clients' max_tokens (None: each request's output_len)
    prefix_groups: int = 0                 # shared-prefix groups (0: none)
    prefix_len: int = 0                    # tokens of the shared prefix
    prefix_share: float = 1.0              # fraction of requests that belong to a group
    priorities: dict[int, float] = field(default_factory=dict)   # priority -> weight (empty: all 0)
    tenants: dict[str, float] = field(default_factory=dict)      # tenant -> share of requests (empty: all "")
    adapters: int = 0                      # requests spread evenly over this many LoRA adapters (0: none)
    seed: int = 0

    def generate(self) -> list[SimRequest]:
        """Lengths, groups and priorities depend on the seed only, not on the rate."""
        rng = random.Random(f"lengths/{self.seed}")
        times = arrival_times(self.num_requests, self.rate, self.arrival, random.Random(f"arrivals/{self.seed}"))
        p_dist, o_dist = LengthDist.parse(self.prompt_len), LengthDist.parse(self.output_len)
        m_dist = LengthDist.parse(self.max_tokens) if self.max_tokens else None
        prios, weights = list(self.priorities) or [0], list(self.priorities.values()) or [1.0]
        tenants, shares = list(self.tenants) or [""], list(self.tenants.values()) or [1.0]
        who = random.Random(f"tenants/{self.seed}")   # (its own stream: lengths stay what they were)
        out = []
        for t in times:
            group = rng.randrange(self.prefix_groups) if self.prefix_groups and rng.random() < self.prefix_share \
                else None
            plen = p_dist.sample(rng)
            if group is not None:
                plen = max(plen, self.prefix_len + 1)
            olen = o_dist.sample(rng)
            max_tokens = max(olen, m_dist.sample(rng)) if m_dist else None
            out.append(SimRequest(t, plen, olen, max_tokens, rng.choices(prios, weights)[0], group, self.prefix_len,
                                  who.choices(tenants, shares)[0], who.randint(1, self.adapters) if self.adapters else 0))
        return out


def parse_tenants(text: str) -> dict[str, float]:
    """'heavy:10,light:1' -> {"heavy": 10.0, "light": 1.0}: each tenant's share of the requests."""
    out = {}
    for item in filter(None, text.split(",")):
        name, _, weight = item.rpartition(":") if ":" in item else (item, "", "1")
        out[name] = float(weight or 1.0)
    return out


def parse_priorities(text: str) -> dict[int, float]:
    """'0:0.9,1:0.1' -> {0: 0.9, 1: 0.1}."""
    out = {}
    for item in filter(None, text.split(",")):
        prio, _, weight = item.partition(":")
        out[int(prio)] = float(weight or 1.0)
    return out


# ---- JSONL traces --------------------------------------------------------------------------------

def load_trace(path: str | Path) -> list[SimRequest]:
    """One JSON object per line: arrival, prompt_len, output_len (required); max_tokens, priority,
    prefix_group, prefix_len, tenant, adapter (optional). Arrivals are made relative to the first one."""
    reqs = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            reqs.append(SimRequest(float(d["arrival"]), int(d["prompt_len"]), int(d["output_len"]),
                                   d.get("max_tokens"), int(d.get("priority", 0)), d.get("prefix_group"),
                                   int(d.get("prefix_len", 0)), str(d.get("tenant", "")), int(d.get("adapter", 0))))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: bad trace line ({e}): {line[:200]}") from None
    reqs.sort(key=lambda r: r.arrival)
    t0 = reqs[0].arrival if reqs else 0.0
    for r in reqs:
        r.arrival -= t0
    return reqs


def save_trace(requests: list[SimRequest], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in requests:
            d = {k: v for k, v in asdict(r).items()
                 if v is not None and not (k in ("prefix_len", "tenant", "adapter") and not v)}
            f.write(json.dumps(d) + "\n")
