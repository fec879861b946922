"""Checkpoints of a run and resuming from them.

    <out>/checkpoints/step-<N>/
        model/          the policy in Hugging Face format (from_pretrained loads it; the peft adapter with
                        LoRA) and the tokenizer
        model-merged/   with --save-merged and LoRA: the full model, the adapter merged
        trainer*.pt     what training needs to continue exactly (weights, optimizer, steps, RNG): trainer.pt
                        from the CPU trainer, trainer-rank<R>.pt per rank from the DeepSpeed trainer
        state.json      format, step, weight version, what model and data the run trained on

A checkpoint is written into a temporary folder and renamed into place, so a crash or a full disk never
leaves a half checkpoint under a step-<N> name, and the previous ones stay intact; only the last
`keep` are kept. The runner saves while the trainer is offloaded (right after the next step's offload, or
after offloading it once more at the end), so the trainer state is read from the pool's host copies.
`--resume auto` continues from the newest one under the output directory.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

from colomem.engines.protocols import Checkpointable
from colomem.errors import ColomemError, ConfigError

FORMAT = 1
PREFIX = "step-"


def identity(cfg: Any, backend: str = "cpu", world_size: int = 1) -> dict:
    """What a checkpoint must match to be resumed by this run (the trainer's layout included: the DeepSpeed
    trainer's state is one file per rank, sharded by ZeRO)."""
    trainer = "deepspeed" if backend == "gpu" else "torch"
    return {"model": cfg.model or f"config-built:{cfg.model_shape}", "lora": cfg.lora is not None,
            "data": cfg.dataset or f"task:{cfg.task}", "seed": cfg.seed, "trainer": trainer,
            "world_size": world_size, **({"zero_stage": cfg.zero_stage} if trainer == "deepspeed" else {})}


def _steps(root: Path) -> list[tuple[int, Path]]:
    found = []
    for p in root.glob(PREFIX + "*") if root.is_dir() else ():
        tail = p.name[len(PREFIX):]
        if tail.isdigit() and (p / "state.json").is_file():
            found.append((int(tail), p))
    return sorted(found)


def newest(root: Path) -> Optional[Path]:
    """The newest complete checkpoint under root (what `--resume auto` picks), None when there is none."""
    found = _steps(root)
    return found[-1][1] if found else None


class CheckpointError(ColomemError):
    """A checkpoint could not be written (full disk, permissions); the earlier ones are intact."""


def _tmp(root: Path, step: int) -> Path:
    return root / f".tmp-{PREFIX}{step}"


def _finish(root: Path, tmp: Path, *, step: int, version: int, tokenizer: Any, ident: dict, keep: int) -> Path:
    final = root / f"{PREFIX}{step}"
    tokenizer.save_pretrained(tmp / "model")
    if (tmp / "model-merged").is_dir():
        tokenizer.save_pretrained(tmp / "model-merged")
    (tmp / "state.json").write_text(json.dumps({"format": FORMAT, "step": step, "weight_version": version,
                                                **ident}, indent=1) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for _, old in _steps(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save(root: Path, *, step: int, version: int, trainer: Checkpointable, tokenizer: Any, ident: dict,
         keep: int, ranks: Any = None, merged: bool = False) -> Optional[Path]:
    """Writes step-<step> atomically (every rank its part of the trainer state into a temporary folder, then
    rank 0 renames it into place) and drops all but the newest `keep`; returns its path on rank 0.
    CheckpointError when writing fails: the temporary folder is removed, the earlier checkpoints stay."""
    main = ranks is None or ranks.is_main
    tmp = _tmp(root, step)
    try:
        if main:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        if ranks is not None:
            ranks.barrier(f"checkpoint step-{step}: folder ready")
        trainer.save_state(tmp, merged=merged)
        if ranks is not None:
            ranks.barrier(f"checkpoint step-{step}: every rank wrote its part")
        return _finish(root, tmp, step=step, version=version, tokenizer=tokenizer, ident=ident, keep=keep) \
            if main else None
    except BaseException as e:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)     # the earlier checkpoints are untouched
        # ours already say what to do; an interrupt is no write failure
        if isinstance(e, ColomemError) or not isinstance(e, Exception):
            raise
        # OSError, or a library's writer (safetensors, torch) failing on the disk
        kept = [p.name for _, p in _steps(root)]
        cause = (f"{e.strerror} ({e.filename or 'a checkpoint file'})" if isinstance(e, OSError) and e.strerror
                 else f"{type(e).__name__}: {e}")
        raise CheckpointError(f"writing checkpoint {PREFIX}{step} under {str(root)!r} failed: {cause}; free disk "
                              f"space or choose another --out. Earlier checkpoints are intact: "
                              f"{', '.join(kept) or 'none'}") from e


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
    """When to save (every `every` steps, after the last, and when a signal stops the run) and the saving;
    every rank has one (each writes its part of the trainer state)."""

    def __init__(self, root: Path, trainer: Checkpointable, tokenizer: Any, ident: dict, every: Optional[int],
                 keep: int, total_steps: int, ranks: Any = None, merged: bool = False, log=print):
        self.root, self.trainer, self.tokenizer, self.ident = root, trainer, tokenizer, ident
        self.every, self.keep, self.total, self.log = every, keep, total_steps, log
        self.ranks, self.merged = ranks, merged
        self.saved: list[Path] = []
        self.seconds: list[float] = []

    def due(self, done: int, final: bool = False) -> bool:
        """After `done` steps: a multiple of `every` or the last step (with `every` set), or the run stops
        here on a signal (`final`, always)."""
        return bool((self.every and (done % self.every == 0 or done == self.total)) or final)

    def saved_step(self, done: int) -> bool:
        """Whether this run already saved the state after `done` steps."""
        return any(p.name == f"{PREFIX}{done}" for p in self.saved)

    def save(self, done: int, version: int) -> Optional[Path]:
        t0 = time.perf_counter()
        path = save(self.root, step=done, version=version, trainer=self.trainer, tokenizer=self.tokenizer,
                    ident=self.ident, keep=self.keep, ranks=self.ranks, merged=self.merged)
        self.seconds.append(time.perf_counter() - t0)
        if path is not None:
            self.saved.append(path)
            self.log(f"[colomem] checkpoint {path} ({self.seconds[-1]:.2f} s)")
        return path


__all__ = ["CheckpointError", "Checkpointer", "FORMAT", "find", "identity", "load_state", "newest", "save"]
