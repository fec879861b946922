"""What makes a path a loadable local checkpoint: shared by the runner's config and the DeepSpeed adapter; and
a Hugging Face model id found in the local hub cache (nothing is downloaded)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

# what a hub model id looks like ("Qwen/Qwen2.5-1.5B-Instruct"): one slash, no path syntax
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


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


def cached_hub_model(name: str) -> tuple[Optional[str], Optional[str]]:
    """(the local snapshot folder of hub model `name` in the Hugging Face cache, None) or (None, why not).
    Only the cache is read (HF_HUB_CACHE / HF_HOME, as transformers finds it): a model that is not in it
    stays a clear error naming the command that fetches it, never a download in the middle of a job.
    (None, None): `name` is no hub id at all."""
    if not _HUB_ID.match(name) or Path(name).expanduser().exists():
        return None, None
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None, None
    try:
        return snapshot_download(name, local_files_only=True), None
    except FileNotFoundError:                   # huggingface_hub's LocalEntryNotFoundError is one
        return None, (f"model {name!r} is not in the local Hugging Face cache and nothing is downloaded during a "
                      f"run: fetch it first (`hf download {name}`), or pass a local checkpoint directory")

