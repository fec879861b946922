"""Ranks of a colocated run: who generates what, who trains on what, and barriers that cannot hang.

Launch with torchrun (it sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); one process is rank
0 of 1. Barriers and the small metric reductions run on a gloo group (CPU) with a timeout, even when the
trainer uses NCCL, so a rank that stalls or dies makes the others fail with BarrierTimeoutError naming it
instead of hanging.

Work split for W ranks and vLLM tensor-parallel size TP (TP divides W): every rank draws the same prompts
for a step; rollout group g = rank // TP (the ranks of one vLLM engine) generates the prompt groups i with
(i % W) // TP == g, and rank r trains on the groups i with i % W == r, a subset of its rollout group's.
TP = 1: each rank generates exactly what it trains on. TP = W: one engine generates everything.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from colomem.errors import InvalidArgumentError

from .phases import PhaseTimeoutError


class BarrierTimeoutError(PhaseTimeoutError):
    """The other ranks did not reach a barrier in time (one stalled or died)."""


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    if not v.strip().isdigit():
        raise InvalidArgumentError(f"{name}={v!r} is not a non-negative integer")
    return int(v)


@dataclass
class Ranks:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    tp: int = 1
    barrier_timeout_s: float = 300.0
    group: Any = None                    # gloo group for barriers / metric reductions (None: world 1)
    owns_process_group: bool = False

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
        if rank >= world:
            raise InvalidArgumentError(f"RANK={rank} but WORLD_SIZE={world}")
        if tp < 1 or world % tp:
            raise InvalidArgumentError(
                f"tensor_parallel_size={tp} must divide the number of ranks ({world}): in a colocated job every GPU "
                f"runs a trainer rank, so start it with torchrun --nproc-per-node {max(tp, world)}")
        r = cls(rank, world, local, tp, float(barrier_timeout_s))
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
            if not dist.is_initialized():
                dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout)
                r.owns_process_group = True
            r.group = dist.new_group(backend="gloo", timeout=timeout) if dist.get_backend() != "gloo" \
                else dist.group.WORLD
        return r

    # -- work split ---------------------------------------------------------------------------------------
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
            detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
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
        still talks to it), then destroy_process_group. Errors here are ignored: this runs at exit."""
        if self.world_size > 1 and self.owns_process_group:
            import torch.distributed as dist

            if dist.is_initialized():
                try:
                    self.barrier("exit", timeout_s)
                except Exception:  # noqa: BLE001  (a peer already gone)
                    pass
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001  (best effort at exit)
                    pass
