"""Tensor parallelism over torch.distributed (gloo on CPU, NCCL on CUDA), Megatron style.

Each rank holds a slice of every layer: whole KV-head groups of attention (q heads with the KV
head they read; when there are fewer KV heads than ranks, a KV head is replicated and its q
heads split), a column slice of gate/up and the matching row slice of down_proj, and a vocab
slice of the LM head. The partial outputs of o_proj and down_proj are summed by an all-reduce;
the LM head's vocab slices are gathered on rank 0. The embedding (a lookup, no compute) and the
norms are replicated. The split itself (``Shard``) is conveyor/model/shard.py: the loader
builds a rank's slice with it, and the model package sits below this one.

One scheduler, on rank 0 (the driver): each step it broadcasts the plain-data SchedulerOutput
(``broadcast_object_list``), every rank runs its slice, and rank 0 samples from the gathered
logits. Sampling stays on the driver because the sampler's state (seeded generators, penalties
over the output so far) lives beside the scheduler there, and only the driver needs the tokens;
the price is one gather of ``[rows, vocab]`` logits per step. Each rank holds its heads' slice
of every KV block; the block tables are the driver's scheduler's, and every rank rebuilds the
same ones from the plans' deltas (new requests in full, then only new block ids: runner/state.py).

Launch: ``start_group`` spawns ranks 1..N-1 on this machine (a free TCP port on 127.0.0.1); or,
with the ``ray`` backend, places them as Ray actors in a placement group, one bundle each, possibly
on other nodes (rank 0's node address and a free port as the rendezvous); or, under ``torchrun``
(RANK / WORLD_SIZE / MASTER_ADDR in the environment), joins the group that torchrun's other
processes join with ``run_worker_from_env``.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from conveyor.kv.layout import KVLayout
from conveyor.model.loader import load_model
from conveyor.model.shard import Shard, head_ranges, split  # noqa: F401 - re-exported
from conveyor.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# How long a collective may wait. Idle ranks wait in a broadcast for the next step, so this is
# also the longest a server may sit idle; a crashed rank closes its sockets and fails the
# others' collectives at once, long before this.
_TIMEOUT = datetime.timedelta(days=365)


class TPGroup:
    """This process's place in the tensor-parallel group, and the model's two collectives."""

    def __init__(self, shard_rank: int, world: int):
        self.rank = shard_rank
        self.world = world
        self.vocab_size = 0        # set by the model that uses it (the gather trims the padding)
        self.processes: list[Any] = []   # ranks started here: spawned processes or Ray actors
        self.on_close: list[Any] = []     # what else to release at close (a placement group)

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum the ranks' partial outputs in place."""
        if x.dtype == torch.bfloat16 and dist.get_backend() == "gloo":
            y = x.float()   # gloo sums fp32 (its bf16 support depends on the build)
            dist.all_reduce(y)
            x.copy_(y)
        else:
            dist.all_reduce(x)

    def gather_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The full ``[rows, vocab]`` logits on rank 0 (other ranks get their own slice back)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1)[:, :self.vocab_size] if parts is not None else x

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self, timeout: float = 10.0) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        for p in self.processes:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join()
        while self.on_close:
            self.on_close.pop(0)()


# ---- launching -------------------------------------------------------------------------------

def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def _backend(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_group(world: int, device: str, backend: str = "mp", cpus_per_rank: int = 1) -> TPGroup:
    """Rank 0's side: start ranks 1..world-1 (spawned here, or Ray actors with `backend` "ray", each
    in a bundle of `cpus_per_rank` CPUs) or join torchrun's group, and connect."""
    if launched_by_torchrun():
        env_world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if env_world != world or rank != 0:
            raise ValueError(f"under torchrun the engine runs on rank 0 of a group of tensor_parallel_size "
                             f"ranks; got RANK={rank}, WORLD_SIZE={env_world}, tensor_parallel_size={world}")
        dist.init_process_group(_backend(device), init_method="env://", rank=0, world_size=world, timeout=_TIMEOUT)
        return TPGroup(0, world)
    if backend == "ray":
        return _start_ray_group(world, device, cpus_per_rank)
    init = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")   # torch's thread pools do not survive a fork
    procs = [ctx.Process(target=_spawned_worker,
                         args=(r, world, init, device, logging.getLogger().getEffectiveLevel()),
                         name=f"conveyor-tp{r}", daemon=True) for r in range(1, world)]
    for p in procs:
        p.start()
    try:
        dist.init_process_group(_backend(device), init_method=init, rank=0, world_size=world, timeout=_TIMEOUT)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    group = TPGroup(0, world)
    group.processes = procs
    return group


class _RayRank:
    """A rank > 0 as a Ray actor: ``run`` joins the group and serves steps until the driver stops."""

    def ready(self) -> str:
        return "ready"   # the actor was placed and this module imports on its node

    def run(self, rank: int, world: int, init_method: str, device: str, log_level: int) -> None:
        os.environ["LOCAL_RANK"] = "0"   # Ray gives this actor its bundle's GPU only, as device 0
        _join_and_serve(rank, world, init_method, device, log_level, cuda_index=0)


class _RayRankProcess:
    """A Ray-placed rank seen through the three calls TPGroup makes on a spawned process."""

    def __init__(self, actor: Any, done: Any):
        self.actor, self.done = actor, done

    def join(self, timeout: float | None = None) -> None:
        import ray   # lazy: optional dependency (ray)

        ray.wait([self.done], timeout=timeout)

    def is_alive(self) -> bool:
        import ray   # lazy: optional dependency (ray)

        ready, _ = ray.wait([self.done], timeout=0)
        return not ready

    def kill(self) -> None:
        import ray   # lazy: optional dependency (ray)

        ray.kill(self.actor, no_restart=True)


RAY_PLACEMENT_TIMEOUT_S = 600   # how long Ray may take to place the ranks and start their actors


def _start_ray_group(world: int, device: str, cpus: int) -> TPGroup:
    """Ranks 1..world-1 as Ray actors, one placement-group bundle each. Inside a placement group of
    exactly `world` bundles, the engine's own (a Ray Serve replica from ``get_deployment_options``:
    the replica in bundle 0), bundles 1..world-1 of it; otherwise a new PACK group of world-1 bundles
    (removed at close). The rendezvous is this node's address and a free port: no master address to
    type. Nothing waits forever: the actors must be placed and answer, and the group form, within
    RAY_PLACEMENT_TIMEOUT_S each, and a rank that ends before the group forms fails the start."""
    # lazy: optional dependency (ray)
    import ray
    from ray.util.placement_group import get_current_placement_group, placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
    gpu = torch.device(device).type == "cuda"
    pg, owned, first = get_current_placement_group(), None, 1
    if pg is not None and len(pg.bundle_specs) != world:
        pg = None   # not a group laid out for this engine (e.g. a gang of replicas): make one
    if pg is None:
        if gpu:   # rank 0 (this process) would use a GPU Ray does not know about and may hand to rank 1
            raise ValueError("tensor parallelism on CUDA with distributed_executor_backend 'ray' needs the engine "
                             "inside a placement group that gives rank 0 its GPU too (a Ray Serve replica: "
                             "conveyor serve --ray); outside one, use the 'mp' backend or torchrun")
        bundle = {"CPU": float(cpus)}
        pg = owned = placement_group([dict(bundle) for _ in range(world - 1)], strategy="PACK")
        first = 0
    ranks: list[_RayRankProcess] = []

    def undo() -> None:
        for r in ranks:
            r.kill()
        if owned is not None:
            remove_placement_group(owned)

    try:
        if owned is not None:
            try:
                ray.get(pg.ready(), timeout=RAY_PLACEMENT_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise RuntimeError(f"Ray could not place {world - 1} tensor-parallel rank(s) of {bundle} within "
                                   f"{RAY_PLACEMENT_TIMEOUT_S} s: not enough resources in the cluster") from None
        specs = pg.bundle_specs
        actor_cls = ray.remote(_RayRank)
        actors = []
        for rank in range(1, world):
            index = first + rank - 1
            actors.append(actor_cls.options(
                num_cpus=specs[index].get("CPU", 0.0), num_gpus=specs[index].get("GPU", 0.0), max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)).remote())
            ranks.append(_RayRankProcess(actors[-1], None))
        try:
            ray.get([a.ready.remote() for a in actors], timeout=RAY_PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"the tensor-parallel rank actors did not start within {RAY_PLACEMENT_TIMEOUT_S} s "
                               f"(placement group {pg.id.hex()})") from None
        init = f"tcp://{ray.util.get_node_ip_address()}:{_free_port('')}"   # reachable from other nodes
        for rank, r in enumerate(ranks, 1):
            r.done = r.actor.run.remote(rank, world, init, device, logging.getLogger().getEffectiveLevel())
        logger.info("tensor-parallel ranks 1..%d placed by Ray (placement group %s, bundles %d..%d); rendezvous %s",
                    world - 1, pg.id.hex(), first, first + world - 2, init)
        # The rendezvous blocks until every rank joins: run it aside and watch the ranks meanwhile.
        failed: list[BaseException] = []

        def rendezvous() -> None:   # bounded: a rank that is up but cannot connect fails the start
            try:
                dist.init_process_group(_backend(device), init_method=init, rank=0, world_size=world,
                                        timeout=datetime.timedelta(seconds=RAY_PLACEMENT_TIMEOUT_S))
            except BaseException as e:   # noqa: BLE001 - re-raised below, in the caller's thread
                failed.append(e)

        joiner = threading.Thread(target=rendezvous, name="conveyor-tp-rendezvous", daemon=True)
        joiner.start()
        while joiner.is_alive():
            joiner.join(0.2)
            ended, _ = ray.wait([r.done for r in ranks], timeout=0)
            if ended and joiner.is_alive():
                ray.get(ended)   # its error, if it raised one
                raise RuntimeError("a tensor-parallel rank ended before the group formed")
        if failed:
            raise failed[0]
        # Formed: rank 0's collectives get the usual timeout (the other ranks joined with it).
        dist.distributed_c10d._set_pg_timeout(_TIMEOUT)
    except BaseException:
        undo()
        raise
    group = TPGroup(0, world)
    group.processes = ranks
    group.on_close.append(lambda: [r.kill() for r in ranks])   # an actor whose run() returned still holds its bundle
    if owned is not None:
        group.on_close.append(lambda: remove_placement_group(owned))
    return group


@dataclass(slots=True)
class WorkerSetup:
    """What the driver tells every other rank once the group is up."""

    config: Any            # EngineConfig
    dtype: str
    num_blocks: int
    num_host_blocks: int
    threads: int


def _spawned_worker(rank: int, world: int, init_method: str, device: str, log_level: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the driver decides when the group stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _join_and_serve(rank, world, init_method, device, log_level, cuda_index=rank)


def _join_and_serve(rank: int, world: int, init_method: str, device: str, log_level: int, cuda_index: int) -> None:
    """A rank > 0 started by the driver (spawned, or a Ray actor): its logging, its GPU (`cuda_index`
    among those it sees), the rendezvous, then the steps the driver broadcasts."""
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s[tp{rank}]: %(message)s")
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(cuda_index)
    dist.init_process_group(_backend(device), init_method=init_method, rank=rank, world_size=world,
                            timeout=_TIMEOUT)
    _serve_steps(TPGroup(rank, world))


def run_worker_from_env(device: str = "cpu") -> int:
    """A torchrun rank > 0 (`device`: the engine's): join the group and run steps until the driver stops."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(_backend(device), init_method="env://", rank=rank, world_size=world, timeout=_TIMEOUT)
    _serve_steps(TPGroup(rank, world))
    return 0


def _serve_steps(group: TPGroup) -> None:
    """Every rank but 0: build its slice, then run what the driver broadcasts until it says stop."""
    try:
        setup: WorkerSetup = group.broadcast(None)
        if setup is None:
            return
        torch.set_num_threads(setup.threads)
        cfg = setup.config
        device = cfg.device
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", group.rank)))
            device = f"cuda:{torch.cuda.current_device()}"
        model = load_model(cfg.model, device, getattr(torch, setup.dtype), tp=group).model
        runner = ModelRunner(model, setup.num_blocks, cfg.block_size, setup.num_host_blocks, device,
                             getattr(torch, setup.dtype), sample=False,
                             layout=KVLayout.from_config(model.cfg, cfg.hybrid_kv_cache))
        group.broadcast(None)   # loaded (the driver waits for every rank before its first step)
        while True:
            cmd = group.broadcast(None)
            if cmd[0] == "step":
                runner.forward(cmd[1])
            elif cmd[0] == "swap":
                runner.swap(cmd[1], cmd[2])
            else:
                break
    except Exception:   # noqa: BLE001 - exiting closes the sockets: the driver's collective fails at once
        logger.exception("tensor-parallel rank %d failed; exiting", group.rank)
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()


class TPExecutor:
    """The driver's Executor: broadcast the plan, run rank 0's slice, sample from the gathered logits.

    A collective cannot be resumed half-way: if anything fails after a plan was broadcast, the
    group is broken and every later step fails at once (the engine then gives up after its
    ``max_consecutive_step_failures``).
    """

    def __init__(self, runner, group: TPGroup):
        self.runner = runner
        self.group = group
        self.broken: str | None = None

    def __getattr__(self, name: str) -> Any:   # record_logits, kv, ... (tests and stats read the runner's)
        return getattr(self.runner, name)

    def _run(self, command: tuple, local) -> Any:
        if self.broken is not None:
            raise RuntimeError(f"the tensor-parallel group is broken: {self.broken}")
        try:
            self.group.broadcast(command)
            return local()
        except Exception as e:
            self.broken = f"{type(e).__name__}: {e}"
            for p in self.group.processes:
                p.kill()
            raise RuntimeError(f"a tensor-parallel step failed, the group is stopped: {self.broken}") from e

    def execute(self, plan):
        return self._run(("step", plan), lambda: self.runner.execute(plan))

    def swap(self, swap_out, swap_in) -> None:
        self._run(("swap", swap_out, swap_in), lambda: self.runner.swap(swap_out, swap_in))

    def close(self) -> None:
        if self.broken is None and dist.is_initialized():
            try:
                self.group.broadcast(("stop",))
            except Exception:   # noqa: BLE001 - a rank already gone
                pass
        self.group.close()
