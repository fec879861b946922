"""Build the rollout and the trainer for a RunConfig: vLLM + DeepSpeed on a GPU, or the CPU stand-ins.

`--backend auto` takes the GPU path when a CUDA GPU is visible and vllm and deepspeed are installed, the CPU
path otherwise (and says what the GPU path would need). The rollout is built first and put to sleep before
the trainer is built (DeepSpeed must initialise while vLLM sleeps), so a run starts in the state the phase
machine expects: trainer resident, rollout asleep. With --shared-base the rollout sleeps its KV cache only
and the trainer is built on its weights (colomem.runner.shared_base_job).
"""
from __future__ import annotations

import importlib.util
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from colomem.engines.protocols import Rollout, Trainer
from colomem.errors import InvalidArgumentError, NotAvailableError

from .kv_need import resolve_kv_cache
from .shared_base_job import SharedBase, engine_parameters, shared_base_problem

log = logging.getLogger(__name__)

GPU_NEEDS = ("a CUDA GPU visible to torch, vllm==0.24.0 and deepspeed==0.19.8 (pip install 'colomem[gpu]'), "
             "and colomem built with CUDA (nvcc at build time)")


@dataclass
class Engines:
    """What a run trains with; typed by protocol, so the type checker holds every engine to its protocol."""
    rollout: Optional[Rollout]
    trainer: Optional[Trainer]
    pool: Any = None
    backend: str = "cpu"
    tokenizer: Any = None
    notes: tuple = ()
    shared: Any = None                  # SharedBase (colomem.runner.shared_base_job) with --shared-base
    build_parts_s: dict = field(default_factory=dict)   # seconds each part took to build: pool, rollout, trainer

    def require(self) -> tuple[Rollout, Trainer]:
        """(rollout, trainer), both still open."""
        if self.rollout is None or self.trainer is None:
            raise InvalidArgumentError("the engines were closed (or never built); build them again")
        return self.rollout, self.trainer


def gpu_path_missing() -> list[str]:
    """What the GPU path lacks here (empty: it can run)."""
    missing = []
    try:
        import torch
        if not torch.cuda.is_available():
            missing.append("no CUDA GPU visible to torch")
    except ImportError:
        missing.append("torch is not installed")
    for mod, pin in (("vllm", "vllm==0.24.0"), ("deepspeed", "deepspeed==0.19.8")):
        if importlib.util.find_spec(mod) is None:
            missing.append(f"{mod} is not installed ({pin})")
    try:
        from colomem import _C
        if not _C.build_info().get("cuda"):
            missing.append("colomem was built without CUDA (host-only build)")
    except ImportError:
        missing.append("colomem._C is not built")
    return missing


def resolve_backend(choice: str) -> tuple[str, str]:
    """('gpu' | 'cpu', a sentence saying why)."""
    if choice == "cpu":
        return "cpu", "CPU backend (--backend cpu): transformers generate + plain torch AdamW"
    missing = gpu_path_missing()
    if choice == "gpu":
        if missing:
            raise NotAvailableError(f"--backend gpu cannot run here: {'; '.join(missing)}. The GPU path needs "
                                    f"{GPU_NEEDS}. Use --backend cpu for the small CPU run.")
        return "gpu", "GPU backend: vLLM rollouts + DeepSpeed training on the same GPU"
    if choice != "auto":
        raise InvalidArgumentError(f"backend must be auto, gpu or cpu, got {choice!r}")
    if missing:
        return "cpu", (f"no GPU path here ({'; '.join(missing)}). Running the small CPU stand-in instead "
                       f"(transformers generate + plain torch AdamW, same loop and phases). The GPU path needs "
                       f"{GPU_NEEDS}.")
    return "gpu", "GPU backend (auto): vLLM rollouts + DeepSpeed training on the same GPU"


def _pool(cfg, *, cpu: bool):
    if cfg.switch != "colomem":
        return None
    from colomem.pool import PinnedPool
    from colomem.units import parse_bytes

    if cpu:      # host path: grow in small segments, no pinning
        return PinnedPool(min(parse_bytes(cfg.pool_bytes), 64 << 20), max_bytes=cfg.pool_max_bytes,
                          segment_bytes="64MiB", pin=False)
    return PinnedPool(cfg.pool_bytes, max_bytes=cfg.pool_max_bytes)


def build_engines(cfg, backend: str, model_path: str, tokenizer, ranks, *, grad_accum: int,
                  log_fn=print) -> Engines:
    """Rollout (asleep) + trainer (resident) + pool for `backend`; closes what it built if a later part fails."""
    pool = None
    rollout: Optional[Rollout] = None
    trainer: Optional[Trainer] = None
    shared: Optional[SharedBase] = None
    problem = shared_base_problem(cfg, backend)
    if problem:
        raise InvalidArgumentError(problem)
    parts: dict[str, float] = {}
    last = [time.perf_counter()]

    def lap(part: str) -> None:            # the seconds since the previous part was built
        now = time.perf_counter()
        parts[part], last[0] = now - last[0], now
    try:
        if backend == "gpu":
            if cfg.tensor_parallel_size > 1 and cfg.effective_engine != "in-rank":
                # A cross-process engine belongs to one rank; its TP workers would be processes of its own
                # on GPUs the other ranks train on (the run config refuses this too: here for callers of
                # build_engines that build the config some other way)
                raise InvalidArgumentError(
                    f"tensor_parallel_size={cfg.tensor_parallel_size} needs the in-rank engine (--engine in-rank "
                    "or auto): the cross-process engine cannot span the torchrun ranks")
            pool = _pool(cfg, cpu=False)
            lap("pool")
            from colomem.engines.vllm import VLLMRollout

            kv_bytes, said = resolve_kv_cache(cfg, model_path, ranks.world_size)
            if said:
                log_fn(said)
            vcfg = cfg.vllm_config(device=ranks.local_rank, rollout_group=ranks.rollout_group,
                                   kv_cache_bytes=kv_bytes)
            vllm_rollout = VLLMRollout(model_path, config=vcfg)
            rollout = vllm_rollout
            base = None
            if cfg.shared_base:                  # its weights stay: they become the trainer's base
                vllm_rollout.sleep(keep_weights=True)
                base = engine_parameters(vllm_rollout, cfg.phase_timeout_s)
            else:
                vllm_rollout.sleep()             # DeepSpeed initialises while vLLM sleeps
            if cfg.trainer_expandable:           # vLLM's engine process has started with the environment as it was
                from colomem import _torch

                if _torch.use_expandable_segments():
                    log_fn("[colomem] trainer memory: torch's expandable segments from here on")
            lap("rollout")
            from colomem.engines.deepspeed import DeepSpeedTrainer

            ds_trainer = DeepSpeedTrainer(model_path, config=cfg.deepspeed_config(grad_accum), lora=cfg.lora,
                                          pool=pool, grpo=cfg.grpo, shared_base=base)
            trainer = ds_trainer
            if base is not None:
                shared = SharedBase(base, ds_trainer.shared, merged_rollout=not cfg.shared_base_adapter)
        else:
            pool = _pool(cfg, cpu=True)
            lap("pool")
            from colomem.engines.stand_ins import HFRollout, TorchTrainer

            hf_rollout = HFRollout(model_path, eos_token_id=tokenizer.eos_token_id,
                                   pad_token_id=tokenizer.pad_token_id, trust_remote_code=cfg.trust_remote_code,
                                   lora=cfg.lora if cfg.shared_base_adapter else None,
                                   seed=cfg.rollout_engine_seed(ranks.rollout_group))
            rollout = hf_rollout
            hf_rollout.sleep(keep_weights=cfg.shared_base)
            cpu_base = hf_rollout.base_parameters() if cfg.shared_base else None
            lap("rollout")
            torch_trainer = TorchTrainer(
                model_path, lr=cfg.lr, micro_batch=cfg.micro_batch, micro_batch_tokens=cfg.micro_batch_tokens,
                grad_accum=grad_accum, grpo=cfg.grpo,
                lora=cfg.lora, pool=pool, weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
                seed=cfg.seed, gradient_checkpointing=cfg.gradient_checkpointing,
                checkpoint_every=cfg.checkpoint_every, trust_remote_code=cfg.trust_remote_code,
                process_group=ranks.group, world_size=ranks.world_size,
                swap_timeout_s=cfg.phase_timeout_s, overlap_reload=cfg.overlap_reload, shared_base=cpu_base,
                optimizer_reload=cfg.start_optimizer_reload, optimizer_state_memory=cfg.optimizer_state_memory,
                torch_compile=cfg.torch_compile, lr_schedule=cfg.lr_schedule("cpu"))
            trainer = torch_trainer
            if cpu_base is not None:
                shared = SharedBase(cpu_base, torch_trainer.shared, merged_rollout=not cfg.shared_base_adapter)
        lap("trainer")
        if cfg.torch_compile and ranks.rank == 0:          # every rank compiles the same parts
            from colomem.engines.compile import compiled_parts

            log_fn(f"[colomem] training: torch.compile on {compiled_parts(trainer.model)} parts of the decoder "
                   "layers (they compile in the first steps)")
        return Engines(rollout, trainer, pool, backend, tokenizer, shared=shared, build_parts_s=parts)
    except BaseException:
        close_engines(Engines(rollout, trainer, pool, backend, shared=shared))
        raise


def close_engines(engines: Engines, log_fn: Optional[Callable[[str], None]] = None) -> list[str]:
    """Closes rollout, trainer and pool, each even if another fails; returns the failures as text."""
    errors = []
    # the trainer goes first when its base is the rollout engine's weights (nothing may read them once the
    # engine is closed) and when the engine runs in this process: vLLM's shutdown there tears down the default
    # process group, which DeepSpeed's engine.destroy() still uses
    first_trainer = engines.shared is not None or bool(getattr(engines.rollout, "engine_in_process", False))
    for name in (("trainer", "rollout") if first_trainer else ("rollout", "trainer")):
        obj = getattr(engines, name)
        if obj is None:
            continue
        try:
            obj.close()
        except Exception as e:  # noqa: BLE001  (cleanup goes on)
            errors.append(f"closing the {name} failed: {type(e).__name__}: {e}")
        setattr(engines, name, None)
    if engines.pool is not None:
        try:
            engines.pool.close(force=True)
        except Exception as e:  # noqa: BLE001
            errors.append(f"closing the pinned pool failed: {type(e).__name__}: {e}")
        engines.pool = None
    for text in errors:
        (log_fn or log.warning)(text)
    return errors
