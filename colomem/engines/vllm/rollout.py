"""VLLMRollout: vLLM as the rollout side of a colocated step (colomem.engines.protocols.Rollout).

The phases and the guards (version, phase order, weights discarded by a sleep) live here, with sleep / wake
and the sync's bookkeeping around them; the wake within free memory (wake_memory.py), the base weights'
sync (weight_sync.py), what check() compares (weight_check.py), the engine calls, the transports and the
LoRA adapter live in the modules beside this one (see the package docstring).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from colomem._torch import driver_memory, hold_cublas_workspaces, let_go_cublas_workspaces
from colomem.engines.protocols import ASLEEP, AWAKE, CLOSED, WEIGHTS_ONLY, check_kv_bytes, check_sampling
from colomem.engines.reports import SyncStats
from colomem.errors import (ColomemError, InvalidArgumentError, PhaseOrderError, PoolClosedError,
                            StaleWeightsError, WeightCheckError)

from .config import VLLMConfig, check_adapter_mode, check_choice, check_sync_transport
from .engine_calls import EngineCalls, build_llm
from .kv_sleep import KvSleep
from .prefix_cache import PrefixCache
from .lora_adapter import LoraAdapter, split_adapter
from .sampling import completions, requests
from .wake_memory import WAKE_MARGIN, TagWake
from .weight_check import WeightCheck
from .weight_sync import BaseWeightSync, SentWeights

log = logging.getLogger(__name__)


class VLLMRollout:
    """vLLM with sleep mode, weight sync through the bridge, a version guard and a post-wake check.

    VLLMRollout(model_path, **options) or VLLMRollout(model_path, config=VLLMConfig(...)); the options and
    their defaults are VLLMConfig's fields.
    """

    def __init__(self, model_path: str, config: Optional[VLLMConfig] = None, **options: Any):
        if not isinstance(model_path, (str, os.PathLike)) or not str(model_path):
            raise InvalidArgumentError(f"model_path must be a path or a model name, got {model_path!r}")
        if config is None:
            config = VLLMConfig(**options)
        elif options:
            raise InvalidArgumentError(f"pass config=VLLMConfig(...) or keyword options, not both (got "
                                       f"{sorted(options)} beside config)")
        c = self.config = config
        self.model_path = str(model_path)
        self.lora = c.lora
        self.lora_mode = c.effective_lora_mode
        self.device = int(c.device)
        self.bucket_bytes = int(c.bucket_bytes)
        self.bucket_buffers = int(c.bucket_buffers)
        self.tensor_parallel_size = int(c.tensor_parallel_size)
        self.verify = c.verify
        self.check_sample = int(c.check_sample)
        self.engine_in_process = bool(c.engine_in_process)
        self._sync_transport = c.sync_transport
        self.fast_load = bool(c.fast_load)
        self.generate_timeout_s = float(c.generate_timeout_s)
        self.wake_timeout_s = float(c.wake_timeout_s)
        self.shutdown_timeout_s = float(c.shutdown_timeout_s)
        self._sleep_level, self._weights_backup = c.sleep_level, c.weights_backup
        self._slept_with = (c.sleep_level, c.weights_backup)
        self.llm_kwargs = c.llm_arguments(self.model_path)

        # state the guards read
        self.weight_version = 0              # version of the weights in vLLM (0: as loaded at start)
        self._expected_version = 0           # newest version the trainer announced
        self._phase = AWAKE
        self._weights_valid = True           # False after a level-2 sleep without backup, until a full sync
        self.last_sync: Optional[SyncStats] = None
        self.timings: dict[str, float] = {}

        # An in-process engine runs its CUDA work on the engine-call thread: that thread must use its GPU.
        self._calls = EngineCalls(c.rpc_timeout_s, self._set_device if self.engine_in_process else None)
        self._adapter = (LoraAdapter(self.lora, self._calls, c.rpc_timeout_s, self.engine_in_process)
                         if self.lora_mode == "adapter" else None)
        self._weight_check = WeightCheck(self._calls)
        # _make_bridge looked up when a bridge is made: subclasses and the CPU tests replace it
        self._base_sync = BaseWeightSync(self._calls, self, lambda: self._make_bridge())
        self._tag_wake = TagWake(self._calls, self)
        self._prefix = PrefixCache(self._calls)
        t0 = time.perf_counter()
        self._kv = KvSleep(self._calls, self.llm_kwargs, self, WAKE_MARGIN, self._prefix)
        self._calls.attach(self._build_llm(self.llm_kwargs))
        if self.engine_in_process:      # its CUDA graphs, captured in this process, replay over them
            hold_cublas_workspaces(self)
        self.timings["start_s"] = time.perf_counter() - t0
        self._tag_wake.read_layout()
        self.seeded_noise = "vllm"
        if c.seeded_noise != "vllm":
            self.set_seeded_noise(c.seeded_noise)

    # ------------------------------------------------------------------------------------ construction
    def _set_device(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_device(self.device)

    def _build_llm(self, kwargs: dict) -> Any:
        """Creates vllm.LLM (overridden by the CPU tests with a fake engine)."""
        return build_llm(kwargs, self.engine_in_process, self._set_device)

    def _make_bridge(self) -> Any:
        from colomem.bridge import WeightBridge

        # The producer must checksum at least as thoroughly as the worker verifies.
        checksum = {"full": "full", "none": "none"}.get(self.verify, "sampled")
        return WeightBridge(bucket_bytes=self.bucket_bytes, buffers=self.bucket_buffers, device=self.device,
                            checksum=checksum)

    def set_seeded_noise(self, mode: str) -> str:
        """How vLLM's sampler draws the noise of requests with a seed: 'vllm' (its own, a launch per request
        and decode step) or 'batched' (every seeded request of a step in one launch, worker/seeded_noise.py;
        the same tokens whatever a request is batched with, but not the tokens of vLLM's own draws). Returns
        the mode in place: 'vllm' when this vLLM's sampler lacks what the batched draw replaces."""
        mode = str(check_choice("seeded_noise", mode))
        states = self.rpc("colomem_seeded_noise", mode == "batched")
        on = all(bool(x.get("installed")) for x in states)
        if mode == "batched" and not on:
            log.warning("vLLM's sampler could not take the batched seeded draw; its own per-request draws stay")
        self.seeded_noise = "batched" if on else "vllm"
        return self.seeded_noise

    @property
    def sleep_level(self) -> int:
        return self._sleep_level

    @sleep_level.setter
    def sleep_level(self, level: int) -> None:
        level = int(check_choice("sleep_level", level))
        check_adapter_mode(self.lora_mode, level, self._weights_backup)
        self._sleep_level = level

    @property
    def weights_backup(self) -> str:
        return self._weights_backup

    @weights_backup.setter
    def weights_backup(self, backup: str) -> None:
        backup = str(check_choice("weights_backup", backup))
        check_adapter_mode(self.lora_mode, self._sleep_level, backup)
        self._weights_backup = backup

    @property
    def sync_transport(self) -> str:
        return self._sync_transport

    @sync_transport.setter
    def sync_transport(self, transport: str) -> None:
        self._sync_transport = check_sync_transport(transport, self.engine_in_process)

    @property
    def rpc_timeout_s(self) -> float:
        return self._calls.rpc_timeout_s

    @rpc_timeout_s.setter
    def rpc_timeout_s(self, seconds: float) -> None:
        if not float(seconds) > 0:
            raise InvalidArgumentError(f"rpc_timeout_s must be positive, got {seconds}")
        self._calls.rpc_timeout_s = float(seconds)

    # ------------------------------------------------------------------------------ engine call plumbing
    @property
    def llm(self) -> Any:
        """The vllm.LLM (for what the adapter does not wrap; keep phases in order yourself)."""
        return self._calls.llm

    @property
    def phase(self) -> str:
        return self._phase

    def rpc(self, method: str, *args: Any, timeout: Optional[float] = None) -> list:
        """Calls the worker extension's <method>(*args) on every vLLM worker; returns one result per worker.

        An error in the worker comes back as its colomem class (WeightCheckError, CudaOutOfMemoryError...).
        """
        return self._calls.rpc(method, *args, timeout=timeout)

    # ---------------------------------------------------------------------------------------- the guard
    def expect_version(self, version: int) -> None:
        """The trainer announces its newest weights; generate() refuses older ones from now on."""
        if int(version) < self._expected_version:
            raise InvalidArgumentError(f"announced version {version} is older than {self._expected_version}")
        self._expected_version = int(version)

    @property
    def expected_version(self) -> int:
        return self._expected_version

    def _require(self, phases: Sequence[str], what: str, hint: str) -> None:
        if self._phase == CLOSED:
            raise PoolClosedError(f"VLLMRollout is closed; cannot {what}")
        if self._phase not in phases:
            raise PhaseOrderError(f"{what} while vLLM is {self._phase!r}: {hint}")

    # ------------------------------------------------------------------------------------------- generate
    def generate(self, prompt_ids: list, *, n: int = 1, max_new_tokens: int = 64, temperature: float = 1.0,
                 top_p: float = 1.0, seed: Optional[int] = 0, stop_token_ids: Optional[list] = None,
                 ignore_eos: bool = False, logprobs: bool = True, top_k: Optional[int] = None,
                 min_p: float = 0.0, repetition_penalty: float = 1.0) -> list:
        """Samples n completions per prompt. Returns list[list[Completion]] with vLLM's sampled-token logprobs.

        Prompt i uses seed + i * n, its completion j seed + i * n + j (None: unseeded). Refuses
        (StaleWeightsError) when the weights are older than the version the trainer announced, or were
        discarded by a sleep and not synced since.
        """
        self._require((AWAKE,), "generate", "call wake_weights(), load_weights(...) and wake_kv() first")
        if not self._weights_valid:
            raise StaleWeightsError(
                "vLLM's weights were discarded by a level-2 sleep and no sync wrote every parameter since: call "
                "load_weights(all named weights, version) before generating")
        if self.weight_version < self._expected_version:
            raise StaleWeightsError(
                f"vLLM holds weights version {self.weight_version} but the trainer announced version "
                f"{self._expected_version}: sync with load_weights(..., version={self._expected_version}) first")
        if not isinstance(prompt_ids, (list, tuple)) or not all(
                isinstance(p, (list, tuple)) and len(p) > 0 and all(isinstance(t, int) for t in p)
                for p in prompt_ids):
            raise InvalidArgumentError("prompt_ids must be a list of non-empty lists of token ids (ints)")
        if int(n) < 1 or int(max_new_tokens) < 1:
            raise InvalidArgumentError(f"n and max_new_tokens must be >= 1, got n={n}, "
                                       f"max_new_tokens={max_new_tokens}")
        check_sampling(temperature, top_p, top_k, min_p, repetition_penalty)
        if not prompt_ids:
            return []
        kw: dict = {"use_tqdm": False}
        if self._adapter is not None and self._adapter.request is not None:
            kw["lora_request"] = self._adapter.serving()
        self._settle_prefix_cache()   # a reset retire_prefix_cache() started: this generate fills the cache again
        params, prompts = requests(prompt_ids, n=n, max_new_tokens=max_new_tokens, temperature=temperature,
                                   top_p=top_p, seed=seed, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                                   logprobs=logprobs, top_k=top_k, min_p=min_p,
                                   repetition_penalty=repetition_penalty)
        outs = self._calls.call(lambda llm: llm.generate(prompts, params, **kw), self.generate_timeout_s,
                                "generate")
        return completions(outs, logprobs)

    # ---------------------------------------------------------------------------------------- sleep / wake
    def sleep(self, keep_weights: bool = False, kv_bytes: Optional[int] = None) -> None:
        """Frees the GPU: KV cache dropped; weights kept in host memory (level 1 / pool) or dropped (level 2).

        keep_weights=True releases the KV cache only (kv_sleep.py): the weights stay mapped where they are,
        untouched (for a trainer whose base parameters view them), and the rollout is left WEIGHTS_ONLY, so
        the next window syncs, checks and calls wake_kv() without wake_weights(). kv_bytes (with
        keep_weights): release only that much of the KV cache, in whole allocations (vLLM has one per
        attention layer), when training needs no more of its memory: the wake then maps back only those.
        """
        if not isinstance(keep_weights, bool):
            raise InvalidArgumentError(f"keep_weights must be True or False, got {keep_weights!r}")
        check_kv_bytes(keep_weights, kv_bytes)
        self._require((AWAKE, WEIGHTS_ONLY), "sleep", "vLLM is already asleep")
        if keep_weights:
            self._kv.check_available()
        self._settle_prefix_cache()
        t0 = time.perf_counter()
        keep = self._weights_valid and (keep_weights or self._weights_backup == "pool" or self._sleep_level == 1)
        if keep and not self._weight_check.recorded:
            self._weight_check.snapshot("before sleep", self.check_sample)  # what check() must find after the wake
        if keep_weights:  # from WEIGHTS_ONLY the cache is out already (released here or by vLLM's sleep)
            self.timings.update(self._kv.release(already_out=self._phase == WEIGHTS_ONLY, nbytes=kv_bytes))
            self._phase = WEIGHTS_ONLY
            self.timings["sleep_s"] = time.perf_counter() - t0
            return
        if self._weights_backup == "pool":
            r = self.rpc("colomem_save_weights_to_pool", self.wake_timeout_s, timeout=self.wake_timeout_s)
            self.timings["pool_save_s"] = max(x["seconds"] for x in r)
            self.timings["pool_bytes"] = max(x["nbytes"] for x in r)
            level = 2
        else:
            level = self._sleep_level
        with self._kv.lent_to_vllm_sleep():    # a released KV cache must not be unmapped twice
            self._calls.call(lambda llm: llm.sleep(level=level), self.wake_timeout_s, f"sleep(level={level})")
        self._phase = ASLEEP
        self._slept_with = (level, self._weights_backup)
        if level == 2 and self._weights_backup != "pool":
            self._weights_valid = False
            self._weight_check.forget()
        self.timings["sleep_s"] = time.perf_counter() - t0

    def wake_weights(self, restore: Optional[bool] = None) -> None:
        """Maps the weights again (KV cache stays asleep, so old weights, new weights and KV never coexist).

        With weights_backup="pool" the saved bytes are copied back unless restore=False (a full sync follows).
        """
        self._require((ASLEEP,), "wake_weights", "call sleep() first")
        t0 = time.perf_counter()
        self._tag_wake.wake(("weights",), self._slept_with)
        self._phase = WEIGHTS_ONLY
        if self._slept_with[1] == "pool":
            if restore is None or restore:
                r = self.rpc("colomem_restore_weights_from_pool", self.wake_timeout_s, timeout=self.wake_timeout_s)
                self.timings["pool_restore_s"] = max(x["seconds"] for x in r)
            else:
                self._weights_valid = False
                self._weight_check.forget()
        if self._adapter is not None:
            self._adapter.register_again(self.weight_version)
        self.timings["wake_weights_s"] = time.perf_counter() - t0

    def wake_kv(self) -> None:
        """Maps the KV cache again; vLLM can generate after this."""
        self._require((WEIGHTS_ONLY,), "wake_kv", "call wake_weights() (and sync) first")
        t0 = time.perf_counter()
        if self._kv.released:
            self.timings.update(self._kv.map_back())
        else:
            self._tag_wake.wake(("kv_cache",), self._slept_with)
        self._phase = AWAKE
        self.timings["wake_kv_s"] = time.perf_counter() - t0

    def wake(self) -> None:
        """wake_weights() then wake_kv(), for when no sync happens in between."""
        self.wake_weights()
        self.wake_kv()

    @property
    def kv_tail(self) -> bool:
        """Whether a partial KV release lends each layer's tail (kv_sleep.py; False: whole layers)."""
        return self._kv.tail_possible

    @kv_tail.setter
    def kv_tail(self, on: bool) -> None:
        self._kv.set_tail(on)

    @property
    def kv_tail_lent(self) -> bool:
        """Whether the KV cache's released part is a lent tail now (kv_sleep.py): wake_kv() then maps nothing
        and the rollout needs none of that memory at its start, only as its blocks run short."""
        return self._kv.tail

    def set_kv_room(self, fn: Optional[Callable[[], Any]]) -> bool:
        """fn runs once on the engine's thread the first time a lent tail finds no memory (KvSleep.set_room);
        returns whether it is in place."""
        return self._kv.set_room(fn, self.engine_in_process)

    @property
    def kv_cache_bytes(self) -> Optional[int]:
        """The KV cache vLLM allocated on this GPU (its allocations tagged kv_cache); None when unknown."""
        n = self._tag_wake.tag_bytes.get("kv_cache")
        return int(n) if n else None

    @property
    def weights_bytes(self) -> Optional[int]:
        """vLLM's weights on this GPU (its allocations tagged weights): what a sleep frees beyond the KV cache
        and sleep(keep_weights=True) leaves mapped; None when unknown."""
        n = self._tag_wake.tag_bytes.get("weights")
        return int(n) if n else None

    @property
    def reserved_in_caller(self) -> int:
        """Bytes of the caller's torch allocator that this engine's memory holds: with the engine in the
        caller's process (in-rank), vLLM's sleepable allocations are segments of a private pool of that
        allocator, counted in its reserved bytes awake or asleep (vLLM's sleep hands the memory to the driver
        without telling torch). 0 for an engine in a process of its own."""
        if not self.engine_in_process:
            return 0
        return int(sum(int(n) for n in self._tag_wake.tag_bytes.values()))

    def wake_need(self, tags: Iterable[str]) -> Optional[int]:
        """GPU bytes waking `tags` maps (vLLM's allocations by tag, read when the engine started) plus the
        margin the wake asks for; None when the layout could not be read."""
        return self._tag_wake.need(tags)

    # -------------------------------------------------------------------------------------------- weights
    def load_weights(self, named_tensors: Iterable, version: int) -> SyncStats:
        """Sends the trainer's (name, tensor) pairs (HF names, GPU tensors) to vLLM as weights `version`.

        In lora_mode="adapter", names with lora_A/lora_B go to vLLM's LoRA manager; the rest are base weights.
        """
        self._require((WEIGHTS_ONLY, AWAKE), "load_weights", "call wake_weights() first (KV may stay asleep)")
        version = int(version)
        if version < self.weight_version:
            raise InvalidArgumentError(f"version {version} is older than the weights vLLM holds "
                                       f"({self.weight_version}); versions never go backwards")
        adapter: list = []
        items: Iterable = named_tensors
        if self._adapter is not None:
            items, adapter = split_adapter(named_tensors)
        sent = SentWeights(SyncStats(version=version), {}, [])   # stays so when only an adapter comes
        t0 = time.perf_counter()
        if self._adapter is None or items:
            sent = self._base_sync.send(items, version, self._weight_check.direct_names())
        stats = sent.stats
        if adapter and self._adapter is not None:
            ta = time.perf_counter()
            stats.adapter_inplace = self._adapter.load(adapter, version)
            stats.adapter_tensors = len(adapter)
            stats.adapter_seconds = time.perf_counter() - ta
        if stats.ntensors == 0 and not adapter:
            raise InvalidArgumentError("load_weights got no tensors")
        if stats.ntensors and not self._weights_valid and not stats.complete:
            what = (f"{stats.nmissing} parameters missing, e.g. {list(stats.missing[:4])}"
                    if stats.complete is False else "vLLM's load_weights did not say which it wrote")
            raise WeightCheckError(
                f"vLLM's weights were discarded by a level-2 sleep but version {version} may not have written "
                f"all of them ({what}); send every parameter after such a sleep, or sleep with sleep_level=1 / "
                f"weights_backup='pool'")
        if stats.ntensors:
            self._weights_valid = True
            # what check() must find: the trainer's bytes for unfused names, the worker's right after the sync
            self._weight_check.record_sync(sent.sampled, sent.snapshots, version)
        if (stats.ntensors or stats.adapter_inplace) and self._phase == AWAKE:  # an in-place adapter keeps its id
            tr = time.perf_counter()
            stats.prefix_reset_early = self._prefix.drop(
                self.wake_timeout_s, "after a weight sync", "generating now would reuse KV blocks of the old weights")
            stats.prefix_reset_seconds = time.perf_counter() - tr
        self.weight_version = version
        self._expected_version = max(self._expected_version, version)
        stats.seconds = time.perf_counter() - t0
        self.last_sync = stats
        return stats

    def retire_prefix_cache(self) -> None:
        """Says that new weights come next while vLLM stays awake: the prefix cache, which a sync into an awake
        engine must drop (its KV blocks were computed with the old weights), starts dropping now, in the
        background, so the next load_weights does not wait for it. A generate before that sync still works;
        the sync then drops the cache it filled. Without a sleep in between, vLLM's reset walks every KV
        block: tens of milliseconds on a large cache."""
        self._require((AWAKE,), "retire_prefix_cache", "only an awake engine holds a prefix cache to drop")
        self._prefix.retire()

    def _settle_prefix_cache(self) -> None:
        self._prefix.settle(self.wake_timeout_s)

    @property
    def _bridge(self) -> Any:
        """The listener transport's WeightBridge (None before the first listener sync)."""
        return self._base_sync.bridge

    def set_bucket_bytes(self, bucket_bytes: Any, buffers: Optional[int] = None) -> None:
        """Re-creates the bridge with another bucket size (the worker re-attaches on the next sync)."""
        c = VLLMConfig(bucket_bytes=bucket_bytes, bucket_buffers=self.bucket_buffers if buffers is None else buffers)
        self.bucket_bytes, self.bucket_buffers = int(c.bucket_bytes), c.bucket_buffers
        self._base_sync.close_bridge()

    def check(self, reference: Optional[Iterable] = None) -> None:
        """Cheap post-wake / post-sync check: checksums of sampled parameters against what they must be.

        Without `reference`: the trainer's tensors recorded at the last sync (direct names) plus a sample
        taken right after it (or before the last sleep). With `reference` (HF (name, tensor) pairs): those
        tensors, for the names vLLM holds unfused. Raises WeightCheckError on any difference.
        """
        self._require((WEIGHTS_ONLY, AWAKE), "check", "call wake_weights() first")
        if not self._weights_valid:
            raise WeightCheckError("vLLM's weights were discarded by a level-2 sleep and not synced since; "
                                   "call load_weights(...) with every parameter")
        self._weight_check.check(reference)

    # -------------------------------------------------------------------------------------------- report
    def memory(self) -> dict:
        """Free/total GPU memory as the driver reports it and what vLLM's workers hold."""
        out: dict = {"phase": self._phase, "weight_version": self.weight_version}
        info = driver_memory(self.device)
        if info is not None:
            f, t = info
            out.update(free_bytes=int(f), total_bytes=int(t), used_bytes=int(t - f))
        out.update(self._kv.report())
        if self._phase != CLOSED and not self._calls.broken:
            out["workers"] = self.rpc("colomem_memory")
        return out

    # --------------------------------------------------------------------------------------------- close
    def close(self, timeout: Optional[float] = None) -> None:
        """Shuts vLLM down within `timeout` seconds (default shutdown_timeout_s), killing it if it must."""
        if self._phase == CLOSED:
            return
        timeout = self.shutdown_timeout_s if timeout is None else float(timeout)
        try:
            # The worker's bridge mapping and pool backup go now; an in-process worker outlives the engine.
            if (self._bridge is not None or self.engine_in_process or self._weights_backup == "pool") \
                    and not self._calls.broken:
                if self.engine_in_process:
                    self._kv.map_before_close()
                try:
                    self.rpc("colomem_close", timeout=min(10.0, timeout))
                except ColomemError as exc:
                    log.warning("colomem_close in vLLM's worker failed: %s", exc)
            self._base_sync.forget()  # colomem_close detached the worker already
            self._prefix.forget()
        finally:
            self._phase = CLOSED
            self._calls.shutdown(timeout)
            let_go_cublas_workspaces(self)
            if self._adapter is not None:
                self._adapter.remove_files()
            gc.collect()

    def __enter__(self) -> "VLLMRollout":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["VLLMRollout"]
