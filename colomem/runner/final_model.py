"""The trained model at the end of a run (--save-final, on by default): `<out>/model/` in Hugging Face format,
the peft adapter with LoRA, and with --save-merged also `<out>/model-merged/` (the adapter merged), each with
the tokenizer, so `from_pretrained` and vLLM load it like the model the run started from.

When the last step's checkpoint holds the model already (--save-every), its files are hard-linked (copied
where the filesystem cannot link): no second write, and the folder stays when old checkpoints are dropped.
Otherwise every rank prepares the trainer's model (ZeRO-3 gathers it collectively) and rank 0 writes it into
a temporary folder that is then renamed into place, so an interrupted write never leaves a half model under
the final name. A run stopped early (a signal, an error) writes none: its newest checkpoint is its result.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

from colomem.errors import ColomemError

from .checkpoints import MODEL_DIRS, CheckpointError, save_tokenizer, write_failure


def _link_or_copy(src: str, dst: str) -> None:
    """copytree's copy: a hard link of the file, a copy where the filesystem cannot link."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _into_place(tmp: Path, out: Path) -> None:
    """Renames each model folder of tmp over the one of the same name under out; tmp goes."""
    for sub in MODEL_DIRS:
        if (tmp / sub).is_dir():
            if (out / sub).exists():
                shutil.rmtree(out / sub)
            os.replace(tmp / sub, out / sub)
    shutil.rmtree(tmp, ignore_errors=True)


def save_final_model(out: Path, trainer: Any, tokenizer: Any, ranks: Any, *, merged: bool,
                     checkpoint: Optional[Path], say: Callable[[str], None] = print) -> Optional[Path]:
    """Writes `<out>/model` (and `model-merged` with merged and LoRA); returns its path on rank 0, None on the
    others. checkpoint: the last step's checkpoint folder when it was written (its model is linked, nothing
    is gathered then, on any rank). CheckpointError when writing fails (the checkpoints stay as they are)."""
    main = ranks is None or ranks.is_main
    tmp = out / ".tmp-model"
    try:
        if checkpoint is not None:
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
                for sub in MODEL_DIRS:
                    if (checkpoint / sub).is_dir():
                        shutil.copytree(checkpoint / sub, tmp / sub, copy_function=_link_or_copy)
                _into_place(tmp, out)
                say(f"[colomem] trained model: {out / 'model'} (linked from {checkpoint.name})")
            return out / "model" if main else None
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        if ranks is not None:
            ranks.barrier("final model: folder ready")
        trainer.prepare_save(tmp, merged=merged, state=False).write()
        if ranks is not None:
            ranks.barrier("final model: every rank wrote its part")
        if not main:
            return None
        save_tokenizer(tokenizer, tmp)
        _into_place(tmp, out)
    except Exception as e:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, ColomemError):
            raise                    # ours say what to do already (a rank gone, a trainer closed)
        raise CheckpointError(f"writing the trained model under {str(out)!r} failed: "
                              f"{write_failure(e, 'a model file')}; free disk space or "
                              "choose another --out (the run's checkpoints are intact)") from e
    say(f"[colomem] trained model: {out / 'model'}")
    return out / "model"


__all__ = ["save_final_model"]
