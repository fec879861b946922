"""Faults injected into the running default job, and whether the job survives each (GPU host).

    python3 benchmarks/faults.py --out DIR [--faults engine_rollout,engine_sync,...] [-- runner args]

Each fault runs the default job (`python3 runners/grpo_colocated.py`, configs/default.yaml) as a subprocess in a
session of its own, waits for the phase to hit by reading the job's `status.json` (the runner rewrites it
when a phase starts), injects the fault, and checks what follows:

  engine_rollout  vLLM's EngineCore SIGKILLed while the rollout generates
  engine_sync     the EngineCore SIGKILLed during the weight sync
  trainer_sync    the trainer (the runner's process) SIGKILLed during the weight sync: the EngineCore must end
                  on its own (its trainer watch) instead of holding its GPU memory as an orphan
  sigterm_step    SIGTERM to the runner while the rollout generates: it finishes the step, saves, stops
  sigterm_group   SIGTERM to the whole process group while the rollout generates (what Slurm and
                  Kubernetes send): vLLM shuts down at once, the step fails; the checkpoint of an earlier
                  step must still be there
  wake_oom        vLLM's wake runs out of GPU memory: --gpu-memory-utilization too high for what stays on
                  the GPU while it wakes (the bridge's buffers, --bucket-bytes 4GiB x 2, appear only at
                  the first sync, after vLLM sized its KV cache)

For each: the wall time to exit and what bounds it, the exit code, the last error line the user sees, no
process of the job left alive and none holding GPU memory (nvidia-smi --query-compute-apps, /proc scanned for
the process group), metrics.jsonl parsing line by line, and a checkpoint. The faults that leave one run as a
chain in one output folder with --save-every 1: each run after the first resumes from the checkpoint the
previous fault left (--resume auto) and must finish 2 steps before its own fault, and a last run resumes
from the last checkpoint for 2 more steps. The sync faults use --bucket-bytes 1MiB, so the sync spans
several buckets. Output: DIR/faults.json (faults_tried, faults_survived, a record per fault) and a log per run.
Every wait has a deadline and every job ends with its whole process group killed, so a bug here cannot
hang the GPU call.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from job_procs import (Job, engine_pid, gpu_used_mib, group_pids, proc_name, read_lines, step_lines,  # noqa: E402
                       wait_gpu_released, wait_group_gone)

HELD_MIB = 512          # GPU memory in use after a run beyond what was before it that counts as held


@dataclass
class Fault:
    phase: Optional[str]             # the phase to hit (None: the fault is in the job's arguments)
    action: Optional[str]            # kill_engine, kill_trainer, sigterm_runner, sigterm_group
    expect: str                      # what the error line must say (a regular expression)
    bounded_by: str
    codes: Optional[tuple] = (1,)    # the runner's exit codes expected (None: it is killed, not checked)
    checkpoint: bool = True          # a checkpoint must be left, and it must resume
    args: list = field(default_factory=list)


SYNC_ARGS = ["--bucket-bytes", "1MiB"]
FAULTS: dict[str, Fault] = {
    "engine_rollout": Fault("rollout", "kill_engine", r"engine process died during generate \(killed by SIGKILL",
                            "vLLM's client sees its engine process die at once (EngineDeadError); a hung engine is "
                            "bounded by generate_timeout_s (1800 s), then the runner's close kills it"),
    "engine_sync": Fault("sync", "kill_engine", r"weight sync to vLLM failed: .*died|engine process died",
                         "the bridge socket closes with the engine; the ACK wait is bounded by rpc_timeout_s "
                         "(120 s)", args=SYNC_ARGS),
    "trainer_sync": Fault("sync", "kill_trainer", r"trainer process \d+ that started this vLLM engine is gone",
                          "the worker's bucket receive ends with the socket (bounded by rpc_timeout_s, 120 s); the "
                          "EngineCore's trainer watch polls every 1 s, asks vLLM to shut down, SIGKILLs after 10 s",
                          codes=None, args=SYNC_ARGS),
    "sigterm_step": Fault("rollout", "sigterm_runner", r"^interrupted: interrupted \(SIGTERM\)",
                          "the step under way finishes (each phase bounded by --phase-timeout-s, 900 s), then "
                          "the checkpoint is written", codes=(130,)),
    "sigterm_group": Fault("rollout", "sigterm_group", r"^(error|interrupted)",
                           "vLLM's EngineCore aborts its requests and exits on SIGTERM: the step fails at once "
                           "(1); a runner without an engine process finishes the step and stops (130)",
                           codes=(1, 130)),
    "wake_oom": Fault(None, None, r"out of GPU memory in phase 'wake_(kv|weights)'.*--gpu-memory-utilization",
                      "checked before the wake (free memory against what the wake maps): at once; the wake "
                      "itself is bounded by wake_timeout_s (300 s)", checkpoint=False,
                      args=["--gpu-memory-utilization", "0.97", "--bucket-bytes", "4GiB", "--steps", "3"]),
}
CHAIN_ORDER = ("engine_rollout", "engine_sync", "trainer_sync", "sigterm_step", "sigterm_group")
# the trainer watch's line comes from the EngineCore, whose output vLLM prefixes with "(EngineCore pid=N) "
ERROR_LINE = re.compile(r"^(error:|interrupted|(\(EngineCore[^)]*\) )?\[colomem\] the trainer process)")


def read_status(path: Path) -> Optional[dict]:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def newest_checkpoint(out: Path) -> Optional[int]:
    steps = [int(p.name[5:]) for p in (out / "checkpoints").glob("step-*")
             if p.name[5:].isdigit() and (p / "state.json").is_file()]
    return max(steps) if steps else None


def wait_for_phase(job: Job, status: Path, step: int, phase: str, deadline: float) -> tuple[Optional[dict], Optional[int]]:
    """Polls status.json (every 0.5 ms) until the job runs `phase` of a step >= `step`; (status, engine pid)."""
    engine = None
    while time.monotonic() < deadline and job.proc.poll() is None:
        st = read_status(status)
        if st and st.get("pid") == job.pid and st.get("state") == "running":
            if engine is None:
                job.scan()
                engine = engine_pid(job.pgid, job.pid)
            if (st.get("step") or 0) >= step and st.get("phase") == phase:
                return st, engine
        time.sleep(0.0005)
    return None, engine


def inject(job: Job, action: str, engine: Optional[int]) -> Optional[str]:
    """Does it; returns why it could not."""
    if action == "kill_engine":
        if engine is None:
            return "no VLLM::EngineCore process found in the job's process group"
        os.kill(engine, signal.SIGKILL)
    elif action == "kill_trainer":
        os.kill(job.pid, signal.SIGKILL)
    elif action == "sigterm_runner":
        os.kill(job.pid, signal.SIGTERM)
    elif action == "sigterm_group":
        os.killpg(job.pgid, signal.SIGTERM)
    return None


def run_one(name: str, fault: Fault, out: Path, job_args: list, target_step: int, a) -> dict:
    """One job with one fault; the record of what happened."""
    metrics, status = out / "metrics.jsonl", out / "status.json"
    before = len(read_lines(metrics)[0])
    rec: dict = {"fault": name, "target_phase": fault.phase, "target_step": target_step, "bounded_by": fault.bounded_by,
                 "gpu_used_before_mib": gpu_used_mib()}
    with Job(job_args, out.parent / f"{name}.log") as job:
        rec["command"] = shlex.join(["python3", "runners/grpo_colocated.py", *job_args])
        t_inject = None
        if fault.action is not None:
            st, engine = wait_for_phase(job, status, target_step, fault.phase, time.monotonic() + a.job_timeout_s)
            if st is None:
                rec["error"] = f"the job never reached phase {fault.phase!r} of step {target_step} (it ended or timed out)"
            else:
                why = inject(job, fault.action, engine)
                t_inject = time.monotonic()
                rec.update(injected_step=st.get("step"), injected_phase=st.get("phase"), engine_pid=engine)
                if engine is not None:
                    rec["engine_name"] = proc_name(engine)
                if why:
                    rec["error"] = why
        t_from = t_inject if t_inject is not None else job.t0
        if t_inject is not None:
            code = job.wait(max(1.0, a.exit_timeout_s - (time.monotonic() - t_from)))
        elif fault.action is not None:            # never injected: the job ended early or is past its deadline
            code = job.wait(1.0)
        else:
            code = job.wait(a.job_timeout_s)
        rec["runner_exit_s"] = time.monotonic() - t_from if code is not None else None
        rec["exit_code"] = code
        rec["hung"] = code is None
        gone = wait_group_gone(job.pgid, a.orphan_timeout_s, job.seen)
        rec["group_gone_after_runner_s"] = gone
        rec["exit_s"] = (time.monotonic() - t_from) if gone is not None and code is not None else None
        left = group_pids(job.pgid)
        rec["left_alive"] = [{"pid": p, "name": proc_name(p)} for p in left]
        apps, rec["gpu_released_after_s"] = wait_gpu_released(job.seen, a.orphan_timeout_s)
        rec["gpu_held_by_job_mib"] = None if apps is None else {str(p): m for p, m in apps.items() if p in job.seen}
        rec["gpu_apps_after"] = None if apps is None else {str(p): m for p, m in apps.items()}
        rec["gpu_used_after_mib"] = gpu_used_mib()
        rec["job_pids_seen"] = sorted(job.seen)
    # the harness killed the group on leaving the with-block: what is left now is a real orphan
    rec["alive_after_kill"] = group_pids(job.pgid)
    lines = job.log_lines()
    errors = [ln for ln in lines if ERROR_LINE.search(ln)]
    rec["error_line"] = errors[-1] if errors else None
    rec["resume_hint"] = next((ln for ln in reversed(lines) if ln.startswith("to continue from")), None)
    rec["last_lines"] = [ln for ln in lines if ln.strip()][-3:]
    parsed, bad = read_lines(metrics)
    mine = parsed[before:]
    failed = [d for d in step_lines(mine) if d.get("failed")]
    rec["metrics_lines"], rec["metrics_bad_lines"] = len(mine), bad
    rec["failed_line"] = {"step": failed[-1]["step"], "failed": failed[-1]["failed"],
                          "error": failed[-1].get("error")} if failed else None
    rec["steps_done"] = [d["step"] for d in step_lines(mine) if not d.get("failed")]
    rec["end_line"] = next((d for d in reversed(mine) if d.get("event") == "end"), None)
    final = read_status(status)
    rec["status_after"] = {k: final.get(k) for k in ("state", "step", "phase")} if final else None
    # where the fault landed: the failed step's phase, or the phase the killed trainer was in
    if fault.action == "kill_trainer":
        rec["landed"] = final.get("phase") if final and final.get("state") == "running" else None
    elif failed:
        rec["landed"] = failed[-1]["failed"]
    else:
        rec["landed"] = rec.get("injected_phase")
    rec["checkpoint_after"] = newest_checkpoint(out)
    checks = {
        "exited_in_time": not rec["hung"] and rec["exit_s"] is not None,
        "exit_code": fault.codes is None or code in fault.codes,
        "message": bool(rec["error_line"] and re.search(fault.expect, rec["error_line"])),
        "no_process_left": not rec["left_alive"] and not rec["alive_after_kill"],
        "no_gpu_memory_held": not rec["gpu_held_by_job_mib"] and (
            rec["gpu_used_before_mib"] is None or rec["gpu_used_after_mib"] is None
            or rec["gpu_used_after_mib"] - rec["gpu_used_before_mib"] < HELD_MIB),
        "metrics_parse": bad == 0 and rec["metrics_lines"] > 0,
        "landed_in_target_phase": fault.phase is None or rec["landed"] == fault.phase,
        "checkpoint": not fault.checkpoint or rec["checkpoint_after"] is not None,
    }
    if fault.checkpoint and fault.action != "kill_trainer":
        checks["resume_hint"] = rec["resume_hint"] is not None
    rec["checks"] = checks
    if rec.get("error"):
        checks["injected"] = False
    return rec


def resumed(rec: dict, start: int, steps_done: list) -> None:
    """The next run resumed from `rec`'s checkpoint: it finished the 2 steps after it."""
    ok = start in steps_done and start + 1 in steps_done
    rec["resumed"] = {"from": f"step-{start}", "steps_done_after": [s for s in steps_done if s >= start][:4],
                      "ok": ok}
    rec["checks"]["resumes"] = ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--faults", default=",".join(CHAIN_ORDER + ("wake_oom",)),
                   help=f"comma list of {', '.join(FAULTS)} (chained ones run in this order: {', '.join(CHAIN_ORDER)})")
    p.add_argument("--first-step", type=int, default=2, help="0-based step of the first fault (a checkpoint before it)")
    p.add_argument("--steps-between", type=int, default=2, help="steps a resumed run finishes before its fault")
    p.add_argument("--job-timeout-s", type=float, default=300.0, help="longest a job may take to reach its fault")
    p.add_argument("--exit-timeout-s", type=float, default=180.0, help="longest the runner may take to exit after it")
    p.add_argument("--orphan-timeout-s", type=float, default=45.0,
                   help="longest the job's other processes may outlive the runner")
    p.add_argument("--time-budget-s", type=float, default=560.0,
                   help="no job starts once less than --min-job-s of this is left")
    p.add_argument("--min-job-s", type=float, default=100.0)
    p.add_argument("runner_args", nargs="*", help="after --: more arguments for every job")
    a = p.parse_args(argv)
    chosen = [f.strip() for f in a.faults.split(",") if f.strip()]
    unknown = [f for f in chosen if f not in FAULTS]
    if unknown:
        p.error(f"unknown faults {unknown}; choose from {', '.join(FAULTS)}")
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    base = ["--no-progress", "--no-plots", "--report-to", "none", *a.runner_args]
    records, skipped = [], []

    def time_left() -> bool:
        return a.time_budget_s - (time.monotonic() - t0) >= a.min_job_s

    chain_dir = a.out / "chain" / "job"
    prev: Optional[dict] = None
    for name in [f for f in CHAIN_ORDER if f in chosen]:
        if not time_left():
            skipped.append(name)
            continue
        fault = FAULTS[name]
        start = newest_checkpoint(chain_dir)
        args = [*base, "--out", str(chain_dir), "--save-every", "1", *fault.args]
        if start is not None:
            args += ["--resume", "auto"]
        target = a.first_step if start is None else start + a.steps_between
        print(f"[faults] {name}: {fault.action} in phase {fault.phase!r} of step {target}", flush=True)
        rec = run_one(name, fault, chain_dir, args, target, a)
        if prev is not None and start is not None:
            resumed(prev, start, rec["steps_done"])
        records.append(rec)
        prev = rec
        print(f"[faults] {name}: {json.dumps(rec['checks'])}", flush=True)
    if prev is not None and prev["checkpoint_after"] is not None:
        if time_left():           # the last checkpoint of the chain, resumed for 2 steps to a normal end
            start = prev["checkpoint_after"]
            args = [*base, "--out", str(chain_dir), "--save-every", "1", "--resume", "auto", "--steps", str(start + 2)]
            final = run_one("final_resume", Fault(None, None, r".", "-", codes=(0,), checkpoint=False), chain_dir, args,
                            start, a)
            resumed(prev, start, final["steps_done"])
            final["checks"]["message"] = True         # no error expected: the exit code 0 says it
            records.append(final)
        else:
            skipped.append("final_resume")
    if "wake_oom" in chosen:
        if time_left():
            fault = FAULTS["wake_oom"]
            d = a.out / "wake_oom" / "job"
            rec = run_one("wake_oom", fault, d, [*base, "--out", str(d), *fault.args], 0, a)
            rec["landed_in_startup"] = rec["landed"] is None
            records.append(rec)
        else:
            skipped.append("wake_oom")
    tried = [r for r in records if r["fault"] in FAULTS]
    for r in records:
        fault = FAULTS.get(r["fault"])
        if fault is not None and fault.checkpoint:
            # a checkpoint nobody resumed from (the chain ran out of time) is not proof the fault was survived
            r["checks"].setdefault("resumes", None)
        r["survived"] = all(r["checks"].values())
    untested = [r["fault"] for r in records if r["checks"].get("resumes", True) is None]
    result = {
        "faults_tried": len(tried),
        "faults_survived": sum(r["survived"] for r in tried),
        "final_resume_ok": next((r["survived"] for r in records if r["fault"] == "final_resume"), None),
        "skipped_for_time": skipped,
        "resume_not_tried": untested,
        "command": shlex.join(["python3", "benchmarks/faults.py", *(argv if argv is not None else sys.argv[1:])]),
        "seconds": time.monotonic() - t0,
        "bounds": {"job_timeout_s": a.job_timeout_s, "exit_timeout_s": a.exit_timeout_s,
                   "orphan_timeout_s": a.orphan_timeout_s},
        "survived_means": "every check of the record holds: exited within exit_timeout_s, the exit code expected, "
                          "the error line names the fault, no process of the job alive after orphan_timeout_s, "
                          "none holding GPU memory, metrics.jsonl parses line by line, the fault hit its phase, "
                          "a checkpoint is left and the next run resumed from it for 2 steps",
        "faults": records,
    }
    (a.out / "faults.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"[faults] {result['faults_survived']} of {result['faults_tried']} survived; {a.out / 'faults.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
