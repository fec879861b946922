"""The figures of a bench_grpo report that set colomem against TRL: the LoRA jobs' (each mode's step
against TRL's, the shared base's copies and memory) and, per job, the two with the same recompute.

`over_rounds(cfg, mode, key)` is the report's median of a mode's rounds (bench_grpo.top_level passes it).
"""
from __future__ import annotations

from colomem.runner.timeline import median as _median

# colomem's mode and TRL's with the same recompute (or the same micro-batch): their steps' ratio is reported
# per setting, and the best of each side against the other (each in its strongest measured setting; colomem's
# grown micro-batch is one of its settings)
RECOMPUTE_PAIRS = {"config": (("colomem", "shared"), "trl"),
                   "recompute": (("recompute", "shared_recompute"), "trl"),
                   "nogc": (("nogc", "shared_nogc"), "trl_nogc"),
                   "ckpt2": (("ckpt2",), "trl_ckpt2"), "mb32": (("mb32", "shared_mb32"), "trl_mb32"),
                   "grow": (("grow", "shared_grow"), None), "recompute_grow": (("recompute_grow",), None),
                   "compile": (("compile", "shared_compile"), "trl_compile"),
                   "trim": (("trim", "shared_trim"), None),
                   "tuned": (("tuned", "shared_tuned"), "trl_tuned"),
                   "tuned_grow": (("tuned_grow", "shared_tuned_grow"), None),
                   "kvauto": (("kvauto",), None), "tuned_kv": (("tuned_kv",), None)}


def recompute_top_level(report: dict, cfg: str, over_rounds) -> None:
    """colomem against TRL with the same recompute, per setting that both ran (`<cfg>_speedup_vs_trl_by_
    recompute`), and each side's best step against the other's (`<cfg>_speedup_vs_trl_best`: TRL in its
    strongest measured setting)."""
    ours, theirs, by = {}, {}, {}
    for setting, (modes, peer) in RECOMPUTE_PAIRS.items():
        steps = [s for s in (over_rounds(cfg, m, "step_s") for m in modes) if s is not None]
        trl = over_rounds(cfg, peer, "step_s") if peer is not None else None
        if steps:
            ours[setting] = min(steps)
        if trl is not None and (steps or peer not in (RECOMPUTE_PAIRS[k][1] for k in theirs)):
            theirs[setting] = trl      # a peer run that two settings pair with counts once, unless both ran
        if steps and trl is not None:
            by[setting] = trl / min(steps)
    # more than the plain pair (reported already): a setting of TRL's or of colomem's own beside it; the best
    # against the best also when no setting ran on both sides (colomem tuned against TRL's config, say)
    if ours and theirs and (set(ours) | set(theirs)) != {"config"}:
        if by:
            report[f"{cfg}_speedup_vs_trl_by_recompute"] = by
        report[f"{cfg}_speedup_vs_trl_best"] = min(theirs.values()) / min(ours.values())
        report[f"{cfg}_best_recompute"] = {"colomem": min(ours, key=ours.__getitem__),
                                           "trl": min(theirs, key=theirs.__getitem__)}


def lora_top_level(report: dict, over_rounds) -> None:
    """The LoRA jobs' figures: each mode's step against TRL's, the switch's share, and with the shared base
    how many copies of it the GPU held and the GPU memory beside the two-copy runs."""
    for cfg in ("lora", "lora7b"):
        trl = over_rounds(cfg, "trl", "step_s")
        for mode, tag in (("colomem", cfg), ("shared", f"{cfg}_shared"), ("shared_merged", f"{cfg}_shared_merged")):
            step = over_rounds(cfg, mode, "step_s")
            if step is None:
                continue
            report[f"{tag}_switch_fraction"] = over_rounds(cfg, mode, "switch_overhead_fraction")
            if trl:
                report[f"{tag}_speedup_vs_trl"] = trl / step
        used = {m: [over_rounds(cfg, m, "gpu_used_in_rollout_gib"), over_rounds(cfg, m, "gpu_used_in_train_gib")]
                for m in ("colomem", "inrank", "crossproc", "shared", "shared_merged", "trl")}   # trl: the peer's two copies
        used = {m: v for m, v in used.items() if any(x is not None for x in v)}
        if used:
            report[f"{cfg}_gpu_used_rollout_train_gib"] = used
        runs = [r.get("result", {}) for n, r in report["runs"].items()
                if n == f"{cfg}_shared" or n.startswith(f"{cfg}_shared_r")]
        shared = [r["shared_base"] for r in runs if r.get("status") == "ok" and r.get("shared_base")]
        if shared:
            report["lora_base_copies_on_gpu"] = max(x["lora_base_copies_on_gpu"] for x in shared)
            sync = _median([(r.get("phase_s") or {}).get("sync") for r in runs])   # the adapter alone
            if sync is not None:          # the largest LoRA job's, when both ran (lora7b comes last)
                report["adapter_sync_ms"] = sync * 1e3


__all__ = ["RECOMPUTE_PAIRS", "lora_top_level", "recompute_top_level"]
