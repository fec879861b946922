"""A runner job as a process group, seen from outside: started in a session of its own, its processes found
by scanning /proc, their memory and descriptors read there, the GPU's compute processes asked of nvidia-smi,
and everything of it killed at the end whatever happened (benchmarks/faults.py and benchmarks/soak.py).

Every wait here has a deadline; a job is always ended with its whole process group.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]


def _stat_fields(pid: int) -> Optional[list]:
    """/proc/<pid>/stat after the command name: [state, ppid, pgrp, ...]; None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()


def group_pids(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        f = _stat_fields(int(name))
        if f is not None and len(f) > 2 and int(f[2]) == pgid and f[0] not in ("Z", "X"):
            out.append(int(name))
    return sorted(out)


def proc_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def rss_and_fds(pid: int) -> tuple[Optional[int], Optional[int]]:
    """(resident bytes, open descriptors) of a process; None for what cannot be read."""
    rss = fds = None
    try:
        rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        pass
    return rss, fds


def gpu_apps(timeout_s: float = 20.0) -> Optional[dict[int, int]]:
    """{pid: used MiB} of the GPU's compute processes (nvidia-smi); None without nvidia-smi."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    apps = {}
    for line in r.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            apps[int(parts[0])] = int(parts[1]) if parts[1].isdigit() else -1
    return apps


def wait_gpu_released(pids: set, timeout_s: float) -> tuple[Optional[dict[int, int]], Optional[float]]:
    """nvidia-smi's compute apps once none of `pids` is among them, and the seconds that took (None: one still
    was at the deadline). The driver tears a dead process's context down after the process left /proc, so
    the list can name it for a moment after its group is gone."""
    t0 = time.monotonic()
    while True:
        apps = gpu_apps()
        if apps is None:
            return None, None
        if not any(p in pids for p in apps):
            return apps, time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            return apps, None
        time.sleep(0.25)


def gpu_used_mib(timeout_s: float = 20.0) -> Optional[int]:
    """Memory in use on GPU 0 (nvidia-smi), whoever holds it: in a container nvidia-smi may not list the
    processes (other pid namespace), this total still says whether memory was left held."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                           capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = r.stdout.strip().splitlines()[:1]
    return int(first[0]) if r.returncode == 0 and first and first[0].strip().isdigit() else None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def engine_pid(pgid: int, runner: int) -> Optional[int]:
    """vLLM's EngineCore among the job's processes: its title is VLLM::EngineCore (setproctitle), else the
    runner's child started by multiprocessing's spawn that is not its resource tracker; None if none."""
    pids = [p for p in group_pids(pgid) if p != runner]
    for pid in pids:
        if proc_name(pid).startswith("VLLM::EngineCor"):
            return pid
    for pid in pids:
        f = _stat_fields(pid)
        cmd = _cmdline(pid)
        if f is not None and int(f[1]) == runner and "spawn_main" in cmd and "resource_tracker" not in cmd:
            return pid
    return None


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_group_gone(pgid: int, timeout_s: float, seen: Optional[set] = None) -> Optional[float]:
    """Seconds until no process of the group is alive (None: some still are at the deadline). `seen`
    collects every pid met on the way."""
    t0 = time.monotonic()
    while True:
        pids = group_pids(pgid)
        if seen is not None:
            seen.update(pids)
        if not pids:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            return None
        time.sleep(0.1)


class Job:
    """`python3 runners/grpo_colocated.py ARGS` in a session of its own (its pid is its process group), stdout and
    stderr into `log`. Use as a context manager: on leaving, whatever is left of the group is killed."""

    def __init__(self, args: list[str], log: Path, env: Optional[dict] = None):
        self.args = list(args)
        self.log_path = log
        # the runner's script, not `-m colomem.runner`: -m puts the working directory (the checkout) first on
        # sys.path, ahead of the PYTHONPATH below
        self.command = [sys.executable, str(ROOT / "runners" / "grpo_colocated.py"), *self.args]
        e = dict(os.environ if env is None else env)
        # the caller's PYTHONPATH first (an installed or instrumented colomem wins), the checkout after it
        e["PYTHONPATH"] = os.pathsep.join(p for p in (e.get("PYTHONPATH", ""), str(ROOT)) if p)
        e.setdefault("PYTHONUNBUFFERED", "1")
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log, "wb")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(self.command, cwd=ROOT, env=e, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.pid = self.pgid = self.proc.pid
        self.seen: set[int] = {self.pid}

    def scan(self) -> list[int]:
        pids = group_pids(self.pgid)
        self.seen.update(pids)
        return pids

    def wait(self, timeout_s: float) -> Optional[int]:
        """The runner's exit code, or None if it did not exit in time."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        kill_group(self.pgid)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def log_lines(self) -> list[str]:
        try:
            return self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []


def read_lines(path: Path) -> tuple[list[dict], int]:
    """(the JSON objects of a JSONL file, how many non-empty lines did not parse)."""
    good, bad = [], 0
    try:
        text = path.read_text()
    except OSError:
        return [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            good.append(json.loads(line))
        except ValueError:
            bad += 1
    return good, bad


def step_lines(lines: list[dict]) -> list[dict]:
    return [d for d in lines if "phase_s" in d and "step" in d and "event" not in d]
