"""The CPU trainer's checkpoints (TorchTrainer's mixin): its state saved from the pool's copies where they are,
the model in Hugging Face format beside it, and the state loaded back into a freshly built trainer."""
from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any, ContextManager, Optional

import torch
from torch import Tensor

from colomem.engines.hf_export import adapter_key, save_adapter, save_full_model, save_torch
from colomem.engines.lora import merged_named_weights
from colomem.engines.pending_write import PendingWrite, host_copy
from colomem.errors import ColomemError, InvalidArgumentError, PhaseOrderError


class TorchCheckpoints:
    """prepare_save / save_state / load_state of TorchTrainer (which holds the attributes they read)."""
    _closed: bool
    _offloaded: bool
    _swaps: list
    _writes: Any
    model: Any
    optimizer: Any
    lora: Any
    shared: Any
    steps: int
    world_size: int
    process_group: Any
    device: Any
    lr: float
    lr_schedule: Any
    scheduler: Any
    wait_reload: Any           # TorchTrainer's methods these call
    finish_offload: Any
    named_weights: Any
    _check: Any

    def prepare_save(self, path: Path, *, merged: bool = False, state: bool = True) -> PendingWrite:
        """Everything training needs to continue exactly: weights, AdamW state, step, RNG (`trainer.pt`; not
        with state=False), and the model in Hugging Face format (`model/`: the peft adapter with LoRA; with merged, also
        `model-merged/`: the full model with the adapter merged), ready to write: write() is file I/O only.
        Offloaded, it reads the pool's copies where they are (the next offload and close() wait for the
        write); anything resident is copied now. Ranks hold the same state: only rank 0 writes."""
        if self._closed:
            raise PhaseOrderError("this TorchTrainer was closed; cannot save_state()")
        self.wait_reload()
        self.finish_offload()               # the pool copies it reads must be complete
        if self.world_size > 1 and self.process_group is not None:
            import torch.distributed as dist

            if dist.get_rank(self.process_group) != 0:
                return PendingWrite([], reads_pool=False, path=path)
        pooled: list[bool] = []

        def host(t: Tensor) -> Tensor:
            view = self._pool_view(t)
            pooled.append(view is not None)
            return view if view is not None else host_copy(t)

        # a shared base is the rollout's (the model at model_path, never trained): the adapter is the state
        model_sd = {k: host(v) for k, v in self.model.state_dict().items()
                    if self.shared is None or ".lora_" in k}
        writes = [self._state_write(path, model_sd, host)] if state else []
        model = self.model
        if self.lora is not None:
            adapter = {adapter_key(k): v for k, v in model_sd.items() if ".lora_" in k}
            writes.append(lambda: save_adapter(model, adapter, path / "model"))
            if merged:
                full = [(n, host_copy(t)) for n, t in (merged_named_weights(model) if self.shared is not None
                                                        else self.named_weights())]
                writes.append(lambda: save_full_model(model, full, path / "model-merged"))
        else:
            writes.append(lambda: save_full_model(model, list(model_sd.items()), path / "model"))
        return self._writes.track(PendingWrite(writes, reads_pool=any(pooled), path=path))

    def _state_write(self, path: Path, model_sd: dict, host: Any) -> Any:
        """Writes `trainer.pt` (weights, AdamW state, step, RNG), its tensors read through `host` now."""
        with self._optimizer_read():
            opt_sd = self.optimizer.state_dict()
        opt_sd["param_groups"] = copy.deepcopy(opt_sd["param_groups"])
        opt_sd["state"] = {i: {k: host(v) if isinstance(v, Tensor) else copy.deepcopy(v) for k, v in st.items()}
                           for i, st in opt_sd["state"].items()}
        blob = {"model": model_sd, "optimizer": opt_sd, "steps": self.steps, "torch_rng": torch.get_rng_state()}

        def write_state() -> None:
            path.mkdir(parents=True, exist_ok=True)
            save_torch(blob, path / "trainer.pt")
        return write_state

    def save_state(self, path: Path, *, merged: bool = False) -> None:
        """prepare_save(path, merged=merged), written now."""
        self.prepare_save(path, merged=merged).write()

    def _optimizer_read(self) -> ContextManager[Any]:
        """Around the save's optimizer.state_dict(): offloaded, mapped moments stay in the pool (host() reads
        their host views), instead of coming back to the device in full for the save."""
        optim = self._swaps[1] if self._offloaded and len(self._swaps) > 1 else None
        read = getattr(optim, "read_in_place", None)
        return read() if read is not None else contextlib.nullcontext()

    def _pool_view(self, t: Tensor) -> Optional[Tensor]:
        """Offloaded, the view of t's pool copy (None: t was not moved, or the trainer is resident)."""
        if not self._offloaded:
            return None
        for s in self._swaps:
            view = s.host_view(t)
            if view is not None:
                return view
        if t.untyped_storage().nbytes() == 0 and t.numel() > 0:
            raise ColomemError("TorchTrainer: a tensor of the offloaded state has no pool copy to save from")
        return None

    def load_state(self, path: Path) -> None:
        """The state save_state wrote, into this trainer (built from the same model, resident)."""
        self._check("load_state")
        state = torch.load(path / "trainer.pt", map_location=self.device, weights_only=True)
        missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
        if self.shared is not None:         # the base is not in the checkpoint (nor written: it is the rollout's)
            missing = [k for k in missing if ".lora_" in k]
        if missing or unexpected:
            raise InvalidArgumentError(f"checkpoint {str(path)!r} is of another model: {len(missing)} weights "
                                       f"missing (e.g. {missing[:2]}), {len(unexpected)} unknown "
                                       f"(e.g. {unexpected[:2]})")
        self.optimizer.load_state_dict(state["optimizer"])
        for st in self.optimizer.state.values():      # torch.load's storages cannot be resized: own them
            for k, v in st.items():
                if isinstance(v, Tensor) and not v.untyped_storage().resizable():
                    st[k] = v.clone()
        self.steps = int(state["steps"])
        self.scheduler = self.lr_schedule.started(self.optimizer, self.lr, self.steps)
        torch.set_rng_state(state["torch_rng"])


__all__ = ["TorchCheckpoints"]
