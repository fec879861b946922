"""A trainer's model written in Hugging Face format from whatever tensors hold its weights now.

The trainers hand in host tensors: while they are offloaded, views of the pool's copies (nothing is
reloaded and nothing more is allocated on the GPU to save a checkpoint); while resident, their own tensors
(copied to the host one at a time here). What comes out loads as users load models:

    full fine-tune   config.json + model.safetensors      AutoModelForCausalLM.from_pretrained, vLLM
    LoRA             adapter_config.json + adapter_model.safetensors   PeftModel.from_pretrained, vLLM's
                                                                       LoRARequest
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional

from .lora import is_peft_model

if TYPE_CHECKING:
    from torch import Tensor

ADAPTER_WEIGHTS = "adapter_model.safetensors"
_ADAPTER_NAME = re.compile(r"\.(lora_[A-Za-z_]+)\.[^.]+\.")


def adapter_key(param_name: str) -> str:
    """A peft parameter's name as peft saves it: the adapter's name dropped
    (…q_proj.lora_A.default.weight -> …q_proj.lora_A.weight)."""
    return _ADAPTER_NAME.sub(r".\1.", param_name)


def _host(t: "Tensor") -> "Tensor":
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t if t.is_contiguous() else t.contiguous()


class _WholeWrites:
    """A file whose write() writes everything or keeps the kernel's reason for failing: torch's writer turns
    a failed write into "unexpected pos" and drops the cause (a full disk), which save_torch raises instead."""

    def __init__(self, fd: int):
        self.fd = fd
        self.error: Optional[OSError] = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):
                done += os.write(self.fd, view[done:])
        except OSError as e:
            self.error = e
            raise
        return len(view)

    def flush(self) -> None:
        pass


def save_torch(obj: Any, path: Path) -> None:
    """torch.save into `path`, synced; a failing write (a full disk) raises OSError naming its cause."""
    import torch

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    out = _WholeWrites(fd)
    try:
        torch.save(obj, out)  # type: ignore[arg-type]  # any object with write() will do
        os.fsync(fd)
    except RuntimeError:
        if out.error is not None:
            raise OSError(out.error.errno, out.error.strerror, str(path)) from None
        raise
    finally:
        os.close(fd)


def save_full_model(model: Any, weights: Iterable[tuple[str, "Tensor"]], out: Path) -> None:
    """The full model under its HF names (LoRA merged, when the weights are merged) into `out`, with the
    config of `model` (a transformers model, or the base of a peft model)."""
    base = model.get_base_model() if is_peft_model(model) else model
    out.mkdir(parents=True, exist_ok=True)
    base.save_pretrained(out, state_dict={name: _host(t) for name, t in weights})


def save_adapter(model: Any, adapter: Mapping[str, "Tensor"], out: Path) -> None:
    """The peft adapter (`adapter` named as peft saves it, see adapter_key) with its config into `out`."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    name = getattr(model, "active_adapter", "default")
    model.peft_config[name].save_pretrained(str(out))
    save_file({k: _host(v) for k, v in adapter.items()}, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})


__all__ = ["ADAPTER_WEIGHTS", "adapter_key", "save_adapter", "save_full_model", "save_torch"]
