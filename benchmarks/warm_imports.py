#!/usr/bin/env python3
"""Imports the GPU kit's packages once, so a fresh machine compiles their Python files (and builds DeepSpeed's
FusedAdam with its JIT) outside any timed run.

    python3 benchmarks/warm_imports.py [MODULE ...]     (default: vllm deepspeed transformers peft trl)

On a fresh GPU machine this takes about a minute, what the first timed run would otherwise pay. Modules that
are not installed are left out. benchmarks/gpu_run.sh starts it in the background while the core builds;
bench_grpo.py runs it again before its runs (seconds, once it has run). Prints one JSON line: the modules
imported, the seconds, the return code and the error's tail."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time

DEFAULT = ("vllm", "deepspeed", "transformers", "peft", "trl")


def warm(modules, timeout_s: float, cwd=None) -> dict:
    """Imports `modules` (those installed) in a fresh interpreter; with deepspeed, loads FusedAdam where a GPU
    is visible. Returns {"modules", "seconds", "rc", "error_tail"}."""
    mods = [m for m in dict.fromkeys(modules) if importlib.util.find_spec(m) is not None]
    if not mods:
        return {"modules": [], "seconds": 0.0, "rc": None, "error_tail": None}
    code = "import " + ", ".join(mods)
    if "deepspeed" in mods:     # and DeepSpeed's FusedAdam, built by its JIT at the first use on a machine
        code += ("\nimport torch\nif torch.cuda.is_available():\n"
                 "    from deepspeed.ops.op_builder import FusedAdamBuilder\n    FusedAdamBuilder().load()")
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
        rc, err = p.returncode, (p.stderr[-1500:] if p.returncode else None)
    except subprocess.TimeoutExpired:
        rc, err = "timeout", f"the imports ran past {timeout_s:.0f} s"
    return {"modules": mods, "seconds": time.perf_counter() - t0, "rc": rc, "error_tail": err}


if __name__ == "__main__":
    print(json.dumps(warm(sys.argv[1:] or DEFAULT, timeout_s=600)), flush=True)
