"""The two sides of a phase switch, as the runner sees them: `Rollout` and `Trainer`.

The runner calls only what these protocols declare (no `getattr` probing), and a type checker run in CI
checks every engine against them: vLLM + DeepSpeed on a GPU (`engines.vllm`, `engines.deepspeed`) and the
CPU stand-ins (`engines.stand_ins`). A new engine implements one of them and nothing else.

The rollout's phases are named here once; the runner's step phases live in `colomem.runner.phases`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Collection, Iterable, Iterator, Optional, Protocol, runtime_checkable

if TYPE_CHECKING:      # the protocols import nothing heavy at run time
    from pathlib import Path

    from torch import Tensor

    from colomem.engines.pending_write import PendingWrite
    from colomem.grpo.batch import Completion, GRPOBatch

    from .reports import SwitchReport, SyncStats

# What a rollout engine holds on the GPU (Rollout.phase).
AWAKE = "awake"            # weights and KV cache: it can generate
WEIGHTS_ONLY = "weights"   # weights woken, KV cache still asleep: the sync and the check run here
ASLEEP = "asleep"          # neither: the trainer has the GPU
CLOSED = "closed"
ROLLOUT_PHASES = (AWAKE, WEIGHTS_ONLY, ASLEEP, CLOSED)


@runtime_checkable
class Rollout(Protocol):
    """Generates completions; sleeps while the trainer trains and takes the trainer's weights on waking.

    Order within a step: sleep -> wake_weights -> load_weights -> check -> wake_kv -> generate -> sleep.
    """

    @property
    def weight_version(self) -> int:
        """Version of the weights the engine holds (the trainer's optimizer steps when they were sent)."""
        ...

    @property
    def phase(self) -> str:
        """One of ROLLOUT_PHASES."""
        ...

    @property
    def timings(self) -> dict[str, float]:
        """Seconds of the engine's last sleep / wake calls (reported as rollout/* metrics)."""
        ...

    def expect_version(self, version: int) -> None:
        """The trainer moved to `version`: generating with older weights raises StaleWeightsError."""
        ...

    def generate(self, prompt_ids: list[list[int]], *, n: int, max_new_tokens: int, temperature: float,
                 top_p: float, seed: Optional[int], top_k: Optional[int] = None,
                 min_p: float = 0.0, repetition_penalty: float = 1.0) -> list[list["Completion"]]:
        """n completions per prompt; temperature 0 is greedy decoding (top_p, top_k, min_p and seed then do
        nothing). seed None: the engine's own generator draws (the samples then depend on how it batched the
        prompts). top_k None and min_p 0: no such filter; repetition_penalty 1: none."""
        ...

    def sleep(self, keep_weights: bool = False, kv_bytes: Optional[int] = None) -> None:
        """Frees the GPU: KV cache dropped, weights dropped or kept in host memory. keep_weights: only the KV
        cache goes, the weights stay mapped where they are (the next awake window starts at the sync);
        kv_bytes (with keep_weights): only that much of the KV cache goes, in whole allocations."""
        ...

    def wake_weights(self) -> None:
        ...

    def wake_need(self, tags: Iterable[str]) -> Optional[int]:
        """GPU bytes a wake of `tags` ("weights", "kv_cache") maps, with the margin it asks for; None when
        unknown (the caller then assumes it does not fit beside anything else)."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, "Tensor"]], version: int) -> "SyncStats":
        ...

    def check(self) -> None:
        """Cheap check of the weights after the sync; raises WeightCheckError."""
        ...

    def wake_kv(self) -> None:
        ...

    def memory(self) -> dict:
        """What the engine holds (bytes by kind); for the memory table."""
        ...

    def close(self) -> None:
        ...


@runtime_checkable
class Trainer(Protocol):
    """Trains on a batch; leaves the GPU (offload) while the rollout runs and comes back (reload)."""

    @property
    def last_offload(self) -> Optional["SwitchReport"]:
        """The last offload's report (None before the first, or for a trainer that does not move)."""
        ...

    @property
    def last_reload(self) -> Optional["SwitchReport"]:
        ...

    @property
    def offloaded(self) -> bool:
        """Whether the trainer's state is in host memory now (offload() called, reload() not yet)."""
        ...

    def train_step(self, batch: "GRPOBatch") -> dict[str, float]:
        """The optimizer steps of one batch (one, or grpo.num_iterations x grpo.mini_batches);
        `reload_wait_s` in the result is time spent waiting for state still reloading, `optimizer_reload_s`
        the time the optimizer state took to come back inside the optimizer step (optimizer_reload "step");
        both are switch costs the runner takes out of the train phase."""
        ...

    def offload(self, *, keep: Collection[str] = (), defer: bool = False, hold: bool = False) -> None:
        """The trainer's GPU state into host memory, but for the state categories in keep ("params", "grads",
        "master", "optim", "other": the placement planner's choice; a trainer without a category ignores
        it); the memory goes back to the driver. Kept "params" are read on the device by named_weights().
        defer: the optimizer state (read only by the next optimizer step) is still copying when this returns,
        and its memory is freed by finish_offload(); the weights are readable for the sync at once.
        hold (with defer): that copy starts only at start_offload() (or finish_offload()), so that it does
        not run beside what comes first (the rollout's wake and the weight sync)."""
        ...

    def start_offload(self) -> None:
        """Starts the copy an offload(defer=True, hold=True) held back; nothing to do otherwise."""
        ...

    @property
    def offload_pending(self) -> bool:
        """Whether a deferred part of the last offload is still copying (finish_offload() ends it)."""
        ...

    def finish_offload(self, timeout: Optional[float] = None, *, background: bool = False) -> float:
        """Waits for the deferred part of the last offload and gives its memory back to the driver; returns the
        seconds waited (0.0 when nothing was deferred). background: in a thread while the caller goes on
        (0.0 returned; only while nothing else of this process runs on the GPU); every later call that needs
        the trainer's state waits for it first."""
        ...

    def reload(self) -> None:
        ...

    def named_weights(self, merged: Optional[bool] = None) -> Iterator[tuple[str, "Tensor"]]:
        """(HF name, tensor) of the policy's weights for the sync, LoRA merged; host views while offloaded. A
        trainer on a shared base sends its adapter alone unless merged=True."""
        ...

    def memory(self) -> dict:
        """What the trainer holds (bytes by kind, `pinned_pool` when it owns its pool)."""
        ...

    def close(self) -> None:
        ...


@runtime_checkable
class Checkpointable(Protocol):
    """A trainer whose state can be saved and loaded (checkpoints and resume)."""

    def save_state(self, path: "Path", *, merged: bool = False) -> None:
        """Everything training needs to continue exactly (weights, optimizer, steps, RNG), and the model in
        Hugging Face format under path / "model" (with LoRA the adapter, and with merged the merged model
        under path / "model-merged"). Resident or offloaded (then read from the offloaded copies); every
        rank calls it and writes its own part."""
        ...

    def prepare_save(self, path: "Path", *, merged: bool = False, state: bool = True) -> "PendingWrite":
        """What save_state writes, gathered now (collectives, copies of what is resident, RNG, counters);
        its write() is file I/O only, fit for a background thread while training goes on. Copies it reads
        in the pool stay until the trainer's next offload or close, which wait for the write. state=False:
        the model folders alone (the trained model at the end of a run), no trainer state."""
        ...

    def load_state(self, path: "Path") -> None:
        """What save_state wrote, into this resident trainer built from the same model."""
        ...


def check_kv_bytes(keep_weights: bool, kv_bytes: Optional[int]) -> None:
    """InvalidArgumentError unless a sleep's kv_bytes is None, or a positive int with keep_weights (a sleep
    that drops the weights drops the whole KV cache with them)."""
    from colomem.errors import InvalidArgumentError
    if kv_bytes is None:
        return
    if isinstance(kv_bytes, bool) or not isinstance(kv_bytes, int) or kv_bytes <= 0:
        raise InvalidArgumentError(f"kv_bytes={kv_bytes!r}: a positive number of bytes, or None for the whole "
                                   "KV cache")
    if not keep_weights:
        raise InvalidArgumentError("kv_bytes releases part of the KV cache beside weights that stay mapped: it "
                                   "needs keep_weights=True (a sleep that drops the weights drops the whole cache)")


def check_sampling(temperature: float, top_p: float, top_k: Optional[int] = None, min_p: float = 0.0,
                   repetition_penalty: float = 1.0) -> None:
    """InvalidArgumentError unless the sampling knobs a Rollout's generate takes are in range."""
    from colomem.errors import InvalidArgumentError

    if temperature < 0 or not 0 < top_p <= 1:
        raise InvalidArgumentError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    if (top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1)) \
            or not 0 <= min_p < 1:
        raise InvalidArgumentError(f"need top_k None or an int >= 1 and 0 <= min_p < 1, got {top_k!r}, {min_p}")
    if not repetition_penalty > 0:
        raise InvalidArgumentError(f"need repetition_penalty > 0 (1 = off), got {repetition_penalty}")


def check_hold(defer: bool, hold: bool) -> None:
    """Trainer.offload's hold: only for a deferred offload (InvalidArgumentError otherwise)."""
    if hold and not defer:
        from colomem.errors import InvalidArgumentError

        raise InvalidArgumentError("offload(hold=True) holds back a deferred copy; pass defer=True too")


__all__ = ["Checkpointable", "check_hold", "check_kv_bytes", "check_sampling", "ASLEEP", "AWAKE", "CLOSED", "ROLLOUT_PHASES", "Rollout", "Trainer", "WEIGHTS_ONLY"]
