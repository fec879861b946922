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
Those copies stay as they are until the trainer's next offload, so the files are written in a thread while
the rollout and the training go on, and the runner ends the write before that offload (a resident trainer's
state is copied to the host first). A crash during the write leaves only the temporary folder.
`--resume auto` continues from the newest one under the output directory.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, NoReturn, Optional

from colomem.engines.background import Background
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


MODEL_DIRS = ("model", "model-merged")      # what prepare_save writes: the model, and with LoRA the merged one


def save_tokenizer(tokenizer: Any, folder: Path) -> None:
    """The tokenizer beside each model folder under `folder`, so each loads on its own."""
    for sub in MODEL_DIRS:
        if (folder / sub).is_dir():
            tokenizer.save_pretrained(folder / sub)


def write_failure(e: BaseException, what: str) -> str:
    """A failed write as an error names it: the system's reason and the file, or the writer's own error."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror} ({e.filename or what})"
    return f"{type(e).__name__}: {e}"


def _finish(root: Path, tmp: Path, *, step: int, version: int, tokenizer: Any, ident: dict, keep: int) -> Path:
    final = root / f"{PREFIX}{step}"
    save_tokenizer(tokenizer, tmp)
    (tmp / "state.json").write_text(json.dumps({"format": FORMAT, "step": step, "weight_version": version,
                                                **ident}, indent=1) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for _, old in _steps(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _raise_failed(root: Path, step: int, e: BaseException) -> NoReturn:
    """Raises what a failed write raises: ours and interrupts as they are, anything else as CheckpointError."""
    if isinstance(e, ColomemError) or not isinstance(e, Exception):
        raise e                     # ours already say what to do; an interrupt is no write failure
    # OSError, or a library's writer (safetensors, torch) failing on the disk
    kept = [p.name for _, p in _steps(root)]
    cause = write_failure(e, "a checkpoint file")
    raise CheckpointError(f"writing checkpoint {PREFIX}{step} under {str(root)!r} failed: {cause}; free disk "
                          f"space or choose another --out. Earlier checkpoints are intact: {', '.join(kept) or 'none'}"
                          ) from e


class _Save:
    """One checkpoint on its way: the trainer's files prepared (prepare_save), written in a thread or at once,
    then finished (every rank done, rank 0 renames it into place)."""

    def __init__(self, root: Path, step: int, version: int, trainer: Checkpointable, ranks: Any, merged: bool):
        self.root, self.step, self.version, self.ranks = root, step, version, ranks
        self.main = ranks is None or ranks.is_main
        self.tmp = _tmp(root, step)
        self.thread: Optional[Background] = None
        try:
            if self.main:
                root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(self.tmp, ignore_errors=True)
            if ranks is not None:
                ranks.barrier(f"checkpoint step-{step}: folder ready")
            self.pending = trainer.prepare_save(self.tmp, merged=merged)
        except BaseException as e:
            self._clean()
            _raise_failed(root, step, e)

    def start(self) -> None:
        """The files written in a thread of their own; finish() collects it."""
        self.thread = Background(self.pending.write, f"checkpoint {PREFIX}{self.step}")

    def finish(self, timeout: float, **kw) -> Optional[Path]:
        """Waits for the files (written now when no thread writes them), then as save(); the path on rank 0."""
        try:
            if self.thread is None:
                self.pending.write()
            else:
                self.thread.result(timeout)
            if self.ranks is not None:
                self.ranks.barrier(f"checkpoint step-{self.step}: every rank wrote its part")
            return _finish(self.root, self.tmp, step=self.step, version=self.version, **kw) if self.main else None
        except BaseException as e:
            if self.thread is None or self.thread.done:
                self._clean()
            _raise_failed(self.root, self.step, e)

    def _clean(self) -> None:
        if self.main:
            shutil.rmtree(self.tmp, ignore_errors=True)     # the earlier checkpoints are untouched


def save(root: Path, *, step: int, version: int, trainer: Checkpointable, tokenizer: Any, ident: dict,
         keep: int, ranks: Any = None, merged: bool = False, timeout: float = 3600.0) -> Optional[Path]:
    """Writes step-<step> atomically (every rank its part of the trainer state into a temporary folder, then
    rank 0 renames it into place) and drops all but the newest `keep`; returns its path on rank 0.
    CheckpointError when writing fails: the temporary folder is removed, the earlier checkpoints stay."""
    return _Save(root, step, version, trainer, ranks, merged).finish(timeout, tokenizer=tokenizer, ident=ident,
                                                                     keep=keep)


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
    every rank has one (each writes its part of the trainer state).

    background: save() prepares the files and writes them in a thread while the run goes on; join() ends
    that write (the runner calls it before the trainer's next offload, which rewrites the pool copies the
    write reads, and at the end). `seconds`: what each checkpoint kept the run waiting; `write_seconds`: how
    long its files took."""

    def __init__(self, root: Path, trainer: Checkpointable, tokenizer: Any, ident: dict, every: Optional[int],
                 keep: int, total_steps: int, ranks: Any = None, merged: bool = False, log=print,
                 background: bool = False, timeout_s: float = 3600.0):
        self.root, self.trainer, self.tokenizer, self.ident = root, trainer, tokenizer, ident
        self.every, self.keep, self.total, self.log = every, keep, total_steps, log
        self.ranks, self.merged = ranks, merged
        self.background, self.timeout_s = background, timeout_s
        self.saved: list[Path] = []
        self.seconds: list[float] = []
        self.write_seconds: list[float] = []
        self._running: Optional[_Save] = None
        self._blocked = 0.0            # the running save's preparation

    def due(self, done: int, final: bool = False) -> bool:
        """After `done` steps: a multiple of `every` or the last step (with `every` set), or the run stops
        here on a signal (`final`, always)."""
        return bool((self.every and (done % self.every == 0 or done == self.total)) or final)

    def saved_step(self, done: int) -> bool:
        """Whether this run already saved the state after `done` steps (written, or being written)."""
        name = f"{PREFIX}{done}"
        return any(p.name == name for p in self.saved) or (self._running is not None and self._running.step == done)

    @property
    def writing(self) -> Optional[int]:
        """The step whose checkpoint is being written in the background (None: none is)."""
        return self._running.step if self._running is not None else None

    def save(self, done: int, version: int, *, background: Optional[bool] = None) -> Optional[Path]:
        """Saves the state after `done` steps; in the background (the default set at construction) it
        returns None at once and join() ends it. A write still running is ended first."""
        self.join()
        t0 = time.perf_counter()
        job = _Save(self.root, done, version, self.trainer, self.ranks, self.merged)
        if self.background if background is None else background:
            job.start()
            self._running, self._blocked = job, time.perf_counter() - t0
            return None
        self._running, self._blocked = job, 0.0
        return self._end(job, t0)

    def join(self) -> float:
        """Ends the write in flight (waits for its files, then renames it into place); returns the seconds
        waited, 0.0 when none runs. CheckpointError when it failed (the earlier checkpoints are intact)."""
        job = self._running
        if job is None:
            return 0.0
        t0 = time.perf_counter()
        self._end(job, t0)
        return time.perf_counter() - t0

    def _end(self, job: _Save, t0: float) -> Optional[Path]:
        try:
            path = job.finish(self.timeout_s, tokenizer=self.tokenizer, ident=self.ident, keep=self.keep)
        finally:
            if job.thread is None or job.thread.done:
                self._running = None
        self.seconds.append(self._blocked + time.perf_counter() - t0)
        self.write_seconds.append(job.pending.seconds)
        if path is not None:
            self.saved.append(path)
            how = (f"written in {job.pending.seconds:.2f} s beside the run, which waited {self.seconds[-1]:.2f} s"
                   if job.thread is not None else f"{self.seconds[-1]:.2f} s")
            self.log(f"[colomem] checkpoint {path} ({how})")
        return path


__all__ = ["CheckpointError", "Checkpointer", "FORMAT", "MODEL_DIRS", "find", "identity", "load_state", "newest",
           "save", "save_tokenizer", "write_failure"]
