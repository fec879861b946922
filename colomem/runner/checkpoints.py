"""Checkpoints of a run and resuming from them.

    <out>/checkpoints/step-<N>/
        model/          the policy in Hugging Face format (from_pretrained loads it; the peft adapter with
                        LoRA) and the tokenizer
        trainer.pt      what training needs to continue exactly (weights, optimizer, steps, RNG)
        state.json      format, step, weight version, what model and data the run trained on

A checkpoint is written into a temporary folder and renamed into place, so a crash or a full disk never
leaves a half checkpoint under a step-<N> name, and the previous ones stay intact; only the last
`keep` are kept. `--resume auto` continues from the newest one under the output directory.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

from colomem.engines.protocols import Checkpointable
from colomem.errors import ConfigError

FORMAT = 1
PREFIX = "step-"


def identity(cfg: Any) -> dict:
    """What a checkpoint must match to be resumed by this run."""
    return {"model": cfg.model or f"config-built:{cfg.model_shape}", "lora": cfg.lora is not None,
            "data": cfg.dataset or f"task:{cfg.task}", "seed": cfg.seed}


def _steps(root: Path) -> list[tuple[int, Path]]:
    found = []
    for p in root.glob(PREFIX + "*") if root.is_dir() else ():
        tail = p.name[len(PREFIX):]
        if tail.isdigit() and (p / "state.json").is_file():
            found.append((int(tail), p))
    return sorted(found)


def save(root: Path, *, step: int, version: int, trainer: Checkpointable, tokenizer: Any, ident: dict,
         keep: int) -> Path:
    """Writes step-<step> atomically and drops all but the newest `keep`; returns its path."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step}"
    tmp = root / f".tmp-{PREFIX}{step}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        trainer.save_state(tmp)
        tokenizer.save_pretrained(tmp / "model")
        (tmp / "state.json").write_text(json.dumps({"format": FORMAT, "step": step, "weight_version": version,
                                                    **ident}, indent=1) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)      # the earlier checkpoints are untouched
        raise
    for _, old in _steps(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def find(resume: str, root: Path) -> Path:
    """The checkpoint `--resume` names (`auto`: the newest under root). ConfigError when there is none."""
    if resume == "auto":
        found = _steps(root)
        if not found:
            raise ConfigError(f"--resume auto: no checkpoint under {str(root)!r} (a run writes them with "
                              "--save-every N); start without --resume")
        return found[-1][1]
    path = Path(resume).expanduser()
    if not (path / "state.json").is_file():
        raise ConfigError(f"--resume {resume!r}: not a checkpoint folder (no state.json); give a "
                          f"{PREFIX}<N> folder under <out>/checkpoints, or auto")
    return path


def load_state(path: Path, ident: dict) -> dict:
    """state.json of a checkpoint, checked against this run (format and identity)."""
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"checkpoint {str(path)!r}: unreadable state.json ({e})") from None
    if not isinstance(state, dict) or int(state.get("format", 0)) > FORMAT:
        raise ConfigError(f"checkpoint {str(path)!r} has format {state.get('format')!r}; this colomem reads "
                          f"format {FORMAT} and older: upgrade colomem")
    other = {k: (state.get(k), v) for k, v in ident.items() if state.get(k) != v}
    if other:
        raise ConfigError(f"checkpoint {str(path)!r} is of another run: " +
                          "; ".join(f"{k} {a!r} there, {b!r} here" for k, (a, b) in other.items()))
    return state


class Checkpointer:
    """Saves every `every` steps and after the last; the runner calls after_step(k) with the steps done."""

    def __init__(self, root: Path, trainer: Checkpointable, tokenizer: Any, ident: dict, every: Optional[int],
                 keep: int, total_steps: int, log=print):
        self.root, self.trainer, self.tokenizer, self.ident = root, trainer, tokenizer, ident
        self.every, self.keep, self.total, self.log = every, keep, total_steps, log
        self.saved: list[Path] = []

    def after_step(self, done: int, version: int, final: bool = False) -> Optional[Path]:
        """Saves when `done` is a multiple of `every` or the last step (with `every` set), or when the run
        stops here on a signal (`final`, always)."""
        if not ((self.every and (done % self.every == 0 or done == self.total)) or final):
            return None
        path = save(self.root, step=done, version=version, trainer=self.trainer, tokenizer=self.tokenizer,
                    ident=self.ident, keep=self.keep)
        self.saved.append(path)
        self.log(f"[colomem] checkpoint {path}")
        return path


__all__ = ["Checkpointer", "FORMAT", "find", "identity", "load_state", "save"]
