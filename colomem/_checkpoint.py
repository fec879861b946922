"""What makes a path a loadable local checkpoint: shared by the runner's config and the DeepSpeed adapter."""

from __future__ import annotations

from pathlib import Path
from typing import Optional


WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def checkpoint_problem(path, *, tokenizer: bool = True) -> Optional[str]:
    """Why `path` is not a local checkpoint directory (what save_pretrained writes: config, weights and, with
    `tokenizer`, the tokenizer), or None if it is one. Nothing is ever downloaded, so a hub name is a problem."""
    p = Path(str(path)).expanduser()
    if not p.exists():
        return f"model path {str(p)!r} does not exist; pass a local checkpoint directory (nothing is downloaded)"
    if not p.is_dir():
        return f"model path {str(p)!r} is not a directory; pass the directory that save_pretrained wrote"
    if not (p / "config.json").is_file():
        return f"model path {str(p)!r} has no config.json; pass the directory that save_pretrained wrote"
    if not any(next(p.glob(pattern), None) is not None for pattern in WEIGHT_FILES):
        return (f"model path {str(p)!r} has no weights (none of {', '.join(WEIGHT_FILES)}); pass the directory "
                "that save_pretrained wrote")
    if tokenizer and not any((p / name).is_file() for name in TOKENIZER_FILES):
        return (f"model path {str(p)!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save the "
                "tokenizer into it too: tokenizer.save_pretrained(path)")
    return None
