"""lora_mode="adapter": the trainer's LoRA tensors served through vLLM's LoRA support.

Tensors named *lora_A* / *lora_B* are written as a peft adapter (safetensors in /dev/shm) and registered
with vLLM's LoRA manager under a fresh id per version; the rest are base weights, synced as usual. The
adapter is registered again after every wake (a wake can drop it).

With vLLM's engine in this process and an adapter already in one of its slots, a new version is instead
copied straight from the trainer's tensors into that slot (lora_inplace.py: no file, no load, no new id);
the first version, and any adapter vLLM would not take in place (AdapterLayoutError), goes through the
files. vLLM's prefix cache keys each block by the request's adapter (its name), which an in-place write
keeps, so KV blocks cached before the write are stale: the rollout resets the prefix cache when the write
happens while awake (a sleep clears it anyway), rather than registering a new name and id, which would
mean re-keying vLLM's slot table, adapter registry and LRU caches behind its back. Once a
version went in place the files are older than the slot, so a wake that dropped the adapter cannot
re-register them: generate refuses (StaleWeightsError) until the next load_weights sends the adapter.

This module imports neither torch nor vLLM at module level (the config validates LoRA ranks with it).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any, Iterable, Optional

from colomem.errors import AdapterLayoutError, ColomemError, StaleWeightsError

if TYPE_CHECKING:
    from .engine_calls import EngineCalls

log = logging.getLogger(__name__)

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)   # vLLM 0.24 LoRAConfig.max_lora_rank choices


def lora_attr(lora: Any, *names: str, default: Any = None) -> Any:
    """The first of `names` on a LoraSpec-like object or dict (r, alpha / lora_alpha, target_modules)."""
    for n in names:
        if hasattr(lora, n):
            return getattr(lora, n)
        if isinstance(lora, dict) and n in lora:
            return lora[n]
    return default


def vllm_lora_rank(lora: Any) -> int:
    """The smallest max_lora_rank vLLM accepts that holds the adapter's rank."""
    r = int(lora_attr(lora, "r"))
    return next(x for x in LORA_RANKS if x >= r)


def is_lora_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name or name.endswith((".lora_embedding_A", ".lora_embedding_B"))


def peft_adapter_name(name: str) -> str:
    """A peft state-dict name vLLM's LoRA loader parses: `base_model.model.` prefix, no adapter segment."""
    for part in (".lora_A.", ".lora_B."):
        if part in name:
            head, tail = name.split(part, 1)
            if tail.count(".") >= 1 and not tail.startswith("weight"):  # lora_A.default.weight -> lora_A.weight
                tail = tail.split(".", 1)[1]
            name = head + part + tail
    return name if name.startswith("base_model.model.") else "base_model.model." + name


def hf_base_name(name: str) -> str:
    """A peft base-layer name back to the plain HF name vLLM's load_weights expects."""
    if name.startswith("base_model.model."):
        name = name[len("base_model.model."):]
    return name.replace(".base_layer.", ".")


def split_adapter(named_tensors: Iterable) -> tuple[list, list]:
    """(base weights under HF names, adapter tensors under peft names)."""
    base, adapter = [], []
    for name, t in named_tensors:
        if is_lora_name(name):
            adapter.append((peft_adapter_name(name), t))
        else:
            base.append((hf_base_name(name), t))
    return base, adapter


class LoraAdapter:
    """The adapter vLLM serves now: its request (passed to generate), its files, the next id.

    in_process: vLLM's worker runs in this process, so the trainer's tensors can be handed to it as they are
    (the in-place path). load() says how a version went; `inplace_refused` why the in-place path was last
    refused.
    """

    def __init__(self, lora: Any, calls: "EngineCalls", timeout: float, in_process: bool = False):
        self.lora, self._calls, self._timeout = lora, calls, timeout
        self.in_process = bool(in_process)
        self.request: Any = None
        self.path: Optional[str] = None
        self.last_write: dict = {}        # the worker's report of the last in-place write (slot, bytes, seconds)
        self.inplace_refused: Optional[str] = None
        self._files_current = True        # the files at `path` hold what vLLM's slot holds
        self._dropped: Optional[str] = None  # why the adapter vLLM should serve is gone (generate refuses)
        self._next_id = 1

    @property
    def scaling(self) -> float:
        """alpha / r, the factor vLLM's loader folds into B (the adapter files say use_rslora=False)."""
        return float(lora_attr(self.lora, "alpha", "lora_alpha")) / int(lora_attr(self.lora, "r"))

    def serving(self) -> Any:
        """The request generate passes to vLLM; StaleWeightsError when the adapter was lost (see module doc)."""
        if self._dropped is not None:
            raise StaleWeightsError(f"{self._dropped}: call load_weights(adapter tensors, version) before "
                                    f"generating")
        return self.request

    def load(self, adapter: list, version: int) -> bool:
        """Puts the adapter of `version` into vLLM: in place when it can, else as files under a fresh id.
        Returns True when it went in place."""
        if self.in_process and self.request is not None and self._dropped is None:
            try:
                self.last_write = self.write_in_place(adapter)
                return True
            except AdapterLayoutError as exc:
                if self.inplace_refused is None:
                    log.warning("LoRA adapter not written in place, loading it from files: %s", exc)
                self.inplace_refused = str(exc)
        self.load_files(adapter, version)
        return False

    def write_in_place(self, adapter: list) -> dict:
        """Copies the adapter tensors over the slot vLLM activated for the current request (same id).
        AdapterLayoutError, nothing written, when vLLM's slot does not take them exactly."""
        import torch

        ready = None
        if any(isinstance(t, torch.Tensor) and t.is_cuda for _, t in adapter):
            ready = torch.cuda.Event()
            ready.record()              # the trainer's last writes to these tensors, on its own stream
        req = self.request
        try:
            # the worker's wait for its copies ends well before this call's, so a hung GPU reports as such
            out = self._calls.rpc("colomem_lora_write", req.lora_int_id, adapter, self.scaling,
                                  0.5 * self._timeout, ready, timeout=self._timeout)
        except AdapterLayoutError:
            raise
        except BaseException:
            # a failure after the checks (a wait that ran out, a dead engine) may leave the slot half written
            self._dropped = "writing the LoRA adapter into vLLM's slot failed part way"
            raise
        self._files_current = False
        self.inplace_refused = None
        return out[0]

    def load_files(self, adapter: list, version: int) -> None:
        """Writes the adapter tensors as a peft adapter and registers it for `version`."""
        from safetensors.torch import save_file

        d = tempfile.mkdtemp(prefix=f"colomem-lora-v{version}-", dir=_shm_dir())
        try:
            save_file({n: t.detach().to("cpu").contiguous() for n, t in adapter},
                      os.path.join(d, "adapter_model.safetensors"))
            cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(lora_attr(self.lora, "r")),
                   "lora_alpha": lora_attr(self.lora, "alpha", "lora_alpha"),
                   # the modules the adapter really has (a spec may say "all-linear")
                   "target_modules": sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n, _ in adapter}),
                   "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "use_dora": False}
            with open(os.path.join(d, "adapter_config.json"), "w") as f:
                json.dump(cfg, f)
            self.register(d, version)
        except BaseException:
            shutil.rmtree(d, ignore_errors=True)
            raise

    def register(self, d: str, version: int) -> None:
        """Adds the adapter in `d` under a fresh id (so no cached copy is reused) and drops the previous one."""
        from vllm.lora.request import LoRARequest

        lid = self._next_id
        self._next_id += 1
        req = LoRARequest(lora_name=f"colomem-v{version}-{lid}", lora_int_id=lid, lora_path=d)
        self._calls.call(lambda llm: llm.llm_engine.add_lora(req), self._timeout, "add_lora")
        old, old_dir = self.request, self.path
        self.request, self.path = req, d
        self._files_current, self._dropped = True, None
        if old is not None:
            try:
                self._calls.call(lambda llm: llm.llm_engine.remove_lora(old.lora_int_id), self._timeout,
                                 "remove_lora")
            except ColomemError:
                raise
            except Exception as exc:  # noqa: BLE001  (already evicted by the LRU of one slot)
                log.debug("remove_lora(%s): %s", old.lora_int_id, exc)
            if old_dir and old_dir != d:
                shutil.rmtree(old_dir, ignore_errors=True)

    def register_again(self, version: int) -> None:
        """After a wake: the same files under a fresh id (a wake may have dropped the adapter). Files older
        than the slot (a version went in place since) are not registered: the slot is kept when vLLM still
        has the adapter active (the wake restored it with the weights), else the adapter counts as lost."""
        if self.request is None or self.path is None or self._dropped is not None:
            return
        if self._files_current:
            self.register(self.path, version)
            return
        slot = self._calls.rpc("colomem_lora_slot", self.request.lora_int_id, timeout=self._timeout)[0]["slot"]
        if slot < 0:
            log.warning("the wake dropped LoRA adapter %s, whose last version was written in place; the next "
                        "load_weights loads it from files", self.request.lora_int_id)
            self._dropped = (f"the wake dropped LoRA adapter {self.request.lora_int_id} (version {version}, "
                             f"written in place, so its files are older)")
            self.remove_files()

    def remove_files(self) -> None:
        if self.path:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None


def _shm_dir() -> Optional[str]:
    d = "/dev/shm"
    return d if os.path.isdir(d) and os.access(d, os.W_OK) else None


__all__ = ["LORA_RANKS", "LoraAdapter", "hf_base_name", "is_lora_name", "lora_attr", "peft_adapter_name",
           "split_adapter", "vllm_lora_rank"]
