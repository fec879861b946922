#!/usr/bin/env python3
"""Colocated GRPO runner: vLLM rollouts and DeepSpeed training take turns on the same GPU.

    python runners/grpo_colocated.py                      # the embedded tiny job (short CPU run without a GPU)
    python runners/grpo_colocated.py --config configs/grpo_1p5b_full.yaml --out runs/1p5b
    torchrun --nproc-per-node 2 runners/grpo_colocated.py --prompts-per-step 64   # one engine per GPU

All logic lives in colomem.runner; `--help` lists every option, docs/colocated-training.md explains them.
"""
import sys
from pathlib import Path

if __name__ == "__main__":
    try:
        import colomem  # noqa: F401
    except ImportError:          # run from a checkout without `pip install -e .`
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from colomem.runner.cli import main

    sys.exit(main())
