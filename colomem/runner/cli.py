"""Command line of the colocated GRPO runner (runners/grpo_colocated.py is a thin wrapper around main)."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Optional

from colomem.errors import ColomemError

DESCRIPTION = """Colocated GRPO: vLLM rollouts and DeepSpeed training take turns on the same GPU(s).

Without arguments it runs the embedded default job: a tiny Qwen2 (random weights, tokenizer trained here)
learns the `successor` task (">345" -> "67") with GRPO. On a machine without a GPU it runs a short CPU
version of the same loop. Every flag below can also be set in a YAML file given with --config (flags win).
Several GPUs: torchrun --nproc-per-node N runners/grpo_colocated.py ... (one vLLM engine per GPU; with
--tensor-parallel-size TP, one engine per TP ranks of a node, inside the ranks: --engine in-rank).
The same job: colomem-grpo, or python -m colomem.runner.
"""


def main(argv: Optional[list[str]] = None) -> int:
    from .config import build_arg_parser, load_run_config
    from colomem.errors import ConfigError

    from .job import default_out_dir, run_job

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")           # nothing is downloaded
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    logging.basicConfig(level=logging.WARNING, format="[%(name)s] %(levelname)s %(message)s")
    parser = build_arg_parser(DESCRIPTION)
    parser.add_argument("--prepare-only", action="store_true",
                        help="build the job's inputs (a config-built model and its tokenizer into the cache, "
                             "COLOMEM_CACHE; the task or dataset and the rewards checked) and exit: on each node "
                             "of a job whose nodes share no cache, or before runs that are timed")
    if os.path.basename(sys.argv[0]) == "__main__.py":
        parser.prog = "python -m colomem.runner"
    try:
        cfg = load_run_config(argv, parser=parser)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if parser.parse_args(argv).prepare_only:
        return _prepare(cfg)
    out = Path(cfg.out) if cfg.out else default_out_dir()
    try:
        result = run_job(cfg, out_dir=out)
        if result.summary.get("status") == "interrupted":
            print(f"interrupted: {result.summary.get('error')}; outputs in {result.out_dir}", file=sys.stderr)
            _say_how_to_resume(out)
            return 130
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ColomemError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        _say_how_to_resume(out)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        _say_how_to_resume(out)
        return 130
    return 0


def _prepare(cfg) -> int:
    """--prepare-only: what a run builds before its engines start, and nothing else (no GPU memory held)."""
    from colomem.errors import ConfigError

    from .job import _task_label, job_inputs

    try:
        inputs = job_inputs(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ColomemError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"[colomem] ready: model {inputs.model_path}; trains on {_task_label(cfg)}")
    return 0


def _say_how_to_resume(out: Path) -> None:
    """After a run that stopped early: the newest checkpoint and the flags that continue from it."""
    from .checkpoints import newest

    path = newest(out / "checkpoints")
    if path is not None:
        print(f"to continue from {path.name}: run the same command with --resume auto --out {out}",
              file=sys.stderr)
