"""What a run records: per-step phase times, a memory snapshot after every phase, JSONL metrics, alarms (what
the run keeps of its steps in memory for the summary, tables and plots: colomem.runner.history).

Memory columns (bytes): `allocated` / `reserved` are the trainer's part of this process's torch caching
allocator: with vLLM in its own engine process that is the whole allocator; with vLLM in this process (the
in-rank engine, a shared LoRA base) its memory pool lives in the same allocator and stays counted there while
it sleeps (torch is not told its memory went back to the driver), so it is taken out (`engine_reserved` says
how much). `driver_used` is total - free from cudaMemGetInfo (every process on the GPU), `pinned_host` is the
colomem pool's reserved host memory. On CPU only `pinned_host` is known.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Collection, Optional, Sequence, TextIO

from colomem._torch import driver_memory
from colomem.units import format_bytes

from .phases import SWITCH_PHASES, WORK_PHASES

MEMORY_KEYS = ("allocated", "reserved", "driver_used", "pinned_host")


def _cuda(device: Optional[int]):
    """torch.cuda when the run has a GPU device and CUDA is there; None otherwise (the CPU backend)."""
    if device is None:
        return None
    import torch

    return torch.cuda if torch.cuda.is_available() else None


def settle(device: Optional[int]) -> None:
    """Waits for the GPU work queued so far (a no-op without a GPU). At the end of a phase whose kernels run
    on after the host returns (the optimizer step), so its time is counted in that phase and not in
    whichever later phase first waits for the GPU (in a step where nothing moves, the weight sync)."""
    cuda = _cuda(device)
    if cuda is not None:
        cuda.synchronize(device)


def memory_snapshot(device: Optional[int], pool=None, extra_pinned: int = 0,
                    engine_reserved: int = 0) -> dict[str, Optional[int]]:
    """The memory columns now. engine_reserved: bytes of this process's allocator that an in-process rollout
    engine's own pool holds (the module's docstring says why they are not the trainer's)."""
    snap: dict[str, Optional[int]] = {k: None for k in MEMORY_KEYS}
    cuda = _cuda(device)
    mem = driver_memory(device)
    if cuda is not None and mem is not None:
        free, total = mem
        engine = max(0, int(engine_reserved))
        snap.update(allocated=max(0, int(cuda.memory_allocated(device)) - engine),
                    reserved=max(0, int(cuda.memory_reserved(device)) - engine), driver_used=total - free)
        if engine:
            snap["engine_reserved"] = engine
    pinned = int(extra_pinned)
    if pool is not None and not getattr(pool, "closed", True):
        pinned += int(pool.stats()["reserved_bytes"])
    snap["pinned_host"] = pinned if (pool is not None or extra_pinned) else None
    return snap


def host_usage() -> dict[str, Optional[int]]:
    """This process's resident host memory (bytes) and open file descriptors, from /proc (None elsewhere):
    per step, so a host-side leak (memory or descriptors growing step after step) shows in the metrics."""
    out: dict[str, Optional[int]] = {"host/rss_bytes": None, "host/open_fds": None}
    try:
        with open("/proc/self/statm") as f:
            out["host/rss_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        out["host/open_fds"] = len(os.listdir("/proc/self/fd")) - 1     # less the one listdir holds
    except (OSError, ValueError, IndexError):
        pass
    return out


def reset_peak(device: Optional[int]) -> None:
    """Starts the allocator's peak count over (the placement planner reads the train phase's peak)."""
    cuda = _cuda(device)
    if cuda is not None:
        cuda.reset_peak_memory_stats(device)


def release_cache(device: Optional[int]) -> None:
    """Gives the allocator's cached blocks back to the driver (a resident trainer's activations, before
    vLLM wakes beside it)."""
    cuda = _cuda(device)
    if cuda is not None:
        cuda.empty_cache()


def peak_reserved(device: Optional[int], engine_reserved: int = 0) -> Optional[int]:
    """The allocator's peak reserved bytes since reset_peak, less an in-process rollout engine's
    (memory_snapshot); None without a GPU."""
    cuda = _cuda(device)
    if cuda is None:
        return None
    return max(0, int(cuda.max_memory_reserved(device)) - max(0, int(engine_reserved)))


def gpu_total(device: Optional[int]) -> Optional[int]:
    """The GPU's memory in bytes; None without a GPU."""
    mem = driver_memory(device)
    return mem[1] if mem is not None else None


def gpu_free(device: Optional[int]) -> Optional[int]:
    """The GPU's free memory in bytes, as the driver reports it; None without a GPU."""
    mem = driver_memory(device)
    return mem[0] if mem is not None else None


def drop_step_timings(rollout: Any) -> None:
    """Forgets the last step's sleep and wake figures in rollout.timings (its start-up's stay): a step that
    skips a phase (no weights' wake after a sleep that kept them) must not report the last one's."""
    timings = getattr(rollout, "timings", None)
    if isinstance(timings, dict):
        for k in [k for k in timings if k != "start_s"]:
            del timings[k]


def switch_metrics(sync: Any, trainer: Any, rollout: Any, moved: Collection[str]) -> dict:
    """The step's switch as metrics: the sync's sizes and time, and the reports of what moved in this step
    only (`moved`: offload, reload, rollout; a placement that keeps things in place moves nothing)."""
    out: dict[str, Any] = {}
    if sync is not None:
        out.update({"sync/nbytes": sync.nbytes, "sync/ntensors": sync.ntensors, "sync/nbuckets": sync.nbuckets,
                    "sync/seconds": sync.seconds})
        # where the sync's time went (the worker's apply, the bridge's round trips, the RPC's return), when the
        # engine reports it
        for k in ("apply_seconds", "bridge_seconds", "pack_issue_seconds", "pack_copy_seconds", "pack_checksum_seconds",
                  "pack_wait_seconds", "ack_seconds", "rpc_wait_seconds", "prefix_reset_seconds", "replayed_tensors",
                  "adapter_seconds"):
            v = getattr(sync, k, None)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[f"sync/{k}"] = v
        if isinstance(getattr(sync, "prefix_reset_early", None), bool):   # the reset had run while training
            out["sync/prefix_reset_early"] = sync.prefix_reset_early
    for side, rep in (("offload", trainer.last_offload), ("reload", trainer.last_reload)):
        if rep is None or side not in moved:
            continue
        for k, v in rep.to_dict().items():
            if isinstance(v, (int, float, str, bool)) or v is None:
                out[f"trainer_{side}/{k}"] = v
    for k, v in rollout.timings.items() if "rollout" in moved else ():
        if isinstance(v, (int, float)):
            out[f"rollout/{k}"] = v
    return out


@dataclass
class StepRecord:
    """One step: phase durations (s), memory after each phase, and the metrics. step_s leaves out an `eval`
    phase (the held-out evaluation is neither switch nor training: the switch share stays that of training)."""
    step: int
    rank: int = 0
    started: float = field(default_factory=time.time)
    phase_s: dict[str, float] = field(default_factory=dict)
    memory: dict[str, dict] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    step_s: float = 0.0

    @property
    def switch_s(self) -> float:
        return sum(self.phase_s.get(p, 0.0) for p in SWITCH_PHASES)

    @property
    def work_s(self) -> float:
        return sum(self.phase_s.get(p, 0.0) for p in WORK_PHASES)

    def to_json(self) -> dict:
        return {"step": self.step, "rank": self.rank, "time": self.started, "step_s": self.step_s,
                "switch_s": self.switch_s, "switch_fraction": self.switch_s / self.step_s if self.step_s else None,
                "phase_s": self.phase_s, "memory": self.memory, **self.metrics}


def _clean(v):
    """JSON-safe: NaN/inf -> None (a JSONL line must stay valid JSON)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if hasattr(v, "item") and callable(v.item):
        return _clean(v.item())
    return v


class MetricsWriter:
    """Appends one JSON object per line and flushes each line: lines already written are never rewritten,
    a crash loses at most the line being written, and a re-used output directory keeps its old lines."""

    def __init__(self, path: os.PathLike, fsync: bool = True):
        self.path = os.fspath(path)
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self._fsync = fsync
        f = open(self.path, "a", encoding="utf-8")
        # a previous writer killed mid-line leaves a partial line: start on a fresh one
        if f.tell() > 0:
            with open(self.path, "rb") as r:
                r.seek(-1, os.SEEK_END)
                if r.read(1) != b"\n":
                    f.write("\n")
                    f.flush()
        self.start = f.tell()       # where this writer's lines begin (a resumed run appends to the old ones)
        self._f: Optional[TextIO] = f

    def write(self, record: dict) -> None:
        if self._f is None:
            raise ValueError(f"MetricsWriter for {self.path} is closed")
        line = json.dumps(_clean(record), allow_nan=False, separators=(",", ":"))
        self._f.write(line + "\n")
        self._f.flush()
        if self._fsync:
            os.fsync(self._f.fileno())

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def read_jsonl(path: os.PathLike, offset: int = 0) -> list[dict]:
    """Every complete JSON line of a metrics file from byte `offset` on (MetricsWriter.start: where one run
    began writing); a torn line is skipped."""
    out = []
    with open(path, "rb") as f:
        f.seek(offset)
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


class MemoryAlarm:
    """Watches the GPU memory still in use after vLLM went to sleep (trainer still offloaded: the floor of
    the step). It must stay flat: growth across steps is a leak, the failure users of other colocated
    trainers report as leftover memory growing step after step."""

    def __init__(self, threshold_bytes: float, warmup_steps: int = 1):
        self.threshold = float(threshold_bytes)
        self.warmup = warmup_steps
        self.baseline: Optional[int] = None
        self.baseline_step: Optional[int] = None
        self.alarms: list[dict] = []
        self._worst = 0

    def restart(self, from_step: int) -> None:
        """A new placement from step `from_step` on: its floor is not the old one's. The new placement's
        first step is a warm-up too (a trainer that stays resident keeps its first training's activations
        in torch's cache, read at the next step), so the baseline is the step after it."""
        self.warmup = from_step + 1
        self.baseline = self.baseline_step = None
        self._worst = 0

    def observe(self, step: int, used_after_sleep: Optional[int]) -> Optional[str]:
        if used_after_sleep is None or step < self.warmup:
            return None
        if self.baseline is None:
            self.baseline, self.baseline_step = used_after_sleep, step
            return None
        growth = used_after_sleep - self.baseline
        if growth > self.threshold and growth > self._worst:
            self._worst = growth
            msg = (f"memory left after sleep grew by {format_bytes(growth)} since step {self.baseline_step} "
                   f"({format_bytes(self.baseline)} -> {format_bytes(used_after_sleep)}): something is not freed "
                   "between steps (a leak in the trainer offload, the sync or vLLM's sleep)")
            self.alarms.append({"step": step, "growth_bytes": growth, "used_after_sleep": used_after_sleep,
                                "message": msg})
            return msg
        return None


def median(xs: Sequence[Optional[float]]) -> Optional[float]:
    """The true median (the mean of the two middle values for an even count), None values left out; the
    tables and summary.json use this one, so the same screen never shows two figures for one median."""
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None
