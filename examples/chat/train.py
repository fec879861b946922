"""The chat example from Python: the rows made in memory and the reward passed as a function, through
colomem.runner.train (the way TRL's GRPOTrainer takes them). The same job as examples/README.md's command.

    python examples/chat/train.py [--steps 100] [--backend cpu] [--out runs/chat-py]
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _load(path: Path) -> Any:
    """A module of the examples folder by its file (the folder is not a package)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(**options: Any) -> Any:
    """The job, with `options` as train() keywords over the example's (steps, backend, out, ...)."""
    from colomem.runner import train

    train_rows, eval_rows = _load(HERE.parent / "data" / "make_datasets.py").splits("count-chat")
    reward = _load(HERE / "rewards.py").digits_in_place
    return train(reward_funcs=reward, train_dataset=train_rows, eval_dataset=eval_rows,
                 config=HERE / "config.yaml", chat_template=str(HERE / "template.jinja"), max_new_tokens=3,
                 **options)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--backend", default="cpu", choices=["auto", "cpu", "gpu"])
    p.add_argument("--out", default="runs/chat-py")
    a = p.parse_args(argv)
    s = run(steps=a.steps, backend=a.backend, out=a.out).summary
    print(f"reward {s.get('reward_first5_mean')} -> {s.get('reward_last5_mean')} (first / last 5 steps); "
          f"held-out {s['eval_first']['eval/reward_mean']:.3f} -> {s['eval_last']['eval/reward_mean']:.3f}; "
          f"files in {a.out}")
    return 0 if s["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
