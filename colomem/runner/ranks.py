"""Ranks of a colocated run: who generates what, who trains on what, and barriers that cannot hang.

Launch with torchrun (it sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); one process is rank
0 of 1. Barriers and the small metric reductions run on a gloo group (CPU) with a timeout, even when the
trainer uses NCCL, so a rank that stalls or dies makes the others fail with BarrierTimeoutError naming it
instead of hanging.

Work split for W ranks and vLLM tensor-parallel size TP (TP divides W): every rank draws the same prompts
for a step; rollout group g = rank // TP (the ranks of one vLLM engine) generates the prompt groups i with
(i % W) // TP == g, and rank r trains on the groups i with i % W == r, a subset of its rollout group's.
TP = 1: each rank generates exactly what it trains on. TP = W: one engine generates everything.

Several nodes (torchrun --nnodes N --nproc-per-node P): RANK is global, LOCAL_RANK (0..P-1) picks the GPU on
its node, LOCAL_WORLD_SIZE = P. torchrun numbers the ranks of one node consecutively, so a rollout group
(TP consecutive ranks) stays on one node when TP divides P; a TP that does not is refused, since one vLLM
engine cannot span nodes.
"""
from __future__ import annotations

import datetime
import gc
import os
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from colomem.errors import ColomemError, InvalidArgumentError

from .phases import PhaseTimeoutError


LEFT_KEY = "colomem/ranks-left"   # in the default group's store: how many ranks have torn their group down
LEAVE_WAIT_S = 10.0               # how long rank 0 waits at exit for the others to have done so


def _default_store(dist) -> Any:
    """The store the default group was built on (None where torch does not say)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001  (a private helper of torch's; without it, no ordering at exit)
        return None


def _first_line(error: BaseException) -> str:
    """An error's first line (torch.distributed's run on with C++ frames), or its type's name when empty."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class BarrierTimeoutError(PhaseTimeoutError):
    """The other ranks did not reach a barrier in time (one stalled or died)."""


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    if not v.strip().isdigit():
        raise InvalidArgumentError(f"{name}={v!r} is not a non-negative integer")
    return int(v)


def _check_layout(rank: int, world: int, local: int, tp: int, local_world: Optional[int]) -> None:
    """InvalidArgumentError unless the ranks and the tensor-parallel size make a layout the job can run."""
    if world < 1:
        raise InvalidArgumentError(f"WORLD_SIZE={world}: a job has at least one rank")
    if not 0 <= rank < world:
        raise InvalidArgumentError(f"RANK={rank} but WORLD_SIZE={world}: a rank lies in 0..WORLD_SIZE-1")
    if tp < 1 or world % tp:
        raise InvalidArgumentError(
            f"tensor_parallel_size={tp} must divide the number of ranks ({world}): in a colocated job every GPU "
            f"runs a trainer rank, so start it with torchrun --nproc-per-node {max(tp, world)}")
    if local_world is None:
        return
    if local_world < 1 or world % local_world:
        raise InvalidArgumentError(
            f"LOCAL_WORLD_SIZE={local_world} does not divide WORLD_SIZE={world}: start every node with the "
            "same torchrun --nproc-per-node")
    if not 0 <= local < local_world:
        raise InvalidArgumentError(f"LOCAL_RANK={local} but LOCAL_WORLD_SIZE={local_world}: a local rank lies in "
                                   "0..LOCAL_WORLD_SIZE-1")
    if tp > local_world or local_world % tp:
        raise InvalidArgumentError(
            f"tensor_parallel_size={tp} does not fit the {local_world} ranks per node: one vLLM engine spans TP "
            f"GPUs of one node, so start each node with torchrun --nproc-per-node a multiple of {tp} (at least "
            f"{tp}), or lower --tensor-parallel-size")
    if tp > 1 and rank % local_world != local:
        raise InvalidArgumentError(
            f"RANK={rank} with LOCAL_RANK={local} and LOCAL_WORLD_SIZE={local_world}: the ranks of one node must "
            "be numbered consecutively for a tensor-parallel engine to stay on its node; start the job with "
            "torchrun, which numbers them so")


@dataclass
class Ranks:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    tp: int = 1
    barrier_timeout_s: float = 300.0
    group: Any = None                    # gloo group for barriers / metric reductions (None: world 1)
    owns_process_group: bool = False
    local_world_size: Optional[int] = None   # ranks per node (LOCAL_WORLD_SIZE); None: unknown, not checked

    def __post_init__(self) -> None:
        _check_layout(self.rank, self.world_size, self.local_rank, self.tp, self.local_world_size)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, *, tp: int = 1, barrier_timeout_s: float = 300.0, backend: str = "gloo") -> "Ranks":
        """Reads the torchrun variables; with WORLD_SIZE > 1 starts torch.distributed (`backend` for the
        default group: nccl for DeepSpeed on GPUs, gloo on CPU) and a gloo group for the barriers."""
        world = _env_int("WORLD_SIZE", 1)
        rank = _env_int("RANK", 0)
        local = _env_int("LOCAL_RANK", rank)
        local_world = _env_int("LOCAL_WORLD_SIZE", 0) or None
        r = cls(rank, world, local, tp, float(barrier_timeout_s), local_world_size=local_world)
        if world > 1:
            import torch.distributed as dist

            missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
            if missing:
                raise InvalidArgumentError(f"WORLD_SIZE={world} but {', '.join(missing)} not set; start the job "
                                           "with torchrun")
            timeout = datetime.timedelta(seconds=float(barrier_timeout_s))
            if backend == "nccl":
                import torch
                torch.cuda.set_device(local)          # before NCCL makes its communicators
            # torch.distributed.nn's functions take the default group as a default argument, read when
            # the module is first imported: imported after init (transformers does), they would keep the
            # group and gloo's threads alive past destroy_process_group, to interpreter exit (see close)
            import torch.distributed.nn  # noqa: F401

            if not dist.is_initialized():
                dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout)
                r.owns_process_group = True
            r.group = dist.new_group(backend="gloo", timeout=timeout) if dist.get_backend() != "gloo" \
                else dist.group.WORLD
        return r

    # -- work split ---------------------------------------------------------------------------------------
    @property
    def node(self) -> Optional[int]:
        """This rank's node (rank // LOCAL_WORLD_SIZE; torchrun numbers a node's ranks consecutively), None
        when the ranks per node are unknown."""
        return None if self.local_world_size is None else self.rank // self.local_world_size

    @property
    def rollout_group(self) -> int:
        return self.rank // self.tp

    def generate_groups(self, n_groups: int) -> list[int]:
        """Indices of the prompt groups this rank's rollout engine generates."""
        return [i for i in range(n_groups) if (i % self.world_size) // self.tp == self.rollout_group]

    def train_groups(self, n_groups: int) -> list[int]:
        """Indices of the prompt groups this rank trains on."""
        return [i for i in range(n_groups) if i % self.world_size == self.rank]

    def check_split(self, n_groups: int) -> None:
        if n_groups % self.world_size:
            raise InvalidArgumentError(f"prompts_per_step={n_groups} must be a multiple of the number of ranks "
                                       f"({self.world_size}) so every rank trains on as many groups")

    # -- collectives --------------------------------------------------------------------------------------
    def barrier(self, what: str, timeout_s: Optional[float] = None) -> None:
        """Waits for every rank, at most timeout_s (default barrier_timeout_s); BarrierTimeoutError after."""
        if self.world_size == 1:
            return
        import torch.distributed as dist

        t = float(self.barrier_timeout_s if timeout_s is None else timeout_s)
        try:
            dist.monitored_barrier(group=self.group, timeout=datetime.timedelta(seconds=t), wait_all_ranks=True)
        except RuntimeError as e:   # gloo: "Rank 1 failed to pass monitoredBarrier in ... ms", or a dead peer
            detail = _first_line(e)
            raise BarrierTimeoutError(
                f"rank {self.rank}: the other ranks did not reach barrier '{what}' within {t:.0f} s ({detail}). "
                "A rank is stuck or died: see its log; raise --barrier-timeout-s if a phase is just slow") from None

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum of small float vectors over the ranks (bounded by the group's timeout)."""
        if self.world_size == 1:
            return [float(v) for v in values]
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        try:
            dist.all_reduce(t, group=self.group)
        except RuntimeError as e:
            raise BarrierTimeoutError(f"rank {self.rank}: reducing metrics over the ranks failed ({e}); "
                                      "another rank is stuck or died") from None
        return t.tolist()

    def any_true(self, flag: bool, what: str) -> bool:
        """True on every rank when `flag` is true on any (bounded by the group's timeout); a rank that died or
        hangs makes it raise BarrierTimeoutError naming `what`."""
        if self.world_size == 1:
            return bool(flag)
        import torch
        import torch.distributed as dist

        t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64)
        try:
            dist.all_reduce(t, group=self.group)
        except RuntimeError as e:
            detail = _first_line(e)
            raise BarrierTimeoutError(f"rank {self.rank}: the other ranks did not take part in {what} ({detail}); "
                                      "another rank is stuck or died: see its log") from None
        return bool(t.item() > 0)

    def peer_failure(self, error: BaseException, during: Optional[str] = None) -> Optional[BarrierTimeoutError]:
        """The BarrierTimeoutError naming this rank for `error` when it is a RuntimeError raised inside
        torch.distributed (a collective outside these helpers, e.g. the trainer's gradient all-reduce, saw a
        peer die or hang) while several ranks run; None for anything else. The cause stays chained."""
        if self.world_size == 1 or not isinstance(error, RuntimeError) or isinstance(error, ColomemError) \
                or error.__traceback__ is None:
            return None
        tb = error.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        if f"{os.sep}torch{os.sep}distributed{os.sep}" not in tb.tb_frame.f_code.co_filename:
            return None
        detail = _first_line(error)
        where = f" during {during}" if during else ""
        out = BarrierTimeoutError(
            f"rank {self.rank}: a collective with the other ranks failed{where} ({detail}); another rank is "
            "stuck or died: see its log")
        out.__cause__ = error
        return out

    def exchange(self, obj) -> list:
        """Every rank's `obj` (small, picklable), in rank order (bounded by the group's timeout)."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as e:
            raise BarrierTimeoutError(f"rank {self.rank}: exchanging data with the other ranks failed ({e}); "
                                      "another rank is stuck or died") from None
        return out

    @property
    def group_ranks(self) -> list[int]:
        """The ranks of this rank's rollout group (the GPUs one vLLM engine spans)."""
        g = self.rollout_group
        return list(range(g * self.tp, (g + 1) * self.tp))

    def bridge_addresses(self, gpu_uuid: str, address: str) -> dict[str, str]:
        """{GPU UUID: bridge socket} of every rank in this rank's rollout group, from each rank's own pair:
        what a tensor-parallel engine's workers need to find the trainer bridge on their own GPU (every rank
        calls it, collectively)."""
        pairs = self.exchange((str(gpu_uuid), str(address)))
        out: dict[str, str] = {}
        for r in self.group_ranks:
            uuid, addr = pairs[r]
            if uuid in out:
                raise InvalidArgumentError(f"ranks of rollout group {self.rollout_group} share GPU {uuid}: one rank "
                                           f"per GPU (set CUDA_VISIBLE_DEVICES or LOCAL_RANK right)")
            out[uuid] = addr
        return out

    def close(self, timeout_s: float = 30.0) -> None:
        """Leaves torch.distributed: a last bounded barrier (no rank tears down the group while another
        still talks to it), then destroy_process_group, rank 0 last. Errors here are ignored: this runs at
        exit."""
        if self.world_size > 1 and self.owns_process_group:
            import torch.distributed as dist

            if dist.is_initialized():
                store = _default_store(dist)
                try:
                    self.barrier("exit", timeout_s)
                except Exception:  # noqa: BLE001  (a peer already gone)
                    pass
                # our own reference would keep the gloo group, and the threads gloo runs for it, alive past
                # destroy_process_group: they would then be torn down at interpreter exit, after this rank
                # told rank 0 it had left, and abort there once rank 0 (the store's host) is gone
                self.group = None
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001  (best effort at exit)
                    pass
                gc.collect()                      # a group caught in a reference cycle goes now, not at exit
                if store is not None:
                    self._leave_in_order(store, min(float(timeout_s), LEAVE_WAIT_S))

    def _leave_in_order(self, store, wait_s: float) -> None:
        """Rank 0 exits only once every rank has torn its group down. Rank 0 hosts the store the groups were
        built on (unless torchrun's agent does), and a rank still inside destroy_process_group when the
        store's host is gone can abort in gloo's teardown ("terminate called without an active exception").
        Bounded: a dead peer costs at most wait_s."""
        try:
            left = int(store.add(LEFT_KEY, 1))
            deadline = time.monotonic() + wait_s
            while self.rank == 0 and left < self.world_size and time.monotonic() < deadline:
                time.sleep(0.01)
                left = int(store.add(LEFT_KEY, 0))
        except Exception:  # noqa: BLE001  (the store's host already gone: nothing left to wait for)
            pass
