"""The two sides of a phase switch behind small protocols (`engines.protocols`; docs/design.md, "Engines").

    engines/protocols.py   Rollout, Trainer (what the runner calls), the rollout's phase names
    engines/reports.py     SyncStats (one weight sync), SwitchReport (one trainer offload or reload)
    engines/vllm/          the vLLM rollout (parent side) and its worker extension (inside vLLM's worker)
    engines/deepspeed/     the DeepSpeed trainer: config, ZeRO state discovery, offload strategies, weights
    engines/stand_ins.py   CPU stand-ins with the same protocols (transformers generate, plain torch AdamW)

The engines load on first use, so importing this package never imports vLLM or DeepSpeed.
"""

from __future__ import annotations

from .protocols import Rollout, Trainer
from .reports import SwitchReport, SyncStats

_LAZY = {
    "VLLMRollout": ("colomem.engines.vllm", "VLLMRollout"),
    "ColomemWorkerExtension": ("colomem.engines.vllm.worker", "ColomemWorkerExtension"),
    "DeepSpeedTrainer": ("colomem.engines.deepspeed", "DeepSpeedTrainer"),
    "HFRollout": ("colomem.engines.hf_rollout", "HFRollout"),
    "TorchTrainer": ("colomem.engines.stand_ins", "TorchTrainer"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'colomem.engines' has no attribute {name!r}")


__all__ = ["Rollout", "SwitchReport", "SyncStats", "Trainer", *_LAZY]
