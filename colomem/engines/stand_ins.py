"""CPU stand-ins for the two sides of a phase switch: same protocols as VLLMRollout / DeepSpeedTrainer.

HFRollout    transformers `generate` (colomem/engines/hf_rollout.py).
TorchTrainer plain torch AdamW on compute_loss (fp32). offload/reload move parameters and optimizer state
             into a colomem PinnedPool through SwapSet (host path), so a trainer that was not reloaded
             really has no weights; named_weights merges a LoRA adapter into the base (engines/lora.py).
             With overlap_reload the optimizer state comes back while forward and backward run; the step
             waits for it. Its moves are SwitchReports (host memory only: the driver fields stay 0).

They let the colocated runner run the same loop on a machine without a GPU. Nothing here is fast.
"""
from __future__ import annotations

import copy
import logging
import time
from typing import Any, Collection, Iterator, Mapping, Optional

import torch
from torch import Tensor

from colomem.engines.background import BackgroundSlot
from colomem.engines.hf_export import adapter_key
from colomem.engines.hf_model import load_model, model_on_base
from colomem.engines.hf_rollout import HFRollout
from colomem.engines.lora import build_lora_config, check_lora_layers, merged_named_weights
from colomem.engines.lr_schedule import LrSchedule, current_lr
from colomem.engines.pending_write import WriteGuard
from colomem.engines.protocols import check_hold
from colomem.engines.recompute import recomputed_layers
from colomem.engines.reports import SwitchReport
from colomem.engines.torch_checkpoint import TorchCheckpoints
from colomem.errors import ColomemError, InvalidArgumentError, PhaseOrderError
from colomem.swap import PendingReloads

log = logging.getLogger(__name__)

PARAMS_SET = "trainer.params"          # the SwapSet of parameters and gradients
OPTIM_SET = "trainer.optim"             # the SwapSet of the optimizer state: reloaded behind forward/backward


# ------------------------------------------------------------------------------------------------- trainer
_CATEGORY = {PARAMS_SET: "params", OPTIM_SET: "optim"}      # SwapSet name -> SwitchReport category


class TorchTrainer(TorchCheckpoints):
    """Trainer protocol on plain torch (AdamW, fp32), for CPU runs and tests.

    world_size > 1: gradients are averaged over `process_group` (gloo) before each step, so every rank
    holds the same weights (data parallel; each rank trains on its share of the groups)."""

    def __init__(self, model_path, *, lr: float, micro_batch: int, grad_accum: Optional[int] = None,
                 micro_batch_tokens: Optional[int] = None,
                 grpo=None, lora=None, pool=None, weight_decay: float = 0.0, max_grad_norm: Optional[float] = 1.0,
                 seed: int = 0, gradient_checkpointing: bool = False, checkpoint_every: int = 1,
                 trust_remote_code: bool = False,
                 device: str = "cpu", dtype: torch.dtype = torch.float32, process_group=None,
                 world_size: int = 1, swap_timeout_s: float = 300.0, overlap_reload: bool = True,
                 shared_base: Optional[Mapping[str, Tensor]] = None, optimizer_reload: str = "overlap",
                 optimizer_state_memory: str = "torch", torch_compile: bool = False,
                 lr_schedule: Optional[LrSchedule] = None):
        from colomem.grpo.config import GRPOConfig

        if micro_batch < 1:
            raise InvalidArgumentError(f"micro_batch must be >= 1, got {micro_batch}")
        self.grpo = grpo if grpo is not None else GRPOConfig()
        if micro_batch_tokens is not None and micro_batch_tokens < 1:
            raise InvalidArgumentError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
        self.micro_batch = int(micro_batch)
        self.micro_batch_tokens = micro_batch_tokens
        self.grad_accum = grad_accum
        self.max_grad_norm = max_grad_norm
        self.device = torch.device(device)
        self.world_size = int(world_size)
        self.process_group = process_group
        self.swap_timeout_s = float(swap_timeout_s)
        self.overlap_reload = bool(overlap_reload)
        if optimizer_reload not in ("overlap", "step"):
            raise InvalidArgumentError(f"optimizer_reload={optimizer_reload!r}: choose overlap or step")
        if optimizer_state_memory not in ("torch", "mapped"):
            raise InvalidArgumentError(f"optimizer_state_memory={optimizer_state_memory!r}: choose torch or mapped")
        # "step": the AdamW state stays in the pool until the optimizer step (as DeepSpeedTrainer's option)
        self.optimizer_reload = optimizer_reload
        self._at_step = None                   # the AdamW state's set while it waits for the optimizer step
        self.steps = 0
        torch.manual_seed(seed)
        self.shared = None                     # SharedBaseReport: the base parameters are the rollout's tensors
        if shared_base is not None:
            if lora is None:
                raise InvalidArgumentError("shared_base needs lora=: only a LoRA job's base stays frozen, so only "
                                           "then can the trainer read the rollout's weights")
            model, self.shared = model_on_base(model_path, shared_base, dtype, trust_remote_code, self.device)
        else:
            model = load_model(model_path, dtype, trust_remote_code).to(self.device)
        if hasattr(model, "config"):
            model.config.use_cache = False
        if gradient_checkpointing:
            from colomem.engines.recompute import enable_recompute

            enable_recompute(model, checkpoint_every)
        self.lora = lora
        self._ref_fn = None
        if lora is not None:
            from peft import get_peft_model

            model = get_peft_model(model, build_lora_config(lora))
            check_lora_layers(model)          # the layers the weight merge handles
        self.model = model
        if self.grpo.kl_coef > 0:
            from colomem.grpo.step import frozen_reference_fn, peft_reference_fn

            if lora is not None:
                self._ref_fn = peft_reference_fn(model, self.grpo.temperature)
            else:        # full fine-tune: a frozen copy of the starting weights
                ref = copy.deepcopy(model).eval().requires_grad_(False)
                self._ref_fn = frozen_reference_fn(ref, self.grpo.temperature)
        if torch_compile:                      # after the reference copy: that one runs without gradients
            from colomem.engines.compile import compile_decoder_layers

            compile_decoder_layers(model, self.device.type)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay)
        self.lr, self.lr_schedule = float(lr), lr_schedule or LrSchedule()
        self.scheduler = self.lr_schedule.started(self.optimizer, self.lr)
        self._offloaded = False
        self._closed = False
        self._swaps = []
        self._moved: list = []                 # the sets the last offload moved (keep leaves some)
        self._sync_source: Optional[list] = None
        self._pending = PendingReloads()       # optimizer state still coming back (overlap_reload)
        self._deferred: Optional[tuple] = None  # (set, handle) of an offload still copying (defer=True)
        self._finishing = BackgroundSlot()      # finish_offload(background=True) while it runs
        self._writes = WriteGuard()             # checkpoint writes reading the pool's copies (prepare_save)
        self.pool = pool
        self.offload_mode = "none"
        if pool is not None:
            try:
                from colomem.swap import SwapSet

                optim: Any
                if optimizer_state_memory == "mapped":   # Adam's moments in memory colomem maps itself
                    from colomem.engines.mapped_optim_set import MappedOptimizerSet

                    optim = MappedOptimizerSet(self.optimizer, pool, OPTIM_SET)
                else:
                    optim = SwapSet.from_optimizer(self.optimizer, pool, device=self.device, name=OPTIM_SET)
                self._swaps = [SwapSet.from_module(model, pool, grads=True, device=self.device, name=PARAMS_SET),
                               optim]
                self.offload_mode = "colomem"
            except ColomemError as e:      # e.g. a device the host path does not serve
                log.warning("TorchTrainer: offload through the pool unavailable (%s); offload is a no-op", e)
                self._swaps = []
        self.last_offload: Optional[SwitchReport] = None
        self.last_reload: Optional[SwitchReport] = None

    @property
    def offloaded(self) -> bool:
        return self._offloaded

    def _check(self, what: str) -> None:
        if self._closed:
            raise PhaseOrderError(f"this TorchTrainer was closed; cannot {what}")
        if self._offloaded:
            raise PhaseOrderError(f"{what} on an offloaded trainer; call reload() first")

    def train_step(self, batch) -> dict[str, float]:
        """The optimizer steps of one batch (grpo.num_iterations x grpo.mini_batches; one by default)."""
        from colomem.grpo.step import train_on_batch

        self._check("train_step()")
        t0 = time.perf_counter()

        def optimizer_step() -> dict[str, float]:
            out: dict[str, float] = {}
            if self.world_size > 1:
                import torch.distributed as dist

                for p in self.params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    dist.all_reduce(p.grad, group=self.process_group)
                    p.grad.div_(self.world_size)
            if self.max_grad_norm:
                norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
                out["grad_norm"] = float(norm)
            at_step = self._at_step is not None
            # the step reads the optimizer state: what reloads behind the forward / backward, or all of it now
            out["reload_wait_s"] = self._pending.wait(self.swap_timeout_s) + self.finish_offload()
            if at_step:
                out["optimizer_reload_s"] = self._reload_at_step(self.swap_timeout_s)
            out["lr"] = current_lr(self.optimizer)      # the rate this step uses
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.steps += 1
            return out

        metrics = train_on_batch(self.model, batch, self.grpo, micro_batch=self.micro_batch,
                                 micro_batch_tokens=self.micro_batch_tokens,
                                 backward=lambda loss: loss.backward(), optimizer_step=optimizer_step,
                                 ref_logprobs_fn=self._ref_fn, device=self.device, world_size=self.world_size,
                                 process_group=self.process_group)
        metrics["recomputed_layers"] = recomputed_layers(self.model)
        metrics["train_step_s"] = time.perf_counter() - t0
        return metrics

    def offload(self, *, keep: Collection[str] = (), defer: bool = False, hold: bool = False) -> None:
        """Parameters (+ grads) and optimizer state into the pool, but for the categories in keep ("params":
        parameters and gradients; "optim": the AdamW state). The weights stay readable for the sync: host
        views of the pool copy (full fine-tune), staged merged copies (LoRA), or the weights themselves when
        kept. defer: the AdamW state is still copying on return; finish_offload() waits for it. hold (with
        defer): it starts copying only at start_offload()."""
        self._check("offload()")
        check_hold(defer, hold)
        self._writes.wait(self.swap_timeout_s)   # a checkpoint write still reading the copies this rewrites
        self.finish_offload()               # a background end of the last offload, if one still runs
        self.wait_reload()                  # reloaded but never trained on: finish the copies first
        if self.shared is not None:         # the base is the rollout's and must stay; the adapter is tiny
            keep = (*keep, "params")
        t0 = time.perf_counter()
        moving = [s for s in self._swaps if _CATEGORY[s.name] not in keep]
        params_move = any(s.name == PARAMS_SET for s in moving)
        staged = None
        if params_move and self.lora is not None:
            staged = [(n, t.clone()) for n, t in merged_named_weights(self.model)]
        params = list(self.model.named_parameters())
        by_category = {}
        deferred = 0
        # the deferred set last: a set waited for after it would queue behind its whole copy on the copy engine
        for s in sorted(moving, key=lambda s: defer and s.name == OPTIM_SET):
            if defer and s.name == OPTIM_SET:       # read by the next optimizer step only: let it copy
                self._deferred = (s, None if hold else s.offload_async())
                deferred = s.nbytes
                continue
            by_category[_CATEGORY[s.name]] = s.offload(timeout=self.swap_timeout_s).nbytes
        self._moved = moving
        self._offloaded = True
        if staged is not None:
            self._sync_source = staged
        elif params_move:
            self._sync_source = [(n, self._host_view(p)) for n, p in params]
        seconds = time.perf_counter() - t0
        self.last_offload = SwitchReport(
            self.offload_mode, "offload", seconds, sum(by_category.values()), 0, 0, 0, 0, by_category,
            move_seconds=seconds, staged_bytes=sum(t.numel() * t.element_size() for _, t in staged or ()),
            deferred_bytes=deferred)

    @property
    def defers_offload(self) -> bool:
        """offload(defer=True) is always possible here (the pool holds every set)."""
        return True

    @property
    def offload_pending(self) -> bool:
        return self._deferred is not None or self._finishing.busy

    def start_offload(self) -> None:
        """Starts the copy an offload(defer=True, hold=True) held back (nothing to do otherwise)."""
        if self._deferred is not None and self._deferred[1] is None:
            s = self._deferred[0]
            self._deferred = (s, s.offload_async())

    def finish_offload(self, timeout: Optional[float] = None, *, background: bool = False) -> float:
        """Waits for the AdamW state an offload(defer=True) left copying (starting it first when held);
        returns the seconds waited. On a timeout the copy goes on and a later call waits again. background:
        in a thread (DeepSpeedTrainer.finish_offload); any later call waits for it first."""
        if self._finishing.busy:
            return self._finishing.collect(self.swap_timeout_s if timeout is None else timeout)
        if background:
            if self._deferred is not None:
                self._finishing.start(self._finish_offload_now, "the end of the deferred offload")
            return 0.0
        return self._finish_offload_now(timeout)

    def _finish_offload_now(self, timeout: Optional[float] = None) -> float:
        self.start_offload()
        if self._deferred is None:
            return 0.0
        s, handle = self._deferred
        t0 = time.perf_counter()
        stats = handle.wait(self.swap_timeout_s if timeout is None else timeout)
        self._deferred = None
        waited = time.perf_counter() - t0
        rep = self.last_offload
        if rep is not None:
            rep.by_category[_CATEGORY[s.name]] = stats.nbytes
            rep.moved_bytes += stats.nbytes
            rep.wait_seconds = waited
        return waited

    def _host_view(self, t: Tensor) -> Tensor:
        view = self._swaps[0].host_view(t)
        if view is None:
            raise ColomemError("TorchTrainer: a parameter's pool copy was not found after offload")
        return view

    def reload(self) -> None:
        self._reload(out_until_step=False)

    def optimizer_out_until_step(self) -> None:
        """The AdamW state starts copying to the pool now, behind the forward and backward; the optimizer
        step waits for the copy and brings the state back (DeepSpeedTrainer.optimizer_out_until_step)."""
        self.offload(keep=tuple(c for c in set(_CATEGORY.values()) if c != "optim"), defer=True)
        self._reload(out_until_step=True)

    def _reload(self, out_until_step: bool) -> None:
        if self._closed:
            raise PhaseOrderError("this TorchTrainer was closed; cannot reload()")
        if not self._offloaded:
            raise PhaseOrderError("reload() on a trainer that is not offloaded; call offload() first")
        if not out_until_step:
            self.finish_offload()           # a deferred part first: the set reloads once it is offloaded
        t0 = time.perf_counter()
        self._sync_source = None            # host views die with the offload
        nbytes = deferred = 0
        moved, self._moved = self._moved, []
        for s in moved:
            if s.name == OPTIM_SET and (out_until_step or self.optimizer_reload == "step"):
                self._at_step = s
                deferred += s.nbytes
            elif s.name == OPTIM_SET and self.overlap_reload:   # read only by optimizer.step()
                self._pending.add(s.reload_async(ordered=False))
                deferred += s.nbytes
            else:
                nbytes += s.reload(timeout=self.swap_timeout_s).nbytes
        self._offloaded = False
        seconds = time.perf_counter() - t0
        self.last_reload = SwitchReport(self.offload_mode, "reload", seconds, nbytes, 0, 0, 0, 0,
                                            move_seconds=seconds, deferred_bytes=deferred)

    def wait_reload(self, timeout: Optional[float] = None) -> float:
        """Waits for optimizer state that overlap_reload left in flight, or brings back what waits for the
        optimizer step (train_step does just before the step); returns the seconds it blocked."""
        timeout = self.swap_timeout_s if timeout is None else timeout
        return self._pending.wait(timeout) + self._reload_at_step(timeout)

    def _reload_at_step(self, timeout: float) -> float:
        if self._at_step is None:
            return 0.0
        t0 = time.perf_counter()
        self.finish_offload(timeout)        # still copying out (optimizer_out_until_step)
        s, self._at_step = self._at_step, None
        s.reload(timeout=timeout)
        return time.perf_counter() - t0

    def named_weights(self, merged: Optional[bool] = None) -> Iterator[tuple[str, Tensor]]:
        """(HF name, tensor) for the rollout sync, LoRA merged (a shared base: the adapter only, peft names,
        unless merged=True: base + scaling * B @ A, the base read where it is). Offloaded: the pool copies
        prepared by offload()."""
        if self._closed:
            raise PhaseOrderError("this TorchTrainer was closed")
        if self.shared is not None:         # the rollout reads the base where it is: the adapter alone
            if merged:                      # the adapter stays with its base: both are on the device
                return merged_named_weights(self.model)
            return iter([(adapter_key(n), p.detach()) for n, p in self.model.named_parameters() if ".lora_" in n])
        if self._offloaded and self._sync_source is not None:
            return iter(list(self._sync_source))
        return merged_named_weights(self.model)

    def state_bytes(self) -> dict[str, int]:
        """Bytes of the parameters with their gradients and of the optimizer state, each storage once (tied
        weights share one), as the offload moves them."""
        def nbytes(ts) -> int:
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for t in ts if isinstance(t, torch.Tensor)}
            return sum(storages.values())
        params = list(self.model.parameters())
        return {"params": nbytes(params + [p.grad for p in params if p.grad is not None]),
                "optim": nbytes(v for st in self.optimizer.state.values() for v in st.values())}

    def memory(self) -> dict:
        out = {}
        if self.shared is not None:
            out["shared_base_bytes"] = self.shared.bytes_shared
        if self.pool is not None and not self.pool.closed:
            st = self.pool.stats()
            out["pinned_pool"] = int(st["reserved_bytes"])
            out["pool_in_use"] = int(st["in_use_bytes"])
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._writes.wait(self.swap_timeout_s)   # a checkpoint write still reading the pool copies
            self.wait_reload()
            self.finish_offload()
        except ColomemError as e:
            log.warning("TorchTrainer.close: a deferred reload or offload did not finish: %s", e)
        for s in self._swaps:
            try:
                if self._offloaded and s in self._moved:
                    s.reload(timeout=self.swap_timeout_s)   # give the pool its blocks back
                s.close()
            except ColomemError as e:
                log.warning("TorchTrainer.close: %s", e)
        self._swaps = []
        self._sync_source = None
        self.process_group = None   # the ranks' group is torn down after this; a reference would keep it alive
        self.model = None
        self.optimizer = None       # closed: nothing may step it again
        self.params = []


__all__ = ["HFRollout", "TorchTrainer"]
