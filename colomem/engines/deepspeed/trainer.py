"""DeepSpeedTrainer: a DeepSpeed ZeRO-2/3 (bf16) engine from a transformers causal LM, optionally with a peft
LoRA adapter, whose whole GPU state moves to the pinned pool and back between training phases.

Two ways to build one (the options are those of `DeepSpeedConfig`, same names and defaults either way):

    DeepSpeedTrainer(model_path, zero_stage=3, lr=1e-5, micro_batch=4, pool=pool, lora=spec, grpo=grpo)
    config = DeepSpeedConfig(zero_stage=3, lr=1e-5, micro_batch=4)      # validated before anything starts
    DeepSpeedTrainer(model_path, config=config, pool=pool, lora=spec, grpo=grpo)

The parts: config.py (options, version check, the DeepSpeed config), model.py (the model it trains),
state.py (what the engine holds on the GPU), strategies.py (the three offload methods), step_reload.py (the
optimizer state brought back inside the optimizer step), weights.py (the weights for the rollout sync),
closing.py (close()), and the micro-batch loop in colomem.grpo.step (shared with the CPU stand-in).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Collection, Iterator, Mapping, Optional

import torch
from torch import Tensor

from colomem._torch import mem_get_info
from colomem.engines.background import BackgroundSlot
from colomem.engines.lr_schedule import LrSchedule
from colomem.engines.pending_write import PendingWrite, WriteGuard
from colomem.engines.protocols import check_hold
from colomem.engines.recompute import recomputed_layers
from colomem.engines.reports import SwitchReport
from colomem.errors import ColomemError, InvalidArgumentError, NotAvailableError, PhaseOrderError
from colomem.swap import PendingReloads

from .config import (TESTED_DEEPSPEED, DeepSpeedConfig, check_keep_part, check_lora_spec, check_offload_args,
                     import_deepspeed, init_distributed)
from .process_group import DEFAULT_GROUP
from .state import (CATEGORIES, FUNCTIONAL_LINEAR, EngineState, collect_engine_state, left_behind,
                    release_cached_memory, trim_module_stack, worth_naming, zero3_global_holders)
from .model import build_model, check_model_dir
from .closing import close_trainer
from .deferred import DeferredOffload
from .at_step import AtStepReload
from .mapped_moments import MappedMoments
from .step_reload import ReloadAtStep, StepStartPeak, inner_torch_optimizer
from .strategies import ColomemOffload, DeepSpeedOffload, OffloadStrategy, ToOffload
from .weights import Staging, SyncSource, WeightExport


class DeepSpeedTrainer(AtStepReload, DeferredOffload):
    """The Trainer of colomem.engines.protocols on DeepSpeed ZeRO-2/3 (bf16).

    model_path: a local transformers checkpoint directory (nothing is downloaded), or an already built
        transformers causal LM (e.g. from a config, for benchmarks).
    config: a DeepSpeedConfig with every option (see there), or the options as keywords (not both).
    lora: a LoraSpec (peft adapter on the policy; the base with adapters off is the free KL reference) or
        None (full fine-tune). pool: the colomem.PinnedPool for offload="colomem" (default: one owned by the
        trainer). grpo: the GRPOConfig of the loss (default GRPOConfig()).

    Multi-GPU: start with torchrun (data parallel over all ranks); every rank calls every method. On ZeRO-3
    with several ranks, offload(prepare_sync=True) and named_weights() gather parameters collectively."""
    # one gradient reduction a step (DeepSpeed's coalesce_grad_reduction) instead of one a micro-batch: set
    # from DeepSpeedConfig.grad_reduction when the engine is built
    reduce_per_step = False

    def __init__(self, model_path: Any, *, config: Optional[DeepSpeedConfig] = None, lora: Any = None,
                 pool: Any = None, grpo: Any = None, shared_base: Optional[Mapping[str, Tensor]] = None,
                 **options: Any):
        if config is not None and options:
            raise InvalidArgumentError(f"DeepSpeedTrainer: pass the options in config or as keywords, not both "
                                       f"(got config and {', '.join(sorted(options))})")
        if config is None:
            config = DeepSpeedConfig(**options)
        elif not isinstance(config, DeepSpeedConfig):
            raise InvalidArgumentError(f"config must be a DeepSpeedConfig, not {type(config).__name__}")
        check_lora_spec(lora)
        if shared_base is not None and (lora is None or config.zero_stage != 2):
            raise InvalidArgumentError(
                "shared_base (the trainer's frozen base as the rollout engine's tensors) needs lora= and ZeRO-2: "
                "only a LoRA job's base is frozen, and ZeRO-3 would partition the base into buffers of its own")
        if not isinstance(model_path, torch.nn.Module):
            check_model_dir(model_path)
        if not torch.cuda.is_available():
            raise NotAvailableError("DeepSpeedTrainer needs a CUDA GPU; on a machine without one use "
                                    "colomem.engines.stand_ins.TorchTrainer (--backend cpu)")
        deepspeed = import_deepspeed()
        if grpo is None:
            from colomem.grpo.config import GRPOConfig
            grpo = GRPOConfig()
        self.config = config
        self.grpo = grpo
        self.zero_stage = config.zero_stage
        self.lora = lora
        self.micro_batch = config.micro_batch
        self.micro_batch_tokens = config.micro_batch_tokens
        self.grad_accum = config.accum_steps
        self.offload_method = config.offload
        self.timeout_s = float(config.timeout_s)
        self.overlap_reload = bool(config.overlap_reload)
        # "step": the optimizer state stays in the pool until the optimizer step has flattened and freed the
        # gradients (step_reload.py); the placement planner sets it when the step would not fit otherwise
        self.optimizer_reload = config.optimizer_reload
        self._step_reload: Optional[ReloadAtStep] = None
        self._start_peak: Optional[StepStartPeak] = None
        self._pending = PendingReloads()
        self._finishing = BackgroundSlot()   # finish_offload(background=True) while it runs
        self._writes = WriteGuard()          # checkpoint writes reading the pool's copies (prepare_save)
        self.deepspeed_version = deepspeed.__version__
        self.last_offload: Optional[SwitchReport] = None
        self.last_reload: Optional[SwitchReport] = None
        self.steps = 0
        self._closed = False
        self._offloaded = False
        self._offloaded_by: Optional[str] = None
        self._left_behind_named = False       # the (slow) scan of live tensors runs once per trainer
        self._sync: Optional[SyncSource] = None
        self._params_kept = False          # the last offload left the bf16 weights on the GPU
        self._lora_cache: Optional[dict[str, Tensor]] = None
        self._staging = Staging()
        self._pool = pool
        self._owns_pool = False
        self._strategies: dict[str, OffloadStrategy] = {}
        self.engine: Any = None
        self.model: Any = None
        self._ref_fn: Any = None
        self._fwd_stack: Optional[list] = None
        self._holds_linear = False
        self.shared: Any = None                 # SharedBaseReport: the base parameters are the engine's tensors
        self._shared_storages: frozenset = frozenset()

        self._holds_group = False
        group_before = DEFAULT_GROUP.started()
        self.rank, self.world_size, self.local_rank = init_distributed()
        torch.cuda.set_device(self.local_rank)
        self.device = torch.device("cuda", self.local_rank)

        torch.manual_seed(config.seed)
        model, self.shared = build_model(model_path, config, self.lora, self.device, shared_base)
        self.ds_config = config.build_ds_config(self.world_size)
        trainable = [p for p in model.parameters() if p.requires_grad]
        # deepspeed.initialize builds the learning-rate scheduler from the optimizer and engine.step() steps it
        self._schedule, self._peak_lr = config.lr_schedule or LrSchedule(), float(config.lr)
        scheduler = None if self._schedule.is_constant else (
            lambda optimizer: self._schedule.started(optimizer, self._peak_lr))
        # ZeRO-3's set-up replaces torch.nn.functional.linear process-wide: the last trainer to close puts it back
        # the default process group the set-up starts (one GPU, no torchrun) goes with the last trainer
        ((self.engine, _, _, _), self._holds_linear), self._holds_group = DEFAULT_GROUP.setup(
            lambda: FUNCTIONAL_LINEAR.setup(
                lambda: deepspeed.initialize(model=model, model_parameters=trainable, config=self.ds_config,
                                             lr_scheduler=scheduler)),
            before=group_before)
        self.model = self.engine.module
        if shared_base is not None:            # DeepSpeed's set-up (dtype, device, broadcast) kept the views
            from colomem.engines.shared_base import base_storages, check_still_shared

            check_still_shared(shared_base, self.model, self.shared)
            self._shared_storages = frozenset(base_storages(self.model))
        self._weights = WeightExport(self.model, zero_stage=self.zero_stage, world_size=self.world_size,
                                     device=self.device)
        self._fwd_stack = zero3_global_holders()[0] if self.zero_stage == 3 else None
        # one gradient reduction a step instead of one a micro-batch (DeepSpeedConfig.grad_reduction)
        self.reduce_per_step = config.reduces_per_step(self.world_size)
        try:
            if self.reduce_per_step and not hasattr(self.engine, "coalesce_grad_reduction"):
                raise NotAvailableError(f"grad_reduction='per_step' needs DeepSpeed's coalesce_grad_reduction, "
                                        f"which DeepSpeed {deepspeed.__version__} lacks; install "
                                        f"deepspeed=={TESTED_DEEPSPEED} or set grad_reduction='per_micro_batch'")
            stage = int(self.engine.zero_optimization_stage())
            if stage != self.zero_stage or not hasattr(self.engine.optimizer, "optimizer"):
                raise ColomemError(f"DeepSpeed built a stage-{stage} {type(self.engine.optimizer).__name__}, not "
                                   f"the ZeRO-{self.zero_stage} optimizer asked for; check the ds_config overrides")
            if lora is not None:
                from colomem.grpo.step import peft_reference_fn
                self._ref_fn = peft_reference_fn(self.engine, getattr(grpo, "temperature", 1.0))
        except BaseException:
            self.close()
            raise

    # -- state --------------------------------------------------------------------------------------------
    @property
    def offloaded(self) -> bool:
        return self._offloaded

    @property
    def optimizer(self):
        """DeepSpeed's ZeRO optimizer (its .optimizer is the inner AdamW), its state fully reloaded."""
        self.wait_reload()
        return self.engine.optimizer

    def state(self) -> EngineState:
        """The storages the engine holds on this GPU now, by category (what offload() moves); a shared base
        is the rollout engine's memory, not the trainer's, and is left out."""
        return collect_engine_state(self.engine, self.device, exclude=self._shared_storages)

    def state_bytes(self) -> dict[str, int]:
        """Bytes of each state category the engine holds on this GPU now (the planner's figures)."""
        return self.state().by_category()

    def memory(self) -> dict[str, int]:
        free, total = mem_get_info(self.device)
        out = {"allocated": torch.cuda.memory_allocated(self.device),
               "reserved": torch.cuda.memory_reserved(self.device), "driver_used": total - free,
               "driver_free": free, "pinned_pool": 0}
        if self.shared is not None:
            out["shared_base_bytes"] = int(self.shared.bytes_shared)
        if self._pool is not None and not self._pool.closed:
            out["pinned_pool"] = int(self._pool.stats()["reserved_bytes"])
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise PhaseOrderError("this DeepSpeedTrainer was closed; build a new one")

    def _check_resident(self, what: str) -> None:
        self._check_open()
        if self._offloaded:
            raise PhaseOrderError(f"{what} on an offloaded trainer; call reload() first")

    # -- training -----------------------------------------------------------------------------------------
    def train_step(self, batch: Any) -> dict[str, float]:
        """The optimizer steps of one batch (a GRPOBatch; grpo.num_iterations x grpo.mini_batches, one by
        default): micro-batches of micro_batch rows, weighted by their share of the batch over all ranks,
        gradients accumulated, one update per mini-batch. Returns rank-local metrics."""
        from colomem.grpo.step import train_on_batch

        self._check_resident("train_step()")
        if len(batch) == 0:
            raise InvalidArgumentError("train_step() got an empty batch; every rank needs at least one row")
        t0 = time.perf_counter()
        ref_fn = self._ref_fn if getattr(self.grpo, "kl_coef", 0.0) > 0 else None
        engine = self.engine
        stack = self._fwd_stack
        depth = len(stack) if stack is not None else 0

        try:
            out = train_on_batch(
                engine, batch, self.grpo, micro_batch=self.micro_batch, micro_batch_tokens=self.micro_batch_tokens,
                ref_logprobs_fn=ref_fn, device=self.device,
                before_micro=engine.set_gradient_accumulation_boundary, optimizer_step=self._optimizer_step,
                # per step: the micro-batches' gradients add up on the parameters, reduced once when it ends
                accumulation=engine.coalesce_grad_reduction if self.reduce_per_step else None,
                backward=lambda loss: engine.backward(loss, scale_wrt_gas=False),   # loss carries its weight
                # DeepSpeed averages the gradients over the data-parallel ranks (all of them): the weights
                # are the global token (or row) shares times world_size, summed over the default group
                world_size=self.world_size)
        finally:
            trim_module_stack(stack, depth)      # ZeRO-3's checkpoint recompute leaves submodules pushed
        out["recomputed_layers"] = recomputed_layers(self.model)      # train_on_batch left it in training mode
        # the optimizer step's kernels are still queued on return: wait for them here, or the next phase (the
        # weight sync, when nothing is offloaded) would start behind them and be timed with them
        if self.device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.current_stream(self.device).synchronize()
        out["train_step_s"] = time.perf_counter() - t0
        return out

    # -- offload / reload ---------------------------------------------------------------------------------
    def _strategy(self, method: str) -> OffloadStrategy:
        s = self._strategies.get(method)
        if s is not None:
            return s

        def collect() -> EngineState:
            return self.state()
        if method == "colomem":
            if self._pool is None:
                from colomem.pool import PinnedPool
                need = collect().nbytes() + (64 << 20)
                self._pool = PinnedPool(need)
                self._owns_pool = True
            moments = None
            if self.config.optimizer_state_memory == "mapped":
                moments = MappedMoments(lambda: inner_torch_optimizer(self.engine.optimizer), self._pool,
                                        self.timeout_s)
            s = ColomemOffload(collect, self._pool, self.device, self.timeout_s, moments=moments)
            if moments is not None:
                # the step's own hooks before the mapped state's (hooks run in the order registered): the peak is
                # read, and the moments come back timed, before its safety net finds them resident
                self._reload_at_step(s)
        elif method == "to":
            s = ToOffload(collect, self.device)
        else:
            s = DeepSpeedOffload(self.engine, collect)
        self._strategies[method] = s
        return s

    def offload(self, *, prepare_sync: bool = True, merged: bool = True, method: Optional[str] = None,
                keep: Collection[str] = (), defer: bool = False, hold: bool = False,
                keep_part: tuple[str, int] = ("", 0)) -> None:
        """Moves the engine's GPU state out (see DeepSpeedConfig.offload) and returns the memory to the
        driver. prepare_sync: the named weights stay readable for the sync while offloaded (host views of the
        pool copy, else staged host copies); merged: as in named_weights(); method: another offload method
        for this cycle (benchmarks). Colomem method only: keep, state categories (state.CATEGORIES) left on
        the GPU (with "params" the sync reads the weights there); keep_part (category, bytes), of a category
        not kept, whole tensors up to that many bytes left too; defer, the fp32 masters and Adam moments
        still copying on return (read by no one before the next optimizer step; finish_offload() waits and
        frees their memory); hold (with defer), that copy starting at start_offload() (or finish_offload()),
        not beside the rollout's wake (its mapping of fresh memory ran ~10x slower beside it). Report:
        `last_offload`."""
        self._check_resident("offload()")
        self._writes.wait(self.timeout_s)      # a checkpoint write still reading the copies this rewrites
        self.finish_offload()                  # a background end of the last offload, if one still runs
        self.wait_reload()                     # reloaded, never trained on: let the late copies finish first
        method = method or self.offload_method
        keep = check_offload_args(method, tuple(keep), defer, CATEGORIES)
        keep_part = check_keep_part(keep_part, keep, method, CATEGORIES)
        check_hold(defer, hold)
        if self.shared is not None:            # the adapter (a few MB) stays with the base it adapts
            keep = tuple(dict.fromkeys((*keep, "params", "other")))
        strategy = self._strategy(method)
        if isinstance(strategy, ColomemOffload):
            strategy.keep, strategy.keep_part = keep, keep_part
        self._params_kept = "params" in keep
        if self._params_kept:
            prepare_sync = False               # named_weights() reads them where they are
        dev = self.device
        torch.cuda.synchronize(dev)        # DeepSpeed's side streams (reduction, all-gather) included
        free0 = mem_get_info(dev)[0]
        t0 = time.perf_counter()
        if self.zero_stage == 3 and hasattr(self.engine.optimizer, "empty_partition_cache"):
            self.engine.optimizer.empty_partition_cache()     # gathered params are copies of the partitions
        plan: list = []
        staged = 0
        if prepare_sync:
            plan, staged = self._weights.plan_sync(merged, method == "colomem", self._staging, self._pool)
            if self.lora is not None:
                self._lora_cache = self._weights.lora_tensors(copy=True)
        t_sync = time.perf_counter() - t0
        if defer and isinstance(strategy, ColomemOffload):
            move = strategy.offload(defer_late=True, hold_late=hold)
        else:
            move = strategy.offload()
        self._offloaded, self._offloaded_by = True, method
        if prepare_sync:
            self._sync = SyncSource(merged, self._weights.resolve_sync(plan, strategy))
        # the deferred part's bytes, still on the GPU (copying out, or held back until start_offload())
        pending = strategy.pending_bytes if isinstance(strategy, ColomemOffload) else 0
        if pending:
            # no release here (the strategy released before the deferred copies started: a cudaFree now would
            # wait for them) and this stream only: a device-wide synchronize would wait for them too, and the
            # offload would last as long as the whole copy
            torch.cuda.current_stream(dev).synchronize()
        else:
            release_cached_memory()
            torch.cuda.synchronize(dev)
        free1 = mem_get_info(dev)[0]
        state = move.state
        if state is None:
            raise ColomemError(f"the {method} offload reported no engine state; this is a bug in the DeepSpeed "
                               "adapter (please report it)")
        left = torch.cuda.memory_allocated(dev)
        # A gc scan of live tensors costs about a second in a big process: name what stayed once, not on every
        # step's offload (the timed switch of a baseline would carry it every step), and only what stayed
        # beyond the categories kept and the part still copying out, which stay by design.
        diagnose = worth_naming(left, state.sizes, keep, pending + keep_part[1]) and not self._left_behind_named
        self._left_behind_named |= diagnose
        self.last_offload = SwitchReport(
            method, "offload", time.perf_counter() - t0, moved_bytes=move.nbytes, freed_bytes=free1 - free0,
            free_bytes=free1, allocated_bytes=left, reserved_bytes=torch.cuda.memory_reserved(dev),
            by_category=dict(state.sizes), unlisted=list(state.unlisted),
            kept_bytes=sum(n for _, n in state.skipped), move_seconds=move.seconds, collect_seconds=state.seconds,
            sync_seconds=t_sync, staged_bytes=staged, left_behind=left_behind(dev) if diagnose else "",
            deferred_bytes=pending)

    @property
    def defers_offload(self) -> bool:
        """offload(defer=True) is possible (the colomem method): the planner may send moments out behind the rollout."""
        return self.offload_method == "colomem"

    keeps_part = defers_offload       # offload(keep_part=...) needs the same: the colomem method

    def reload(self) -> None:
        """Brings the state back (the same tensor objects with colomem); training can continue."""
        self._reload(out_until_step=False)

    def optimizer_out_until_step(self) -> None:
        """For a trainer that stays whole through the rollout but whose optimizer step cannot hold Adam's
        moments beside the gradients' fp32 copy (the runner sends them out behind the rollout instead):
        the moments start copying to the pool now, behind the forward and backward that follow; the next
        optimizer step waits for that copy, gives the memory back before ZeRO casts the gradients, and
        brings the moments back inside the step. Colomem offload method only."""
        self._check_resident("optimizer_out_until_step()")
        if self.offload_method != "colomem":
            raise InvalidArgumentError(f"optimizer_out_until_step() needs the colomem offload method (not "
                                       f"{self.offload_method!r})")
        self.offload(keep=[c for c in CATEGORIES if c != "optim"], defer=True, prepare_sync=False)
        self._reload(out_until_step=True)

    def _reload(self, out_until_step: bool) -> None:
        self._check_open()
        if not self._offloaded:
            raise PhaseOrderError("reload() on a trainer that is not offloaded; call offload() first")
        if not out_until_step:
            self.finish_offload()             # a deferred part first: the set reloads once it is offloaded
        dev = self.device
        free0 = mem_get_info(dev)[0]
        t0 = time.perf_counter()
        method = self._offloaded_by or self.offload_method
        strategy = self._strategies[method]
        if (out_until_step or self.optimizer_reload == "step") and isinstance(strategy, ColomemOffload):
            move = strategy.reload(late=False)
            if strategy.late_outstanding:
                self._reload_at_step(strategy).arm()
                self._prefetch_moments(strategy)     # what fits beside the step's start comes back behind training
        elif self.overlap_reload and isinstance(strategy, ColomemOffload):
            move = strategy.reload(self._pending)
        else:
            move = strategy.reload()
        self._sync = None                 # host views die with the offload
        # This stream only: a device-wide synchronize would also wait for the deferred copies on colomem's
        # H2D stream, and the reload phase would last as long as the whole copy (docs/performance.md).
        torch.cuda.current_stream(dev).synchronize()
        free1 = mem_get_info(dev)[0]
        self.last_reload = SwitchReport(method, "reload", time.perf_counter() - t0, move.nbytes,
                                        free0 - free1, free1, torch.cuda.memory_allocated(dev),
                                        torch.cuda.memory_reserved(dev), move_seconds=move.seconds,
                                        deferred_bytes=self._pending.nbytes)
        self._offloaded, self._offloaded_by = False, None

    # -- weights for the sync -----------------------------------------------------------------------------
    def named_weights(self, merged: Optional[bool] = None) -> Iterator[tuple[str, Tensor]]:
        """(HF name, tensor) for every weight the rollout engine loads. With LoRA and merged=True (the default
        but with a shared base): base + scaling * B @ A, computed in fp32 without touching the adapter;
        merged=False: the base alone. A shared base by default: the adapter alone (peft names), since the
        rollout engine reads the base where it is.

        Resident: GPU tensors, valid until the iterator moves on (ZeRO-3 with several ranks gathers module
        by module, collectively: every rank must iterate to the end). Offloaded: host tensors prepared by
        offload(prepare_sync=True), valid until reload()."""
        self._check_open()
        if merged is None:
            if self.shared is not None:
                return iter(list(self._weights.lora_tensors(copy=False).items()))
            merged = True
        if self._offloaded and not self._params_kept:
            if self._sync is None:
                raise PhaseOrderError("named_weights() on an offloaded trainer needs offload(prepare_sync=True)")
            if self._sync.merged != merged:
                raise PhaseOrderError(f"the weights were prepared with merged={self._sync.merged}; call "
                                      f"offload(merged={merged}) to get the other kind")
            return iter(list(self._sync.items))
        return ((name, t) for name, t, _ in self._weights.iter_weights(merged))

    def lora_state(self) -> dict[str, Tensor]:
        """The adapter's tensors on the host, named as peft saves them (…lora_A.weight, …lora_B.weight)."""
        self._check_open()
        if self.lora is None:
            raise InvalidArgumentError("lora_state(): this trainer has no LoRA adapter (lora=None)")
        if self._offloaded and not self._params_kept:
            if self._lora_cache is None:
                raise PhaseOrderError("lora_state() on an offloaded trainer needs offload(prepare_sync=True)")
            return dict(self._lora_cache)
        return self._weights.lora_tensors(copy=True)

    # -- checkpoints --------------------------------------------------------------------------------------
    def prepare_save(self, path: Path, *, merged: bool = False, state: bool = True) -> PendingWrite:
        """This rank's engine state (checkpoint.py: `trainer-rank<R>.pt`; not with state=False) and, on rank 0,
        the model in HF format (`model/`: the peft adapter with LoRA; with merged, `model-merged/` too), ready
        to write (file I/O only). Offloaded by the colomem method, it reads the pool's copies where they are
        (no reload, no copy; the next offload and close() wait for the write); resident, it copies the state
        to the host now. Every rank calls it (ZeRO-3 gathers collectively)."""
        from . import checkpoint

        self._check_open()
        self.wait_reload()
        self.finish_offload()              # the pool copies it reads must be complete
        strategy = self._strategies.get(self._offloaded_by or "") if self._offloaded else None
        if self._offloaded and not isinstance(strategy, ColomemOffload):
            raise PhaseOrderError(f"save_state() on a trainer offloaded by {self._offloaded_by!r}: only the colomem "
                                  "offload keeps readable copies; save while resident")
        pooled = strategy if isinstance(strategy, ColomemOffload) else None
        stable = self._offloaded and not self._params_kept
        writes = [checkpoint.prepare_state(self, path, pooled)] if state else []
        writes += checkpoint.prepare_model(self, path, merged, stable)
        return self._writes.track(PendingWrite(writes, reads_pool=pooled is not None, path=path))

    def save_state(self, path: Path, *, merged: bool = False) -> None:
        """prepare_save(path, merged=merged), written now."""
        self.prepare_save(path, merged=merged).write()

    def load_state(self, path: Path) -> None:
        """A checkpoint's state into this freshly built, resident trainer (same model and layout)."""
        from . import checkpoint

        self._check_resident("load_state()")
        self.wait_reload()                 # it writes into the optimizer state in place: all of it on the GPU
        checkpoint.load_state(self, path)
        # the rate of the step it resumes at, from this run's flags (the engine steps the scheduler it holds)
        self.engine.lr_scheduler = self._schedule.started(self.engine.optimizer.optimizer, self._peak_lr, self.steps)

    # -- lifetime -----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Releases the engine, its GPU memory and the pool blocks; bounded by timeout_s; idempotent."""
        if self._closed:
            return
        self._closed = True
        close_trainer(self)

    def __enter__(self) -> "DeepSpeedTrainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
