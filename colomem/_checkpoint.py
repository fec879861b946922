"""What makes a path a loadable local checkpoint: shared by the runner's config and the DeepSpeed adapter."""

from __future__ import annotations

from pathlib import Path
from typing import Optional


def checkpoint_problem(path) -> Optional[str]:
    """Why `path` is not a local checkpoint directory (what save_pretrained writes), or None if it is one.
    Nothing is ever downloaded, so a hub name is a problem too."""
    p = Path(str(path)).expanduser()
    if not p.exists():
        return f"model path {str(p)!r} does not exist; pass a local checkpoint directory (nothing is downloaded)"
    if not p.is_dir():
        return f"model path {str(p)!r} is not a directory; pass the directory that save_pretrained wrote"
    if not (p / "config.json").is_file():
        return f"model path {str(p)!r} has no config.json; pass the directory that save_pretrained wrote"
    return None
