#!/usr/bin/env python3
"""How the shared base's merge rounds on this GPU: W + s * B @ A into a bf16 weight, each path against the
exact sum (float64) rounded once to bf16.

    python3 benchmarks/diag_merge_rounding.py --out DIR

The paths: the one bf16 GEMM (`addmm`, with the reduced-precision flags off and on), the fp32 path (an fp32
product and sum, one rounding), and on a GPU the core's one-rounding kernel
(colomem.engines.lora_merge_kernel), with each in-place merge's GPU time. For each path: how many elements
differ from the exact sum rounded once, the largest difference in units of the last place (ulp) of that value,
how many lie outside what an fp32 sum in any order rounded once allows; and, where rounding the product to
bf16 before the add (two roundings) gives another value than one rounding, which of the two each path gave:
that tells a kernel that rounds the product first from one that does not.
Weights, factors and scaling are a Qwen2-7B layer's shapes with a trained adapter's magnitudes (B ~ N(0,
0.05)). Writes DIR/merge_rounding.json.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics

import torch


def ulp(x: torch.Tensor) -> torch.Tensor:
    """bf16's unit in the last place at each value of x (float64): 2^(exponent - 7)."""
    e = torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -126)))
    return torch.pow(2.0, e - 7)


def compare(got: torch.Tensor, exact: torch.Tensor, twice: torch.Tensor, terms: torch.Tensor, k: int) -> dict:
    """got against the exact sum rounded once (`want`) and the product rounded first (`twice`). `terms`: the
    sum of the terms' magnitudes, from which an fp32 sum of k + 1 terms in any order may stray by up to
    (k + 2) * 2^-24 of it (more than a bf16 step of a result whose terms nearly cancel)."""
    want = exact.to(torch.bfloat16)
    diff = (got.double() - exact).abs()
    fp32_bound = ulp(exact) / 2 * (1 + 2.0 ** -7) + (k + 2) * 2.0 ** -24 * terms
    split = want != twice                 # where one rounding and two roundings give different values
    return {"differ_from_one_rounding": int((got != want).sum()),
            "max_ulps_from_one_rounding": float(((got.double() - want.double()).abs() / ulp(exact)).max()),
            "outside_an_fp32_sum_rounded_once": int((diff > ulp(exact) + fp32_bound).sum()),
            "where_the_two_differ": int(split.sum()),
            "there_equal_to_one_rounding": int((got == want)[split].sum()),
            "there_equal_to_two_roundings": int((got == twice)[split].sum()),
            "elements": got.numel()}


def timings(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, s: float, layer) -> dict:
    """Each in-place merge's GPU time (CUDA events, median of 10 after 2 warm-ups), and the weight's bytes
    read and written over that time: the one GEMM, the fp32 path (an fp32 product added in place), the
    core's kernel."""
    from colomem.engines.lora import exact_matmul
    from colomem.engines.lora_merge_kernel import kernel_merge

    work = W.clone()
    paths = {"gemm": lambda: work.addmm_(B, A, alpha=s),
             "fp32": lambda: work.add_(B.float() @ A.float(), alpha=s),
             "kernel": lambda: kernel_merge(layer, work, A, B, s, in_place=True)}
    out = {}
    with exact_matmul():
        for name, run in paths.items():
            times = []
            for i in range(12):
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record()
                run()
                t1.record()
                t1.synchronize()
                if i >= 2:
                    times.append(t0.elapsed_time(t1))
            ms = statistics.median(times)
            out[name] = {"ms": ms, "weight_gbs": 2 * W.numel() * W.element_size() / ms / 1e6}
    return out


def main() -> None:
    from colomem.engines.lora import exact_matmul
    from colomem.engines.lora_merge_kernel import kernel_merge

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for mod in ("peft", "transformers"):    # imported as a job imports them: whether one turns TF32 on shows
        importlib.import_module(mod)

    m = torch.backends.cuda.matmul
    report: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
                    "allow_tf32": m.allow_tf32, "float32_matmul_precision": torch.get_float32_matmul_precision(),
                    "allow_bf16_reduced_precision_reduction": str(m.allow_bf16_reduced_precision_reduction),
                    "shapes": {}}
    layer = type("Layer", (), {"fan_in_fan_out": False})()
    for name, (out_f, in_f, r) in {"q_proj": (3584, 3584, 16), "down_proj": (3584, 18944, 16),
                                   "k_proj": (512, 3584, 16)}.items():
        W = (torch.randn(out_f, in_f, device=dev) * 0.02).to(torch.bfloat16)
        A = (torch.randn(r, in_f, device=dev) * in_f ** -0.5).to(torch.bfloat16)
        B = (torch.randn(out_f, r, device=dev) * 0.05).to(torch.bfloat16)
        s = 2.0
        exact = W.double() + s * (B.double() @ A.double())
        twice = (W.float() + (s * (B.double() @ A.double())).to(torch.bfloat16).float()).to(torch.bfloat16)
        terms = W.double().abs() + s * (B.double().abs() @ A.double().abs())
        row = {}
        with exact_matmul():
            gemm = torch.addmm(W, B, A, alpha=s)
            fp32 = (W.float() + s * (B.float() @ A.float())).to(torch.bfloat16)
            inplace = W.clone()
            inplace.addmm_(B, A, alpha=s)
        row["gemm"] = compare(gemm, exact, twice, terms, r)
        row["gemm_in_place_equals_gemm"] = bool(torch.equal(inplace, gemm))
        row["fp32"] = compare(fp32, exact, twice, terms, r)
        row["gemm_default_flags"] = compare(torch.addmm(W, B, A, alpha=s), exact, twice, terms, r)
        row["fp32_default_flags"] = compare((W.float() + s * (B.float() @ A.float())).to(torch.bfloat16), exact,
                                            twice, terms, r)
        if dev == "cuda":            # the core's kernel (its host reference is too slow for these shapes)
            row["kernel"] = compare(kernel_merge(layer, W, A, B, s, in_place=False), exact, twice, terms, r)
            row["merge_in_place_ms"] = timings(W, A, B, s, layer)
        report["shapes"][name] = row
        print(name, json.dumps(row))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "merge_rounding.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
