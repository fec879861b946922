"""--shared-base: one copy of a LoRA job's frozen base on the GPU, read by vLLM and the trainer alike.

The trainer's model is built without weights (meta device) and its base parameters become views of the
rollout engine's (colomem.engines.shared_base.alias_base); only the adapter is the trainer's own. So:
- the rollout never sleeps its weights: between rollouts it releases only its KV cache (VLLMRollout's
  `sleep(keep_weights=True)`), and the next awake window starts at the sync;
- the sync sends the adapter alone (vLLM serves it through its LoRA support: lora_mode "adapter"), or with
  --shared-base-rollout merged writes base + scaling * B @ A into the base for the rollout, which then decodes
  from plain weights, and the adapted weights go back from a host copy after it (colomem.engines.base_restore);
- the trainer's offload never moves the base (it is the engine's memory) and keeps the adapter, a few MB;
- nobody may write into the base: a sampled checksum of it runs in every step's check phase and a full one
  at the end (BaseChecksum), and the trainer's base parameters are frozen (requires_grad False), so neither
  autograd nor DeepSpeed's optimizer (ZeRO-2 builds its groups from trainable parameters only) touches them.

What it needs, checked before anything starts (`shared_base_problem`): LoRA, the colomem switch, ZeRO-2,
tensor-parallel size 1 and, on the GPU, vLLM in the trainer's process (--engine in-rank; `auto` picks it).
"""
from __future__ import annotations

import time
from typing import Any, Mapping, Optional

from colomem.errors import SharedBaseError


def shared_base_problem(cfg, backend: Optional[str] = None) -> Optional[str]:
    """Why this run config cannot share its base (None: it can, or it does not ask to). backend: 'gpu' or
    'cpu' once known (the engine check needs it)."""
    if not cfg.shared_base:
        if cfg.shared_base_rollout != "adapter":
            return ("--shared-base-rollout merged merges the adapter into the base the rollout engine and the "
                    "trainer share; without --shared-base the rollout already gets merged weights of its own")
        return None
    if cfg.lora is None:
        return ("--shared-base shares a LoRA job's frozen base with the rollout engine; a full fine-tune trains "
                "every weight, so there is nothing frozen to share (add --lora, or drop --shared-base)")
    if cfg.switch != "colomem":
        return ("--shared-base needs the colomem switch: the timesplit baseline puts vLLM's weights to sleep, "
                "and the trainer would lose its base with them")
    if cfg.zero_stage == 3:
        return ("--shared-base needs --zero-stage 2: ZeRO-3 partitions every parameter, the frozen base too, "
                "into flat buffers of its own, so the base could not stay the rollout engine's tensors (ZeRO-2 "
                "leaves frozen parameters alone)")
    if cfg.tensor_parallel_size > 1:
        return (f"--shared-base needs tensor_parallel_size 1 (got {cfg.tensor_parallel_size}): a tensor-parallel "
                "engine holds a shard of every weight on each rank while the trainer needs whole tensors")
    if cfg.sleep_level is not None or cfg.weights_backup is not None:
        return ("--shared-base keeps vLLM's weights mapped (only its KV cache sleeps): leave --sleep-level and "
                "--weights-backup unset")
    if cfg.engine == "cross-process" and backend != "cpu":
        return ("--shared-base needs vLLM in the trainer's process (--engine in-rank, or auto): the "
                "cross-process engine holds its weights in another process")
    if backend == "gpu" and cfg.dtype != "bfloat16":
        return (f"--shared-base on the GPU needs --dtype bfloat16 (got {cfg.dtype}): the trainer trains in "
                "bfloat16, and its base is vLLM's tensors, so both must hold that dtype")
    return None


def engine_parameters(rollout: Any, timeout_s: float) -> dict[str, Any]:
    """vLLM's model parameters by name, the tensors themselves (its worker runs in this process: --engine
    in-rank), names as vLLM's model has them (its tied lm_head included)."""
    def named(worker):
        return dict(worker.model_runner.model.named_parameters(remove_duplicate=False))

    out = rollout.llm.collective_rpc(named, timeout=timeout_s)
    if len(out) != 1 or not isinstance(out[0], dict) or not out[0]:
        raise SharedBaseError("vLLM's worker did not hand over its parameters in this process: sharing the base "
                              "needs the in-rank engine (--engine in-rank) with one worker per rank")
    return out[0]


class SharedBase:
    """The job's shared base: what was shared (the report), the rollout's tensors the trainer reads, and the
    checksum guard over them."""

    def __init__(self, engine_params: Mapping[str, Any], report: Any, merged_rollout: bool = False):
        from colomem.engines.base_guard import BaseChecksum
        from colomem.engines.shared_base import shared_tensors

        if not report.mapped:
            raise SharedBaseError("sharing the base mapped no parameter: the rollout engine's weights and the "
                                  "trainer's model do not match (another model, or a tensor-parallel engine)")
        self.report = report
        self.tensors = shared_tensors(engine_params, report)
        self.guard = BaseChecksum(self.tensors)
        self.checks = 0
        self.last_check_s = 0.0
        # --shared-base-rollout merged: the base holds merged weights through each rollout (BaseRestore)
        self.merged_rollout = bool(merged_rollout)
        self.restorer: Any = None

    def merge_weights(self, trainer: Any, pool: Any = None) -> Any:
        """The sync's weights in merged mode: the adapter merged into the shared base in place (the base is
        the rollout's own weights), then those adapted weights by name for the rollout's load, which finds
        them in its own memory (its checks and the prefix cache's reset follow the load as for any sync). The
        adapted weights are copied to the host first (once) and marked as merged before anything is written,
        so a sync that fails half way is restored too."""
        if self.restorer is None:
            from colomem.engines.base_restore import BaseRestore

            self.restorer = BaseRestore(trainer.model, pool)      # the host copy in the job's pinned pool
        # a base still merged (its restore after a failed window failed too) must not be merged onto again:
        # the merge reads the base it writes
        self.restorer.restore()
        return self.restorer.merge_in_place(trainer.model)

    def after_rollout(self) -> None:
        """In merged mode, once the rollout engine no longer reads the merged weights: the base back as it
        was, then the sampled checksum (which, here, checks the restore)."""
        if self.restorer is not None and self.restorer.merged:
            self.restorer.restore()
            self.check()

    def restore_after_failure(self) -> None:
        """The base back after a window that failed (merged mode); nothing to do otherwise."""
        if self.restorer is not None:
            self.restorer.restore()                  # a no-op unless a merge wrote the base

    def restore_copy_bytes(self) -> int:
        """GPU bytes a copy of the merged rollout's restore source would take there (0: no merged rollout yet,
        or nothing to gain): what the placement planner weighs against the memory its placement leaves."""
        return self.restorer.device_bytes() if self.restorer is not None else 0

    def hold_restore_on_device(self) -> int:
        """The restore's source copied into GPU memory (BaseRestore.hold_on_device); returns the bytes taken."""
        return self.restorer.hold_on_device() if self.restorer is not None else 0

    @property
    def nbytes(self) -> int:
        return int(self.report.bytes_shared)

    def check(self) -> None:
        """The sampled checksum (a few windows of every tensor, a different part each call); SharedBaseError
        naming the tensor when the base changed."""
        t0 = time.perf_counter()
        self.guard.sampled()
        self.checks += 1
        self.last_check_s = time.perf_counter() - t0

    def check_full(self) -> float:
        """Every byte of the base against the checksum taken when it was shared; returns the seconds."""
        t0 = time.perf_counter()
        self.guard.full()
        return time.perf_counter() - t0

    def metrics(self) -> dict:
        out = {"shared_base/bytes": self.nbytes, "shared_base/check_s": self.last_check_s}
        if self.restorer is not None:
            out.update({"shared_base/restore_s": self.restorer.last_restore_s,
                        "shared_base/restore_bytes": self.restorer.nbytes,
                        "shared_base/merge_s": self.restorer.last_merge_s})
        return out

    def summary(self) -> dict:
        return {"lora_base_copies_on_gpu": 1, "bytes_shared": self.nbytes,
                "rollout": "merged" if self.merged_rollout else "adapter",
                "restores": self.restorer.restores if self.restorer is not None else 0,
                "restore_copy": None if self.restorer is None else "gpu" if self.restorer.on_device else "host",
                "parameters_mapped": len(self.report.mapped), "checks": self.checks,
                "not_mapped": dict(self.report.not_mapped)}


__all__ = ["SharedBase", "shared_base_problem"]
