"""The performance targets in one JSON: each figure read from the committed result file that measured it.

    python3 benchmarks/targets.py --out benchmarks/results/<date>-<host>/targets.json

The top level holds every target's figure (None where no run measured it), `detail` says for each where it
comes from, its target, whether it is met and what the figure is; a markdown table goes beside the JSON. No
figure is typed in here: each is read from a result file under benchmarks/results/ (the files name the
commands that made them in their folder's COMMANDS.md). Runs on a CPU; moving a figure to a newer run is a
change of its `source` below."""
from __future__ import annotations

import argparse
import json
import operator
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Target:
    key: str
    op: str                       # ">=" or "<="
    target: Optional[float]       # None: a figure to report, no threshold
    source: str                   # a result file, relative to benchmarks/results/
    read: Callable[[Any], Optional[float]]
    what: str
    more: tuple = ()              # further result files of the same measurement (other rounds): the figure is
    #                               the median of every file's, each file's own figure listed beside it


def key(name: str) -> Callable[[Any], Optional[float]]:
    return lambda d: d.get(name)


def least_of(*names: str) -> Callable[[Any], Optional[float]]:
    """The smallest of the figures `names` that a result file has: a speedup against the strongest of several
    baselines measured in it."""
    def read(d):
        vals = [d[n] for n in names if d.get(n) is not None]
        return min(vals) if vals else None
    return read


def median_of(figure: str, *names: str) -> Callable[[Any], Optional[float]]:
    """The median of `figure` over the runs `names` of one result file (e.g. two launches)."""
    def read(d):
        vals = [d[n][figure] for n in names if d.get(n, {}).get(figure) is not None]
        return statistics.median(vals) if vals else None
    return read


def ratio_of(figure: str, over: str, under: str) -> Callable[[Any], Optional[float]]:
    """figure[over] / figure[under] of one result file (e.g. TRL's step over a mode's measured beside it)."""
    def read(d):
        f = d.get(figure) or {}
        return f[over] / f[under] if f.get(over) and f.get(under) else None
    return read


# result files several targets read
LORA7B_RUN = "2026-12-07-h100/call8/grpobench/grpo_bench.json"
FULL_RUN = "2026-12-07-h100b/call1/grpobench/grpo_bench.json"
# the same comparison again, two rounds in two calls on another H100 (round 1: colomem first, round 2: TRL first)
FULL_RUN_MORE = ("2026-12-07-h100c/call1/grpobench/grpo_bench.json", "2026-12-07-h100c/call3/grpobench/grpo_bench.json")
WALL_RUN = "2026-12-05-h200/call1/wall/transfer.json"


TARGETS = [
    Target("speedup_vs_trl", ">=", 1.8, FULL_RUN, ratio_of("step_s_by_mode", "trl", "colomem"),
           "1.5B full fine-tune, CUDA graphs, each tool in the config's setting: TRL 1.16 GRPOTrainer colocate's "
           "step over colomem's default (the planner's placement with vLLM releasing only the part of its KV "
           "cache training needs, vLLM in the trainer's process), each round's ratio of the medians of steps "
           "2-4 measured in one call; the median of three rounds: one on one H100, two on another (slower and "
           "noisier: its rollout of the same work took 2.1-3.8 s)", more=FULL_RUN_MORE),
    Target("whole_run_speedup_vs_trl", ">=", None, FULL_RUN, ratio_of("wall_s_by_mode_warm", "trl", "colomem"),
           "the same runs as what a caller waits for: TRL's run over colomem's, each process from launch to exit, "
           "start-up and 4 steps; the first run of each call filled vLLM's compile cache (colomem in two "
           "rounds, one of them the fresh machine's first run, TRL in the third)", more=FULL_RUN_MORE),
    Target("speedup_vs_trl_both_recompute", ">=", 1.8, "2026-12-06-h100/call4/grpobench/grpo_bench.json",
           key("speedup_vs_trl"),
           "the same job with colomem recomputing every layer too (as the default did before the trim); one "
           "round, another H100 of the same speed"),
    Target("speedup_vs_trl_planner", ">=", 1.8, "2026-12-06-h100/call4/grpobench/grpo_bench.json",
           key("full_speedup_vs_trl_best"),
           "the same run: colomem with --torch-compile --trim-recompute --grow-micro-batch (the planner turned "
           "recompute off and kept the micro-batch) against TRL in the config's setting"),
    Target("speedup_vs_trl_tuned", ">=", 1.8, "2026-12-06-h200/full-two-rounds/grpo_bench.json",
           key("full_speedup_vs_trl_best"),
           "the same job, best against best: TRL colocate compiled without recompute over colomem with "
           "--torch-compile --trim-recompute, the medians of two rounds in two calls on one H200"),
    Target("speedup_vs_all_resident", ">=", 1.0, "2026-12-07-h200c/call3/grpobench/grpo_bench.json",
           least_of("speedup_vs_all_resident", "speedup_vs_all_resident_nogc"),
           "the same job: nothing moving, forced (--offload none --rollout-sleep never), over the planner's (which "
           "chose nothing moving); one launch each, 4 steps, one H200. Most of it is the planner's recompute "
           "trim (no layer recomputed from step 2 on), which the forced placement, measuring nothing, does not "
           "take; the forced run's rollout was the faster (2.26 against 3.24 s). Against the stronger of `still` "
           "and `still_nogc` (nothing moving, no recompute) where a file has both"),
    Target("speedup_vs_resident", ">=", 1.0, "2026-12-04-h200/call24/grpobench/alternate_figures.json",
           lambda d: median_of("speedup_vs_resident", "full_alternate", "full_alternate_r2")(d["runs"]),
           "the same job: trainer resident with vLLM sleeping over nothing moving, both in one process step by "
           "step (--rollout-sleep alternate), median of two launches"),
    Target("switch_overhead_fraction_graphs", "<=", 0.005, "2026-12-03-h200/call3/grpobench/grpo_bench.json",
           key("switch_overhead_fraction"), "the same job: the planner's switch over its step (nothing moves)"),
    Target("offload_needed_switch_fraction", "<=", 0.02, "2026-12-04-h200/call26/grpobench/grpo_bench.json",
           key("offload_needed_switch_fraction"),
           "a job that does not fit with nothing moving: the 7.6B full fine-tune (the moments out behind the "
           "rollout, back inside the optimizer step)"),
    Target("bigkv_switch_fraction", "<=", 0.02, "2026-12-07-h200c/call2/grpobench/grpo_bench.json",
           key("bigkv_switch_fraction"),
           "the 1.5B full fine-tune beside a 112.5 GiB KV cache, CUDA graphs, the KV cache released in part "
           "(44 GiB of it; the whole KV sleep: 0.099 in the same call), median of the steps after the first"),
    Target("full7b_step_s", "<=", None, "2026-12-04-h200/call20/grpobench/grpo_bench.json", key("full7b_step_s"),
           "Qwen2-7B-shaped full fine-tune on one H200 (fp32 masters and Adam on the GPU), seconds a step"),
    Target("lora7b_speedup_vs_trl", ">=", 1.5, LORA7B_RUN,
           key("lora7b_shared_merged_speedup_vs_trl"), "7B LoRA job, one copy of the base with the adapter merged "
           "into it for each rollout (--shared-base --shared-base-rollout merged; the default trim: no layer "
           "recomputed), against TRL colocate LoRA in its config's setting (every layer recomputed, the adapter "
           "merged into vLLM's weights); the medians of two rounds in opposite order, one H100"),
    Target("lora7b_switch_fraction", "<=", 0.005, "2026-12-07-h200c/call3/grpobench2/grpo_bench.json",
           key("lora7b_shared_merged_switch_fraction"),
           "the same 7B LoRA job's switch over its step, the merge written into the base in place (through fp32: "
           "one rounding, 41 ms a merge) and the base's restore copy held on the GPU, the median of the four "
           "steps after the first, one H200"),
    Target("offload_wall_vs_peak", ">=", 0.97, WALL_RUN,
           key("offload_wall_vs_peak_worst"),
           "wall clock (release and re-growth included), worst of three shapes, median of cycles with the first"),
    Target("reload_wall_vs_peak", ">=", 0.97, WALL_RUN,
           key("reload_wall_vs_peak_worst"), "the same, reloads"),
    Target("reload_wall_vs_peak_first_cycle", ">=", 0.97, WALL_RUN,
           key("reload_wall_vs_peak_first_cycle_worst"), "the process's very first reload, worst shape"),
    Target("offload_wall_vs_peak_mapped", ">=", 0.97, WALL_RUN, key("mapped_offload_wall_vs_peak_worst"),
           "the same sets in memory colomem maps itself (CUDA VMM, unmapped and mapped back chunk by chunk: what "
           "--optimizer-state-memory mapped keeps Adam's moments in), worst shape, median of cycles with the first"),
    Target("reload_wall_vs_peak_mapped", ">=", 0.97, WALL_RUN, key("mapped_reload_wall_vs_peak_worst"),
           "the same, reloads"),
    Target("offload_wall_vs_peak_mapped_first_cycle", ">=", 0.97, WALL_RUN,
           key("mapped_offload_first_wall_vs_peak_worst"), "the process's very first offload of mapped memory"),
    Target("reload_wall_vs_peak_mapped_first_cycle", ">=", 0.97, WALL_RUN,
           key("mapped_reload_first_wall_vs_peak_worst"), "the process's very first reload into mapped memory"),
    Target("small_tensors_wall_vs_peak", ">=", 0.8, "2026-12-02-h200/fifth-session/call4/small/transfer.json",
           key("small_tensors_wall_vs_peak"), "20,000 small tensors (1.39 GB, mixed dtypes), both directions"),
    Target("sync_inloop_vs_peak", ">=", 0.9, "2026-12-02-h200/syncinloop/bench_sync_inloop.json",
           key("sync_inloop_best_bucket_vs_peak"),
           "the loop's weight sync from the pool's host copies (1.5B set), the loop's bucket size"),
]


def evaluate(results: Path = RESULTS) -> dict:
    """{key: figure, ..., "detail": {key: {...}}} for every target."""
    out: dict = {}
    detail: dict = {}
    for t in TARGETS:
        value, error, each = None, None, []
        try:
            each = [t.read(json.loads((results / s).read_text())) for s in (t.source, *t.more)]
            found = [v for v in each if v is not None]
            value = (found[0] if len(each) == 1 else statistics.median(found)) if found else None
        except (OSError, ValueError, KeyError, TypeError) as e:
            error = f"{type(e).__name__}: {e}"
        met = None
        if value is not None and t.target is not None:
            met = {">=": operator.ge, "<=": operator.le}[t.op](value, t.target)
        out[t.key] = value
        detail[t.key] = {"value": value, "target": None if t.target is None else f"{t.op} {t.target}", "met": met,
                         "source": f"benchmarks/results/{t.source}", "what": t.what,
                         **({"rounds": {f"benchmarks/results/{s}": v for s, v in zip((t.source, *t.more), each)}}
                            if t.more else {}),
                         **({"error": error} if error else {})}
    out["detail"] = detail
    return out


def markdown(report: dict) -> str:
    rows = ["| figure | value | target | met | source |", "| --- | --- | --- | --- | --- |"]
    for k, d in report["detail"].items():
        v = d["value"]
        shown = "-" if v is None else f"{v:.4g}"
        met = {True: "yes", False: "no", None: "-"}[d["met"]]
        where = "<br>".join(f"`{src}` ({'-' if x is None else f'{x:.4g}'})" for src, x in d["rounds"].items()) \
            if "rounds" in d else f"`{d['source']}`"
        rows.append(f"| `{k}` | {shown} | {d['target'] or '-'} | {met} | {where} |")
    return "\n".join(rows) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON to write (a .md table goes beside it)")
    a = ap.parse_args(argv)
    report = evaluate()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1) + "\n")
    a.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
