"""Run configuration: pydantic models loaded from a YAML file and CLI flags (flags win).

Every field of `RunConfig`, `GRPOConfig` and `LoraSpec` is a flag: `--steps 40`, `--clip-eps 0.2`,
`--lora` (enable with defaults), `--lora-r 16`, `--no-lora`. Validation errors name the field and where its
value came from, e.g. ``grpo.clip_eps = -1 (from --clip-eps): Input should be greater than 0``.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

from pydantic import Field, PrivateAttr, field_validator, model_validator

from colomem._checkpoint import cached_hub_model, checkpoint_problem
from colomem.engines.lr_schedule import LrSchedule
from colomem.errors import ConfigError, InvalidArgumentError
from colomem.grpo.config import GRPOConfig, LoraSpec, _Strict
from colomem.units import parse_bytes

if TYPE_CHECKING:
    from colomem.engines.deepspeed.config import DeepSpeedConfig
    from colomem.engines.vllm.config import VLLMConfig


# --kv-release auto lends the KV cache's tail once the lent tail's GPU tests have passed on vLLM
# (tests/gpu/test_vllm_kv_sleep_gpu.py); until then it releases whole layers, as --kv-release layers does
KV_TAIL_BY_DEFAULT = False


class RunConfig(_Strict):
    """One colocated GRPO run. configs/default.yaml is the embedded tiny job."""
    # what to train
    model: Optional[str] = Field(None, description="local checkpoint directory, or a hub id already in the "
                                                   "local Hugging Face cache; unset = config-built model")
    model_shape: str = Field("tiny", description="shape of the config-built model when --model is unset")
    task: str = Field("successor", description="built-in task (colomem.grpo.tasks)")
    task_options: dict[str, Any] = Field(default_factory=dict)
    dataset: Optional[str] = Field(None, description="prompts from a dataset instead of the task: .jsonl, .json, "
                                                     ".parquet or a save_to_disk folder (needs --rewards and "
                                                     "--max-new-tokens)")
    prompt_key: str = Field("prompt", description="the dataset's prompt column: a string or chat messages; every "
                                                  "other column reaches the rewards as a keyword")
    chat_template: str = Field("auto", description="chat prompts: auto (the tokenizer's template), none (refuse "
                                                   "them), or a Jinja file")
    rewards: Optional[list[str]] = Field(None, description="reward fns: built-in names or module:function; "
                                                           "unset = the task's reward")
    reward_weights: Optional[list[float]] = Field(None, description="one weight per reward function, in order "
                                                                    "(TRL's reward_weights): a sample's reward "
                                                                    "is their weighted sum; unset = 1 each")
    trust_remote_code: bool = False
    # held-out evaluation (colomem.runner.evaluation): greedy completions through the rollout engine
    eval_dataset: Optional[str] = Field(None, description="held-out prompts to evaluate on, read like --dataset "
                                                          "(same --prompt-key, chat template and length filter)")
    eval_every: Optional[int] = Field(None, gt=0, description="evaluate the initial weights, after every N steps "
                                                              "and after the last; unset with --eval-dataset: "
                                                              "the initial and the final weights only")
    eval_prompts: Optional[int] = Field(None, gt=0, description="evaluate on the first K prompts of the eval set "
                                                                "(in file order); unset = all, at most 512 (64 "
                                                                "drawn from a built-in task)")
    # schedule
    steps: int = Field(40, gt=0)
    cpu_steps: int = Field(20, gt=0, description="steps when the CPU backend runs and --steps is not given")
    prompts_per_step: int = Field(32, gt=0, description="prompts per step over all ranks")
    seed: int = 0
    # trainer
    lr: float = Field(5e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    lr_scheduler: Literal["constant", "constant_with_warmup", "linear", "cosine", "cosine_with_min_lr"] = Field(
        "constant", description="the learning rate over the run (transformers' schedulers, TRL's "
                                "lr_scheduler_type): linear and cosine decay to 0 at the last step, "
                                "cosine_with_min_lr to --min-lr-rate x --lr")
    warmup_steps: Optional[int] = Field(None, ge=0, description="steps whose learning rate rises linearly from 0 "
                                                               "to --lr before the schedule's decay")
    warmup_ratio: Optional[float] = Field(None, ge=0, lt=1, description="the warmup as a fraction of the run's "
                                                                        "steps instead of --warmup-steps")
    min_lr_rate: Optional[float] = Field(None, ge=0, le=1, description="cosine_with_min_lr: the last step's "
                                                                       "learning rate as a fraction of --lr "
                                                                       "(default 0.1)")
    max_grad_norm: Optional[float] = Field(1.0, gt=0)
    micro_batch: int = Field(64, gt=0, description="sequences per forward/backward")
    micro_batch_tokens: Optional[int] = Field(None, gt=0, description="micro-batches by a token budget instead "
                                              "of --micro-batch rows: rows go longest first while rows x the "
                                              "longest stays within it (verl's ppo_max_token_len_per_gpu)")
    grad_accum: Optional[int] = Field(None, gt=0, description="unset = rows per rank / micro_batch")
    zero_stage: Literal[2, 3] = Field(2, description="DeepSpeed ZeRO stage of the GPU trainer (2: optimizer "
                                                     "state and gradients sharded; 3: parameters too)")
    lora: Optional[LoraSpec] = None
    gradient_checkpointing: bool = False
    checkpoint_every: int = Field(1, ge=1, description="with --gradient-checkpointing: recompute every K-th "
                                  "decoder layer only (1: all of them; 2: half: less recompute, more memory)")
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    # rollout
    gpu_memory_utilization: float = Field(0.2, gt=0, le=1)
    kv_cache_bytes: Optional[str] = Field(None, description="vLLM's KV cache on each GPU, instead of "
                                          "--gpu-memory-utilization's share: a size (4GiB), or auto: what a "
                                          "rank's rollout can hold at most (its sequences at once, each at "
                                          "--max-model-len, and a quarter more); the memory it does not take is the "
                                          "trainer's, so less moves")
    max_model_len: int = Field(256, gt=0)
    tensor_parallel_size: int = Field(1, gt=0)
    enforce_eager: bool = True
    rollout_seeding: Literal["request", "engine"] = Field(
        "request", description="request: every prompt's completions drawn from a seed of their own (the run's "
                               "seed, the step, the prompt), so a resumed run samples exactly what an unbroken "
                               "one did; engine: vLLM's own generator, seeded once when it starts (as TRL does), "
                               "which spares vLLM's sampler a step per seeded request at every decode step, but "
                               "the samples then depend on how vLLM batched the requests and a resumed run "
                               "does not repeat them")
    seeded_noise: Literal["vllm", "batched"] = Field(
        "batched", description="with request seeding, how vLLM's sampler draws the seeded requests' noise: batched "
                               "(every request of a step in one launch, from a generator keyed by each request's "
                               "seed: the same tokens whatever the batch, not the tokens of vLLM's own draw) or "
                               "vllm (its own draw, one launch per request at every decode step)")
    # phase switch
    backend: Literal["auto", "gpu", "cpu"] = "auto"
    switch: Literal["colomem", "timesplit"] = Field(
        "colomem", description="colomem: pool swaps + weight bridge; timesplit: vLLM level-1 sleep + "
                               "DeepSpeed offload_states (the baseline)")
    offload: Literal["auto", "all", "optimizer", "none"] = Field(
        "auto", description="colomem switch, what the trainer offloads while the rollout runs: auto (measured "
                            "on the first step: nothing when both fit, else the state that does not fit beside "
                            "the rollout, Adam moments first), all, optimizer (fp32 masters and Adam moments), "
                            "none")
    rollout_sleep: Literal["auto", "always", "never", "alternate"] = Field(
        "auto", description="colomem switch, whether vLLM sleeps while the trainer trains: auto (not when "
                            "both fit with nothing moving, unless the recompute --trim-recompute leaves costs "
                            "more than the sleep and wake, both measured in the first step), always, never (needs offload none or auto), "
                            "alternate (a measurement, with offload none: every other step, so both layouts "
                            "run in one process; each step's metrics say which)")
    kv_release: Literal["auto", "tail", "layers", "all"] = Field(
        "auto", description="colomem switch with rollout_sleep auto, what a sleeping vLLM gives the trainer: auto "
                            "(only the part of its KV cache training needs, weights and the rest staying mapped; "
                            "as layers for now), tail (that part lent as the tail of every layer's cache: the "
                            "rollout starts at once and maps it back only as its blocks run short; whole layers "
                            "where vLLM's layout does not allow it), layers (that part in whole layers, mapped "
                            "back before each rollout), all (vLLM's whole sleep, weights included)")
    placement_margin: Optional[str] = Field(None, description="GPU memory a placement leaves free; unset = "
                                                              "the larger of 2 GiB and 3 percent of the GPU")
    sleep_level: Optional[Literal[1, 2]] = Field(None, description="unset: colomem 2, timesplit 1")
    weights_backup: Optional[Literal["vllm", "pool"]] = Field(None, description="unset: vllm")
    pool_bytes: str = Field("1GiB", description="pinned pool initial size (grows by segments)")
    pool_max_bytes: Optional[str] = Field(None, description="pinned pool cap; unset = no cap")
    bucket_bytes: str = Field("auto", description="weight-bridge bucket size; auto: 512MiB, grown after the "
                                                  "first step (up to 4GiB) when the placement leaves the memory")
    engine: Literal["auto", "in-rank", "cross-process"] = Field(
        "auto", description="where vLLM runs: cross-process (its engine in a process of its own, weights over the "
                            "bridge), in-rank (inside every torchrun rank, distributed_executor_backend "
                            "external_launcher: each rank holds its tensor-parallel shard and reads its trainer's "
                            "tensors in place; it starts sooner), auto (in-rank; cross-process with "
                            "--trainer-expandable at tensor_parallel_size 1, or when this process already ran "
                            "an engine with sleep mode)")
    shared_base: bool = Field(False, description="LoRA: the trainer's frozen base is the rollout engine's "
                                                 "weights (one copy on the GPU; vLLM in the trainer's process, "
                                                 "ZeRO-2, tensor_parallel_size 1): vLLM sleeps only its KV cache "
                                                 "and gets the adapter as a LoRA adapter")
    shared_base_rollout: Literal["adapter", "merged"] = Field(
        "adapter", description="with --shared-base, how the rollout engine serves the trainer's adapter: adapter "
                               "(vLLM's LoRA support: nothing of the base is written) or merged (base + scaling * "
                               "B @ A written into the base for the rollout, so vLLM decodes from plain weights "
                               "without its LoRA kernels; the adapted weights go back from a host copy, taken "
                               "once, after every rollout: one host-to-device copy of them a step)")
    overlap_offload: bool = Field(False, description="colomem switch: the trainer's optimizer state (fp32 masters, "
                                                    "Adam moments) copies out while vLLM's weights wake, sync and "
                                                    "are checked; the KV cache wakes once it finished")
    overlap_reload: bool = Field(True, description="colomem switch: the trainer's optimizer state (fp32 "
                                                   "masters, Adam moments) reloads behind forward/backward")
    optimizer_reload: Literal["auto", "overlap", "step"] = Field(
        "auto", description="colomem switch, when the offloaded optimizer state (fp32 masters, Adam moments) "
                            "comes back: overlap (behind forward/backward), step (inside the optimizer step, "
                            "after the gradients are cast to fp32 and freed: not hidden, but the step's peak "
                            "stays the first step's), auto (step only when the step would not fit otherwise)")
    optimizer_state_memory: Literal["torch", "mapped"] = Field(
        "torch", description="where the DeepSpeed trainer keeps Adam's moments: torch (its allocator; they move "
                             "whole) or mapped (memory colomem maps chunk by chunk, from their first offload on: "
                             "with optimizer_reload step, the part that fits beside the step's peak comes back "
                             "behind forward/backward, only the rest inside the step); colomem offload only")
    grow_micro_batch: bool = Field(False, description="after the measuring step, train with the largest "
                                                      "micro-batch (or --micro-batch-tokens budget) that the "
                                                      "placement's free memory holds, estimated from that step's "
                                                      "training peak (what the training hint names); the update "
                                                      "stays the same up to rounding; with --trim-recompute, in "
                                                      "the memory the trimmed layers leave")
    trim_recompute: Union[bool, Literal["auto"]] = Field(
        "auto", description="with --gradient-checkpointing, after the measuring step: checkpoint only as many "
                            "decoder layers as the memory the placement leaves free while training requires (what "
                            "the checkpointing hint names): less recompute, the same gradients; before "
                            "--grow-micro-batch takes what is left. auto: wherever the placement is measured "
                            "(--switch colomem with --offload auto or --rollout-sleep auto) and checkpointing is "
                            "on; false: every checkpointed layer stays so, as configured")
    torch_compile: bool = Field(False, description="torch.compile each decoder layer's attention, MLP and norms "
                                                   "for training: fused kernels and far less host work a "
                                                   "micro-batch (small micro-batches wait on the host); the "
                                                   "first steps compile (tens of seconds); ZeRO-2 only")
    grad_reduction: Literal["auto", "per_step", "per_micro_batch"] = Field(
        "auto", description="DeepSpeed ZeRO-2, when a step's gradients are reduced: per_step (they add up on the "
                            "parameters over the micro-batches and are reduced once, before the optimizer step: "
                            "far less host work a micro-batch), per_micro_batch (DeepSpeed's default: after "
                            "every micro-batch's backward), auto (per_step on one rank, where the step is the "
                            "same bit for bit; per_micro_batch on several)")
    trainer_expandable: bool = Field(False, description="the trainer's process takes all of its CUDA memory "
                                                        "from torch's expandable segments, switched on once "
                                                        "vLLM's engine process has started (vLLM refuses them in "
                                                        "its own process), so releasing the trainer's memory "
                                                        "never waits for copies in flight; cross-process engine "
                                                        "only")
    phase_timeout_s: float = Field(900.0, gt=0, description="longest any one phase may take")
    barrier_timeout_s: float = Field(300.0, gt=0, description="longest a rank waits for the others")
    # output
    out: Optional[str] = Field(None, description="output directory; unset = runs/<timestamp>")
    plots: bool = True
    save_every: Optional[int] = Field(None, gt=0, description="checkpoint every N steps and after the last, "
                                                              "into <out>/checkpoints/step-<N>")
    save_merged: bool = Field(False, description="with LoRA: checkpoints also hold the full model with the "
                                                 "adapter merged (model-merged/)")
    keep_checkpoints: int = Field(3, gt=0, description="how many of the newest checkpoints to keep")
    save_final: bool = Field(True, description="after the last step, the trained model in Hugging Face format "
                                               "into <out>/model (the peft adapter with LoRA; with --save-merged "
                                               "also <out>/model-merged), linked from the last step's checkpoint "
                                               "when there is one; a run stopped early writes none")
    save_background: bool = Field(True, description="write a checkpoint's files in a thread while the next "
                                                    "step runs (the run waits only for what is left of the "
                                                    "write at the offload after it); off: the run waits for "
                                                    "the whole write")
    resume: Optional[str] = Field(None, description="continue from a checkpoint: a step-<N> folder, or auto (the "
                                                    "newest under --out)")
    report_to: list[str] = Field(default_factory=lambda: ["auto"],
                                 description="metrics besides metrics.jsonl: auto (tensorboard when installed), "
                                             "tensorboard, wandb (WANDB_MODE=offline works without a network), "
                                             "none; a comma list")
    progress: bool = True
    memory_alarm_mib: float = Field(256.0, ge=0, description="alarm when memory left after sleep grows more")
    log_samples: int = Field(2, ge=0, description="completions printed per step by rank 0 (verbose)")
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)

    _explicit: set[str] = PrivateAttr(default_factory=set)   # fields set on the command line
    # whether this process held a sleeping vLLM engine's memory when the config was made: --engine auto then
    # starts vLLM in a process of its own (observed once, so the choice holds for the whole run)
    _engine_held: bool = PrivateAttr(default=False)

    @field_validator("pool_bytes", "bucket_bytes", "pool_max_bytes", "placement_margin", "kv_cache_bytes")
    @classmethod
    def _size(cls, v, info):
        if v is not None and not (info.field_name in ("bucket_bytes", "kv_cache_bytes") and v == "auto"):
            # a margin of 0 is a choice; a KV cache of 0 holds no sequence
            if parse_bytes(v) <= 0 and info.field_name == "kv_cache_bytes":
                raise ValueError(f"{info.field_name} must be positive, got {v!r}")
        return v

    @field_validator("trim_recompute", mode="before")
    @classmethod
    def _bool_or_auto(cls, v):
        # one message for the field, not one for each member of the union
        if v is True or v is False or v == "auto":
            return v
        raise ValueError("should be true, false or auto")

    @field_validator("model")
    @classmethod
    def _model_exists(cls, v):
        if v is None:
            return v
        snapshot, why = cached_hub_model(v)       # a hub id the user already fetched: its cached snapshot
        if why:
            raise ValueError(why)
        v = snapshot or v
        problem = checkpoint_problem(v)
        if problem:
            raise ValueError(problem + " (or leave --model unset for the config-built model)")
        return str(Path(v).expanduser().resolve())

    @model_validator(mode="after")
    def _cross(self):
        from .inrank import engine_problem

        from .shared_base_job import shared_base_problem

        if self.engine == "auto":
            from colomem.engines.vllm.engine_calls import sleeping_engine_bytes

            self._engine_held = sleeping_engine_bytes() > 0
        problem = (engine_problem(self.engine, self.tensor_parallel_size, self.backend)
                   or shared_base_problem(self, None if self.backend == "auto" else self.backend))
        if problem:
            raise ValueError(problem)
        # what only the engines know (their combinations of options) is checked here too, so a bad value is
        # found before vLLM starts (20-60 s), not after
        # (--kv-cache-bytes auto is sized from the model's config when the engine starts: any size checks the rest)
        auto_kv = (1 << 30) if self.kv_cache_bytes == "auto" else None
        for side, build in (("rollout", lambda: self.vllm_config(kv_cache_bytes=auto_kv)),
                            ("trainer", self.deepspeed_config)):
            try:
                build()
            except InvalidArgumentError as e:
                raise ValueError(f"{side} options: {e}") from None
        from .reporters import resolve as resolve_reporters

        try:
            resolve_reporters(self.report_to)
        except ConfigError as e:
            raise ValueError(str(e)) from None
        if self.reward_weights is not None and self.rewards and len(self.reward_weights) != len(self.rewards):
            raise ValueError(f"--reward-weights gives {len(self.reward_weights)} weights for "
                             f"{len(self.rewards)} reward functions ({', '.join(self.rewards)}): one each, in order")
        if self.dataset is not None and not self.rewards:
            raise ValueError("a dataset job needs --rewards (built-in names, module:function or file.py:function)")
        if self.dataset is not None and self.grpo.max_new_tokens is None:
            raise ValueError("a dataset job needs --max-new-tokens (the longest completion to sample)")
        if self.dataset is not None and self.eval_every is not None and self.eval_dataset is None:
            raise ValueError("--eval-every with --dataset needs --eval-dataset (held-out prompts: the training "
                             "rows would not show how the model does on prompts it has not trained on)")
        if self.eval_prompts is not None and self.eval_every is None and self.eval_dataset is None:
            raise ValueError("--eval-prompts needs --eval-every or --eval-dataset (evaluation is off)")
        if self.switch == "timesplit" and self.overlap_offload:
            raise ValueError("--overlap-offload overlaps colomem's offload with vLLM's wake; the timesplit baseline "
                             "offloads with DeepSpeed's offload_states")
        if self.trainer_expandable and (self.shared_base or self.effective_engine == "in-rank"):
            raise ValueError("--trainer-expandable needs the cross-process engine: vLLM in the trainer's process "
                             "(--engine in-rank, --shared-base) allocates its sleepable memory with the CUDA "
                             "allocator of that process and refuses expandable segments")
        problem = self._lr_schedule_problem()
        if problem:
            raise ValueError(problem)
        if self.checkpoint_every > 1 and not self.gradient_checkpointing:
            raise ValueError(f"--checkpoint-every {self.checkpoint_every} chooses which layers gradient "
                             "checkpointing recomputes; add --gradient-checkpointing true")
        if self.switch == "timesplit" and self.optimizer_state_memory == "mapped":
            raise ValueError("--optimizer-state-memory mapped is how the colomem switch moves Adam's moments; the "
                             "timesplit baseline moves them with DeepSpeed's offload_states")
        if self.switch == "timesplit" and (self.offload != "auto" or self.rollout_sleep != "auto"):
            raise ValueError("--offload and --rollout-sleep place the colomem switch's memory; the timesplit "
                             "baseline always offloads the trainer with DeepSpeed and puts vLLM to sleep")
        from .placement import candidates

        try:
            candidates(self.offload, self.rollout_sleep)
        except ConfigError as e:
            raise ValueError(str(e)) from None
        measured = self.placement_measured
        for on, flag, what in ((self.grow_micro_batch, "--grow-micro-batch", "sizes the micro-batch"),
                               (self.trim_recompute is True, "--trim-recompute", "chooses the checkpointed layers")):
            if on and not measured:
                raise ValueError(f"{flag} {what} from the memory the placement planner measures in the first "
                                 "step; it needs --switch colomem and --offload auto or --rollout-sleep auto")
        if self.trim_recompute is True and not self.gradient_checkpointing:
            raise ValueError("--trim-recompute checkpoints fewer decoder layers; without --gradient-checkpointing "
                             "none is checkpointed")
        return self

    def _lr_schedule_problem(self) -> str:
        if self.warmup_steps is not None and self.warmup_ratio is not None:
            return "--warmup-steps and --warmup-ratio both set the warmup: give one"
        warm = self.warmup_steps if self.warmup_steps is not None else self.warmup_ratio
        if self.lr_scheduler == "constant" and warm:
            return ("--lr-scheduler constant never changes the learning rate, so it has no warmup: use "
                    "--lr-scheduler constant_with_warmup")
        if self.min_lr_rate is not None and self.lr_scheduler != "cosine_with_min_lr":
            return (f"--min-lr-rate is the floor of --lr-scheduler cosine_with_min_lr; --lr-scheduler "
                    f"{self.lr_scheduler} does not use it")
        if self.warmup_steps is not None and self.warmup_steps > self.steps:
            return f"--warmup-steps {self.warmup_steps} is longer than the run's {self.steps} steps"
        return ""

    def lr_schedule(self, backend: str) -> LrSchedule:
        """The learning-rate schedule of a run on `backend`, in optimizer steps (num_iterations x mini_batches
        a step)."""
        per = self.grpo.num_iterations * self.grpo.mini_batches
        steps = self.steps_for(backend)
        warm = self.warmup_steps if self.warmup_steps is not None else round((self.warmup_ratio or 0.0) * steps)
        rate = self.min_lr_rate if self.min_lr_rate is not None else 0.1
        return LrSchedule(self.lr_scheduler, min(warm, steps) * per, steps * per,
                          rate if self.lr_scheduler == "cosine_with_min_lr" else 0.0)

    # the engines' own configs: built (and so validated) when the run config is, before anything starts
    def deepspeed_config(self, grad_accum: Optional[int] = None) -> "DeepSpeedConfig":
        """The GPU trainer's options (colomem.engines.deepspeed.DeepSpeedConfig) this run asks for."""
        from colomem.engines.deepspeed.config import DeepSpeedConfig

        return DeepSpeedConfig(zero_stage=self.zero_stage, lr=self.lr, micro_batch=self.micro_batch,
                               micro_batch_tokens=self.micro_batch_tokens,
                               grad_accum=grad_accum if grad_accum is not None else self.grad_accum,
                               gradient_checkpointing=self.gradient_checkpointing,
                               checkpoint_every=self.checkpoint_every, torch_compile=self.torch_compile,
                               trust_remote_code=self.trust_remote_code, offload=self.trainer_offload,
                               weight_decay=self.weight_decay, max_grad_norm=self.max_grad_norm, seed=self.seed,
                               timeout_s=self.phase_timeout_s, overlap_reload=self.overlap_reload,
                               optimizer_reload=self.start_optimizer_reload,
                               optimizer_state_memory=self.optimizer_state_memory,
                               grad_reduction=self.grad_reduction, lr_schedule=self.lr_schedule("gpu"))

    def rollout_engine_seed(self, rollout_group: int = 0) -> int:
        """The rollout engine's own seed on a rank of `rollout_group`. Where its generator draws (in-rank
        engines, or --rollout-seeding engine: no per-request seeds), one seed for the shards of an engine and
        another for each engine, so engines with other prompts do not draw the same noise."""
        from .inrank import engine_seed

        if self.effective_engine == "in-rank" or self.rollout_seeding == "engine":
            return engine_seed(self.seed, rollout_group)
        return self.seed

    def vllm_config(self, device: int = 0, rollout_group: int = 0,
                    kv_cache_bytes: Optional[int] = None) -> "VLLMConfig":
        """The rollout engine's options (colomem.engines.vllm.VLLMConfig) this run asks for, on the rank of
        rollout group `rollout_group` (the in-rank engine's seed is its group's: colomem.runner.inrank).
        kv_cache_bytes: what --kv-cache-bytes auto resolved to (kv_need.auto_kv_cache_bytes); a size given
        as such is read here."""
        from colomem.engines.vllm.config import VLLMConfig

        in_rank = self.effective_engine == "in-rank"
        if kv_cache_bytes is None and self.kv_cache_bytes not in (None, "auto"):
            kv_cache_bytes = parse_bytes(self.kv_cache_bytes)
        if kv_cache_bytes is None and self.kv_cache_bytes == "auto":
            raise ConfigError("--kv-cache-bytes auto is resolved from the model's config: pass the size "
                              "(colomem.runner.kv_need.auto_kv_cache_bytes)")
        return VLLMConfig(gpu_memory_utilization=self.gpu_memory_utilization, kv_cache_bytes=kv_cache_bytes,
                          max_model_len=self.max_model_len,
                          tensor_parallel_size=self.tensor_parallel_size,
                          seed=self.rollout_engine_seed(rollout_group), seeded_noise=self.seeded_noise,
                          enforce_eager=self.enforce_eager, lora=self.lora, sleep_level=self.effective_sleep_level,
                          lora_mode="adapter" if self.shared_base_adapter else "merged",
                          weights_backup=self.effective_weights_backup, trust_remote_code=self.trust_remote_code,
                          bucket_bytes=self.start_bucket_bytes, sync_transport="direct" if in_rank else "listener",
                          engine_in_process=in_rank, external_launcher=in_rank, dtype=self.dtype, device=device,
                          kv_tail=self.lends_kv_tail)

    # derived settings -------------------------------------------------------------------------------------
    @property
    def lends_kv_tail(self) -> bool:
        """Whether a partial KV release lends every layer's tail (tail; auto with KV_TAIL_BY_DEFAULT)."""
        return self.kv_release == "tail" or (self.kv_release == "auto" and KV_TAIL_BY_DEFAULT)

    @property
    def start_bucket_bytes(self) -> str:
        """The weight bridge's bucket size at start (auto starts small; the planner may grow it)."""
        return "512MiB" if self.bucket_bytes == "auto" else self.bucket_bytes

    @property
    def start_optimizer_reload(self) -> str:
        """The trainers' optimizer_reload at start (auto starts overlapped; the planner may choose step)."""
        return "step" if self.optimizer_reload == "step" else "overlap"

    @property
    def placement_measured(self) -> bool:
        """Whether the planner measures the first step to place memory (the colomem switch with more than one
        placement to choose from): what --grow-micro-batch and --trim-recompute size themselves by."""
        from .placement import needs_measuring

        return self.switch == "colomem" and needs_measuring(self.offload, self.rollout_sleep)

    @property
    def trims_recompute(self) -> bool:
        """Whether the planner trims the checkpointed layers after the measuring step: --trim-recompute, or its
        auto wherever the placement is measured and checkpointing is on (the same gradients, less work)."""
        if self.trim_recompute == "auto":
            return self.gradient_checkpointing and self.placement_measured
        return bool(self.trim_recompute)

    @property
    def shared_base_adapter(self) -> bool:
        """Whether the rollout engine serves the adapter through its LoRA support (a shared base, not merged)."""
        return self.shared_base and self.shared_base_rollout == "adapter"

    @property
    def effective_engine(self) -> str:
        """'in-rank' or 'cross-process': what --engine auto resolves to (colomem.runner.inrank)."""
        from .inrank import resolve_engine

        return resolve_engine(self.engine, self.tensor_parallel_size, shared_base=self.shared_base,
                              trainer_expandable=self.trainer_expandable, engine_held=self._engine_held,
                              backend=self.backend)

    @property
    def effective_sleep_level(self) -> int:
        if self.sleep_level is not None:
            return self.sleep_level
        if self.shared_base:           # no level is used (only the KV cache sleeps); 1 keeps the weights if one were
            return 1
        return 2 if self.switch == "colomem" else 1   # colomem refills weights through the bridge anyway

    @property
    def effective_weights_backup(self) -> str:
        return self.weights_backup or "vllm"

    @property
    def trainer_offload(self) -> str:
        return "colomem" if self.switch == "colomem" else "deepspeed"

    def explicitly_set(self, name: str) -> bool:
        """True when the field came from the command line (not the YAML file or a default)."""
        return name in self._explicit

    def rows_per_rank(self, world: int) -> int:
        """The completions each of `world` ranks trains on per step (its prompt groups x group_size)."""
        return self.prompts_per_step // world * self.grpo.group_size

    def steps_for(self, backend: str) -> int:
        if backend == "cpu" and not self.explicitly_set("steps"):
            return min(self.steps, self.cpu_steps)
        return self.steps


# ------------------------------------------------------------------------------------------------ loading
_SUBMODELS: dict[str, type[_Strict]] = {"grpo": GRPOConfig, "lora": LoraSpec}


# The flag machinery lives in flags.py, the loading in config_load.py; their names stay importable from here.
from .flags import _flag_table, _parse_flag_value, build_arg_parser  # noqa: E402,F401
from .config_load import config_from_dict, load_run_config, load_yaml, script_config  # noqa: E402,F401
