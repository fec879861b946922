#!/usr/bin/env python3
"""Colocated GRPO with colomem against the same job time-split without it, on a 1.5B-shaped model.

    python3 benchmarks/bench_grpo.py --out runs/grpobench                        # full and LoRA, both modes
    python3 benchmarks/bench_grpo.py --out runs/grpobench --configs full --run-default
    python3 benchmarks/bench_grpo.py --out runs/grpobench --configs lora         # merges into the same JSON

Each run is `runners/grpo_colocated.py --config configs/grpo_1p5b_<full|lora>.yaml` with a mode's flags in a
fresh process (its outputs under --out/<config>_<mode>[_r<round>]/):
  colomem      the default: the placement planner (--offload auto): the first step moves everything and
               measures, later steps move only what does not fit (nothing, when both sides fit), and with
               gradient checkpointing recompute only the layers the free memory requires (--trim-recompute auto)
  recompute, shared_recompute  the default (a LoRA job's shared base) with --trim-recompute false: every
               checkpointed layer recomputed, as the config says and TRL's run of it does (like for like)
  recompute_grow  recompute with --grow-micro-batch: the free memory spent on a larger micro-batch instead of
               fewer recomputed layers
  colomem_all  --offload all --rollout-sleep always: trainer state through the pinned pool every step, vLLM
               level-2 sleep, weights refilled by the bridge (colomem's switch with nothing left in place)
  resident     --offload none --rollout-sleep always: the trainer stays, vLLM sleeps (verl's and TRL's layout)
  still        --offload none --rollout-sleep never: nothing moves, whether or not the planner would choose it
  still_nogc   the same without gradient checkpointing (a forced placement cannot trim the recompute: this is
               nothing-moves' fastest setting where the activations fit)
  timesplit    DeepSpeed engine.offload_states()/reload_states() and vLLM level-1 sleep (weights backed up by vLLM)
  enginerng    the default with --rollout-seeding engine: vLLM's own generator, seeded once, as TRL samples
  batchednoise the default's --seeded-noise batched named: the seeded requests' noise of a step in one launch
  vllmnoise    the default with --seeded-noise vllm: vLLM's sampler draws each seeded request's noise itself
  overlap      the default with --overlap-offload: the optimizer state copies out behind the weights' wake
  expandable   the default with --trainer-expandable: all of the trainer's memory in expandable segments
  hidden       the default with --trainer-expandable and --overlap-offload
  mapped       the default with --optimizer-state-memory mapped
  wholesleep   the default with --kv-release all: vLLM's whole sleep where the planner puts it to sleep
  kvtail       the default with --kv-release tail: the KV cache's released part lent as every layer's tail,
               mapped back only as the rollout's blocks run short
  kvlayers     the default with --kv-release layers: that part in whole layers, mapped back before each rollout
  saved        the default with a checkpoint every other step (--save-every 2, written beside the next step)
  nogc, ckpt2  the default without gradient checkpointing, and checkpointing every other decoder layer
  mb32, grow   the default with micro-batches of 32 rows, and with --grow-micro-batch (the largest that fits)
  shared_nogc  a LoRA job's --shared-base without gradient checkpointing
  shared_mb32, shared_grow  a LoRA job's --shared-base with micro-batches of 32 rows, and grown
  compile, shared_compile  the default (a LoRA job's shared base) with --torch-compile
  trim, shared_trim  the same with --trim-recompute (the default's own choice where it measures); tuned,
               shared_tuned: with both
  tuned_grow, shared_tuned_grow  tuned with --grow-micro-batch (the micro-batch grows in what the trim leaves)
  kvauto, tuned_kv  the default, and tuned_grow, with --kv-cache-bytes auto (vLLM keeps the KV cache the
               rollout can hold, the trainer the rest)
All sync the trained weights through the same bridge. More modes run a peer on the same job instead of the
runner (benchmarks/bench_trl.py, the same config and --extra flags; skipped with the reason when TRL is not
importable):
  trl          TRL's GRPOTrainer, vLLM colocated in its process, trainer resident, vLLM awake (no sleep)
  trl_sleep    the same with vllm_enable_sleep_mode (vLLM level-2 sleep after each generation)
  trl_nogc, trl_ckpt2, trl_mb32, trl_compile, trl_tuned  TRL with the recompute of nogc / ckpt2, mb32's
               micro-batch, the same decoder-layer parts compiled as --torch-compile compiles, or those
               compiled and no checkpointing: per job,
               <job>_speedup_vs_trl_by_recompute sets
               each pair side by side, and <job>_speedup_vs_trl_best each side's best step (TRL in its strongest
               measured setting) against the other's
Their vLLM runs eager exactly when the runner's does in this call (the config's enforce_eager and --extra).
--rounds 2 runs the modes A B C A B C (interleaved); each mode's figures are then the medians over its rounds.
Rounds that do not fit one device call go over several: --continue-from an earlier call's grpo_bench.json
carries its runs into this call's report, and this call's rounds are numbered after the last one there.

Reported per run (medians over the steps after the first, which pays one-time pinning): step time, switch time
(offload, barriers, wake, sync, check, sleep, reload) and its share of the step, each phase, GPU memory in use
while both sides sleep, what the trainer process still reserves after its offload, and the logprob gap
between rollout and trainer (the check that the rollout really used the trained weights).
Writes grpo_bench.json (top level: default_steps, reward_first5_mean, reward_last5_mean from the default run,
switch_overhead_fraction for the 1.5B full fine-tune, speedup_vs_<mode>: that mode's step median over the
default colomem mode's, e.g. speedup_vs_timesplit, speedup_vs_trl) and grpo_bench.md; prints the table.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))   # a fallback: an installed colomem or PYTHONPATH's comes first

from colomem.runner.timeline import median as _median  # noqa: E402  (the runner's median: one figure per median)

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))
from grpo_alternate import alternate_figures  # noqa: E402
from grpo_modes import CONFIGS, MODES, PEER_MODULES, PEER_ONLY_FLAGS, PEER_SCRIPTS, VERSUS  # noqa: E402
from grpo_peer_figures import lora_top_level, recompute_top_level  # noqa: E402
from grpo_table import table  # noqa: E402
from stage_deadline import bound_or_skip  # noqa: E402
import warm_imports  # noqa: E402

GiB = float(1 << 30)


def _read_jsonl(path: Path) -> list:
    out = []
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def _env() -> dict:
    env = {"python": sys.version.split()[0]}
    try:
        import torch
        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["gpu_gib"] = round(torch.cuda.get_device_properties(0).total_memory / GiB, 1)
    except ImportError:
        pass
    for mod in ("vllm", "deepspeed", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001  (a missing package is just not reported)
            pass
    return env


def round_of(name: str) -> int:
    """A run's round, from its name (<config>_<mode>[_r<round>])."""
    head, _, tail = name.rpartition("_r")
    return int(tail) if head and tail.isdigit() else 1


def run_name(cfg: str, mode: str, rnd: int) -> str:
    return f"{cfg}_{mode}" + (f"_r{rnd}" if rnd > 1 else "")


def continued(path: Path, configs: list, modes: list, rounds: int, first_round: int | None) -> tuple[dict, int]:
    """The runs of an earlier call's report and the first round of this call (after the last round there,
    unless given). Refuses, before anything runs, a round that would replace a run of that report."""
    try:
        earlier = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--continue-from {path}: not a readable grpo_bench.json ({e})") from None
    runs = earlier.get("runs") if isinstance(earlier, dict) else None
    if not isinstance(runs, dict):
        raise SystemExit(f"--continue-from {path}: no 'runs' in it: not a grpo_bench.json")
    last = max((round_of(n) for n in runs), default=0)
    first = first_round if first_round is not None else last + 1
    clash = sorted({run_name(c, m, r) for c in configs for m in modes for r in range(first, first + rounds)}
                   & set(runs))
    if clash:
        raise SystemExit(f"--continue-from {path} holds {', '.join(clash)} already: start at round {last + 1} "
                         "(--first-round, or leave it out)")
    return earlier, first


def run_one(name: str, args: list[str], out_dir: Path, timeout_s: float,
            script: str = "runners/grpo_colocated.py") -> dict:
    """Runs the colocated runner (or a peer's script) in a fresh process; returns rc, wall time, log tail."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(ROOT / script), *args, "--out", str(out_dir), "--no-progress"]
    if script == "runners/grpo_colocated.py":
        cmd.append("--no-save-final")   # TRL's harness saves nothing either (save_strategy "no"): training alone
    log_path = out_dir / "run.log"
    print(f"[bench] {name}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)          # the runner and its vLLM engine process
            p.wait()
            rc = "timeout"
    wall = time.perf_counter() - t0
    tail = log_path.read_text()[-2500:]
    print(f"[bench] {name}: rc={rc} in {wall:.0f} s", flush=True)
    return {"rc": rc, "wall_s": wall, "log_tail": tail, "cmd": cmd}


def analyse(out_dir: Path) -> dict:
    """Figures of one run from its summary.json and metrics.jsonl."""
    summary = json.loads((out_dir / "summary.json").read_text()) if (out_dir / "summary.json").is_file() else {}
    lines = _read_jsonl(out_dir / "metrics.jsonl")
    steps = [r for r in lines if "phase_s" in r and not r.get("failed")]
    warm = steps[1:] if len(steps) > 1 else steps
    res = {"status": summary.get("status"), "error": summary.get("error"), "steps_done": len(steps),
           "build_s": summary.get("build_s"), "startup_s": summary.get("startup_s"),
           "backend": summary.get("backend"),
           "model_shape": (summary.get("config") or {}).get("model_shape"),
           "vllm_enforce_eager": (summary.get("trl") or {}).get("vllm_enforce_eager",
                                                                (summary.get("config") or {}).get("enforce_eager"))}
    if not steps:
        return res
    phases = sorted({p for r in warm for p in r["phase_s"]})
    mem = lambda r, ph, k: (r.get("memory", {}).get(ph) or {}).get(k)  # noqa: E731
    gaps = [r.get("train/rollout_logprob_gap") for r in steps]
    res.update({
        "step_s": _median([r["step_s"] for r in warm]),
        "switch_s": _median([r["switch_s"] for r in warm]),
        "switch_overhead_fraction": _median([r["switch_s"] / r["step_s"] for r in warm if r["step_s"]]),
        "phase_s": {p: _median([r["phase_s"].get(p) for r in warm]) for p in phases},
        "first_step": {"step_s": steps[0]["step_s"], "switch_s": steps[0]["switch_s"],
                       "phase_s": steps[0]["phase_s"]},
        "first_step_s": steps[0]["step_s"],
        # from the job's start line to its first step's (a step line's time is when the step began)
        "first_step_after_s": next((steps[0]["time"] - r["time"] for r in lines
                                    if r.get("event") == "start" and "time" in r and "time" in steps[0]), None),
        "step_s_spread": [min(r["step_s"] for r in warm), max(r["step_s"] for r in warm)],
        "placement": summary.get("placement"),
        # what the planner changed after its measuring step (a grown micro-batch, fewer checkpointed layers),
        # and whether the trainer's layers ran compiled
        "planner_changes": next(({k: r.get(k) for k in ("micro_batch_grown", "recompute_trimmed")}
                                 for r in reversed(lines) if r.get("event") == "placement"), None),
        "torch_compile": (summary.get("config") or {}).get("torch_compile"),
        # the decoder layers each step's backward recomputed (colomem's runner says; a peer's run may not)
        "recomputed_layers": [r.get("train/recomputed_layers") for r in steps],
        "gpu_used_both_asleep_gib": _gib(max((mem(r, "sleep", "driver_used") or 0) for r in steps)),
        "trainer_reserved_after_offload_gib": _gib(max((mem(r, "offload", "reserved") or 0) for r in steps)),
        "gpu_used_in_rollout_gib": _gib(max((mem(r, "rollout", "driver_used") or 0) for r in steps)),
        "gpu_used_in_train_gib": _gib(max((mem(r, "train", "driver_used") or 0) for r in steps)),
        "pinned_host_gib": _gib(max((mem(r, "train", "pinned_host") or 0) for r in steps)),
        "offload_bytes": _median([r.get("trainer_offload/moved_bytes") for r in warm]),
        "offload_gbps": _median([r.get("trainer_offload/gbps") for r in warm]),
        "reload_gbps": _median([r.get("trainer_reload/gbps") for r in warm]),  # right after vLLM's sleep
        "sync_bytes": _median([r.get("sync/nbytes") for r in warm]),
        "rollout_logprob_gap_max": max([g for g in gaps if g is not None], default=None),
        "samples_per_step": steps[-1].get("samples_total"),
        "completion_len_mean": _median([r.get("completion_len_mean") for r in warm]),
        "shared_base": summary.get("shared_base"),
        # a merged shared base's merge (GPU time) and restore, and the garbage collector's pauses (a phase it
        # interrupted is not a slow phase)
        "shared_base_merge_s": _median([r.get("shared_base/merge_s") for r in warm]),
        "shared_base_restore_s": _median([r.get("shared_base/restore_s") for r in warm]),
        "gc_s": _median([r.get("host/gc_s") for r in warm]),
        "gc_max_s": max([r["host/gc_max_s"] for r in steps if r.get("host/gc_max_s") is not None], default=None),
        "gc_phase_s": {k[3:-2]: _median([r.get(k, 0.0) for r in warm])
                       for k in sorted({k for r in warm for k in r if k.startswith("gc/")})},
        # each checkpoint: what the run waited for it (gathering the state, and any wait for its write at the
        # next step) against the write itself, which runs beside the next step with --save-background
        "checkpoints": [{"step": r["checkpoint/step"], "seconds": r.get("checkpoint/seconds"),
                         "write_seconds": r.get("checkpoint/write_seconds")}
                        for r in lines if "checkpoint/step" in r],
    })
    alt = alternate_figures(steps)
    if alt is not None:
        res["alternate"] = alt
    return res


def _gib(n):
    return None if not n else round(n / GiB, 3)


def top_level(report: dict) -> None:
    runs = report["runs"]

    def res(name):
        return runs.get(name, {}).get("result", {})
    def over_rounds(cfg, mode, key):      # the median of a mode's rounds
        vals = [r.get("result", {}).get(key) for n, r in runs.items()
                if n == f"{cfg}_{mode}" or n.startswith(f"{cfg}_{mode}_r")]
        return _median(vals)
    full_c, full_t = res("full_colomem"), res("full_timesplit")
    report["switch_overhead_fraction"] = over_rounds("full", "colomem", "switch_overhead_fraction")
    step_c = over_rounds("full", "colomem", "step_s")
    def by_mode(key):                      # the full fine-tune's modes that ran: mode -> median over rounds
        vals = {m: over_rounds("full", m, key) for m in MODES}
        return {m: v for m, v in vals.items() if v is not None}
    report["step_s_by_mode"] = by_mode("step_s")
    report["first_step_s_by_mode"] = by_mode("first_step_s")
    report["wall_s_by_mode"] = by_mode("run_wall_s")
    # what a caller waits for, start-up included (the run's process from launch to exit), against TRL's: from
    # each mode's rounds after its first, which compiled vLLM's graphs for that mode's settings (TRL's engine
    # compiles its own); a mode that ran once counts as it ran
    def warm_wall(mode):
        names = sorted((n for n in runs if n == f"full_{mode}" or n.startswith(f"full_{mode}_r")),
                       key=lambda n: (n != f"full_{mode}", len(n), n))
        return _median([runs[n].get("result", {}).get("run_wall_s") for n in names[1:] or names])
    warm = {m: warm_wall(m) for m in MODES}
    warm = {m: v for m, v in warm.items() if v is not None}
    if warm:
        report["wall_s_by_mode_warm"] = warm
        if warm.get("colomem") and warm.get("trl"):
            report["whole_run_speedup_vs_trl"] = warm["trl"] / warm["colomem"]
    for mode, key in VERSUS.items():
        other = report["step_s_by_mode"].get(mode)
        if step_c and other:
            report[key] = other / step_c
    if full_c.get("switch_s") and full_t.get("switch_s"):
        report["switch_speedup_vs_timesplit"] = full_t["switch_s"] / full_c["switch_s"]
    lora_c, lora_t = res("lora_colomem"), res("lora_timesplit")
    if lora_c.get("step_s") and lora_t.get("step_s"):
        report["speedup_vs_timesplit_lora"] = lora_t["step_s"] / lora_c["step_s"]
        report["switch_overhead_fraction_lora"] = lora_c.get("switch_overhead_fraction")
    lora_top_level(report, over_rounds)
    for cfg in ("full", "lora7b"):
        recompute_top_level(report, cfg, over_rounds)
    # jobs that do not fit with nothing moving: what the planner moves costs this share of a step
    for cfg in ("bigkv", "full7b"):
        fracs = {m: over_rounds(cfg, m, "switch_overhead_fraction")
                 for m in ("colomem", "overlap", "expandable", "hidden", "mapped", "wholesleep", "kvtail",
                           "kvlayers")}
        fracs = {m: f for m, f in fracs.items() if f is not None}
        if fracs:
            report[f"{cfg}_switch_fraction_by_mode"] = fracs
            # the defaults' figure (the overlapped offload's beside it until it is the default)
            frac = fracs.get("colomem", fracs.get("overlap"))
            report[f"{cfg}_switch_fraction"] = frac
            report.setdefault("offload_needed_switch_fraction", frac)     # the 1.5B job's when both ran
            report[f"{cfg}_placement"] = (res(f"{cfg}_colomem").get("placement") or {}).get("label")
    alt = res("full_alternate").get("alternate") or {}
    if alt.get("speedup_vs_resident") is not None:     # the layouts in turn in one process
        report["speedup_vs_resident_alternate"] = alt["speedup_vs_resident"]
        report["alternate"] = alt
    full7b = over_rounds("full7b", "colomem", "step_s")
    if full7b is not None:
        report["full7b_step_s"] = full7b
    full7b_mapped = over_rounds("full7b", "mapped", "step_s")
    if full7b_mapped is not None:
        report["full7b_step_s_mapped"] = full7b_mapped
    # the switch does not grow with the batch, the work does: the share at longer steps
    if full_c.get("switch_s") and full_c.get("step_s"):
        sw, work = full_c["switch_s"], full_c["step_s"] - full_c["switch_s"]
        report["switch_overhead_fraction_if_work_x"] = {str(k): sw / (sw + k * work) for k in (2, 4, 8, 16)}


def runner_eager(args: list[str]) -> bool:
    """Whether the runner's vLLM runs eager with these flags (its config's enforce_eager, then the flags)."""
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))   # a fallback: an installed colomem or PYTHONPATH's comes first
    from colomem.runner.config import load_run_config

    return bool(load_run_config(args).enforce_eager)


def run_peer(mode: str, name: str, args: list[str], out_dir: Path, timeout_s: float) -> dict:
    """A peer's mode: its script on the same job (the runner's flags), its vLLM eager exactly when the
    runner's is; skipped, with the reason, when the peer's package is not importable."""
    module = PEER_MODULES[mode]
    if importlib.util.find_spec(module) is None:
        why = f"{module} is not importable here (pip install it to run the {mode} mode)"
        print(f"[bench] {name}: skipped: {why}", flush=True)
        return {"rc": "skipped", "wall_s": 0.0, "result": {"status": "skipped", "error": why}}
    eager = runner_eager([a for a in args if a not in PEER_ONLY_FLAGS])      # the peer's own flags left out
    info = run_one(name, args + (["--eager"] if eager else []), out_dir, timeout_s, script=PEER_SCRIPTS[mode])
    info["result"] = analyse(out_dir)
    info["result"]["run_wall_s"] = info["wall_s"]
    return info


def read_default(path: Path) -> dict:
    """default_steps and the reward at the start and end of the default job (a run dir or its metrics.jsonl)."""
    p = path / "metrics.jsonl" if path.is_dir() else path
    steps = [r for r in _read_jsonl(p) if r.get("reward_mean") is not None and not r.get("failed")]
    if not steps:
        return {"default_error": f"no step records in {p}"}
    r = [s["reward_mean"] for s in steps]
    out = {"default_steps": len(steps), "reward_first5_mean": sum(r[:5]) / len(r[:5]),
           "reward_last5_mean": sum(r[-5:]) / len(r[-5:]), "default_metrics": str(p)}
    acc = [s.get("accuracy") for s in steps if s.get("accuracy") is not None]
    if acc:
        out.update(accuracy_first5_mean=sum(acc[:5]) / len(acc[:5]), accuracy_last5_mean=sum(acc[-5:]) / len(acc[-5:]))
    summary = (p.parent / "summary.json")
    if summary.is_file():
        s = json.loads(summary.read_text())
        out["default_switch_overhead_fraction"] = s.get("switch_overhead_fraction")
        out["default_step_s"] = s.get("step_s_median")
        out["default_backend"] = s.get("backend")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (JSON, markdown, per-run outputs)")
    ap.add_argument("--configs", default="full,lora", help="comma list of: " + ", ".join(CONFIGS))
    ap.add_argument("--modes", default="colomem,timesplit", help="comma list of: " + ", ".join(MODES))
    ap.add_argument("--rounds", type=int, default=1, help="runs of each mode, interleaved (A B A B)")
    ap.add_argument("--continue-from", help="an earlier call's grpo_bench.json: its runs join this report")
    ap.add_argument("--first-round", type=int, help="number of this call's first round (default: 1, or after "
                                                      "the last round of --continue-from)")
    ap.add_argument("--steps", type=int, default=5, help="steps per run (the first is a warm-up)")
    ap.add_argument("--extra", action="append", default=[],
                    help="extra runner flags for every 1.5B run, e.g. '--prompts-per-step 64' (may be given again: "
                         "--extra=--no-enforce-eager --extra=--micro-batch=32)")
    ap.add_argument("--run-timeout-s", type=float, default=480.0)
    ap.add_argument("--peer-timeout-s", type=float, default=480.0, help="bound on each run of a peer's mode (trl)")
    ap.add_argument("--first-run-extra-s", type=float, default=60.0,
                    help="added to the bound of a call's first run, which fills vLLM's compile cache on a fresh "
                         "machine (its torch.compile took 26 s there against 5 s from the cache)")
    ap.add_argument("--run-default", action="store_true", help="also run the default tiny job (40 steps)")
    ap.add_argument("--default-run", help="an existing default run (directory or metrics.jsonl) to report")
    ap.add_argument("--figures-only", action="store_true", help="run nothing: read the figures of the runs "
                    "already under --out (one folder each) into its report, e.g. after a call cut a run short")
    a = ap.parse_args(argv)
    a.extra = " ".join(a.extra)
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    for bad, known, what in ((set(configs) - set(CONFIGS), CONFIGS, "config"), (set(modes) - set(MODES), MODES, "mode")):
        if bad:
            ap.error(f"unknown {what} {sorted(bad)}; choose from {sorted(known)}")
    if a.first_round is not None and a.first_round < 1:
        ap.error(f"--first-round must be 1 or more, got {a.first_round}")
    earlier, first_round = ({}, a.first_round or 1) if not a.continue_from else \
        continued(Path(a.continue_from), configs, modes, a.rounds, a.first_round)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    jpath = out / "grpo_bench.json"
    report = json.loads(jpath.read_text()) if jpath.is_file() else {}
    report.setdefault("runs", {})
    if earlier:
        report["runs"] = {**earlier["runs"], **report["runs"]}
        report["calls"] = [*earlier.get("calls", [{"environment": earlier.get("environment"),
                                                    "first_run": earlier.get("first_run"),
                                                    "runs": sorted(earlier["runs"])}]), *report.get("calls", [])]
        report["continued_from"] = str(a.continue_from)

    def save():
        top_level(report)
        report["table_markdown"] = table(report["runs"], lambda cfg: ROOT / CONFIGS[cfg])
        jpath.write_text(json.dumps(report, indent=1, default=str) + "\n")
        (out / "grpo_bench.md").write_text(
            "# Colocated GRPO: colomem vs time-split (1.5B-shaped model)\n\n"
            f"Command: `python3 benchmarks/bench_grpo.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n\n"
            + report["table_markdown"] + "\n")

    if a.figures_only:
        for d in sorted(p for p in out.iterdir() if (p / "metrics.jsonl").is_file()):
            info = report["runs"].setdefault(d.name, {"rc": "unknown (read after the call)"})
            info["result"] = {**analyse(d), "run_wall_s": info.get("wall_s")}
        save()
        print(json.dumps({k: v for k, v in report.items() if k not in ("runs", "table_markdown")}, indent=1,
                         default=str))
        return 0

    report["environment"] = _env()
    this_call: list = []
    report.setdefault("calls", []).append({"environment": report["environment"], "first_run": None,
                                           "runs": this_call})

    if a.run_default:
        d = out / "default"
        report["default_run"] = run_one("default", [], d, a.run_timeout_s)
        report.update(read_default(d))
        save()
    elif a.default_run:
        report.update(read_default(Path(a.default_run)))
        save()

    # a fresh machine compiles every package's Python files at their first import (tens of seconds for vLLM):
    # done here, outside the timed runs, so the first run does not pay it for the ones after it
    report["warm_imports"] = warm_imports.warm(("vllm", "deepspeed", "transformers", "peft",
                                                *(PEER_MODULES[m] for m in modes if m in PEER_MODULES)),
                                               a.run_timeout_s, ROOT)
    for cfg in configs:
        # the config-built model goes into the cache before any timed run: no mode pays for building it (the
        # first run of a call still fills vLLM's compile cache, which later runs load: `first_run` says which)
        bound = bound_or_skip(cfg, a.run_timeout_s)
        if bound is None:
            continue
        prep = run_one(f"{cfg}_prepare", ["--config", str(ROOT / CONFIGS[cfg]), *a.extra.split(), "--prepare-only"],
                       out / f"{cfg}_prepare", bound)
        report.setdefault("prepare", {})[cfg] = {"rc": prep["rc"], "wall_s": prep["wall_s"]}
        for rnd in range(first_round, first_round + a.rounds):
            for mode in modes:
                name = run_name(cfg, mode, rnd)
                args = ["--config", str(ROOT / CONFIGS[cfg]), *MODES[mode], "--steps", str(a.steps)]
                args += a.extra.split()
                d = out / name
                requested = a.peer_timeout_s if mode in PEER_SCRIPTS else a.run_timeout_s
                bound = bound_or_skip(name, requested + (0.0 if this_call else a.first_run_extra_s))
                if bound is None:       # the stage ends before a run could: what finished is saved
                    continue
                if mode in PEER_SCRIPTS:
                    info = run_peer(mode, name, args, d, bound)
                else:
                    info = run_one(name, args, d, bound)
                    info["result"] = analyse(d)
                    info["result"]["run_wall_s"] = info["wall_s"]
                report["runs"][name] = info
                report.setdefault("first_run", name)
                this_call.append(name)
                report["calls"][-1]["first_run"] = this_call[0]
                save()                  # on disk after every run: a later timeout keeps what finished

    save()
    print()
    print(report["table_markdown"])
    keys = ("default_steps", "reward_first5_mean", "reward_last5_mean", "switch_overhead_fraction",
            "step_s_by_mode", *VERSUS.values(), "speedup_vs_timesplit_lora")
    print("\n" + json.dumps({k: report.get(k) for k in keys}, indent=1))
    for n, r in sorted(report["runs"].items()):
        if r.get("result", {}).get("status") == "skipped":
            print(f"[bench] {n}: skipped: {r['result'].get('error')}")
    bad = [n for n, r in report["runs"].items() if r.get("result", {}).get("status") not in ("ok", "skipped")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
