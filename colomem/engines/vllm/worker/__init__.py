"""The colomem side of vLLM's worker process: weight sync through the bridge, checks, the pool backup.

vLLM runs the model in its own process (the EngineCore, or one worker per rank with tensor parallelism), so
weights must cross processes. `ColomemWorkerExtension` is mixed into vLLM's `Worker` by naming it in
`LLM(worker_extension_cls="colomem.engines.vllm.worker.ColomemWorkerExtension")`; the parent calls its
methods with `llm.collective_rpc("colomem_<method>", args=...)`. Arguments and returns are plain dicts,
lists, ints and strings, because collective_rpc serialises them with msgpack.

A colomem error raised here would reach the parent as a bare `Exception(message)`, so every RPC method
returns `colomem.errors.error_payload(exc)` instead and the parent re-raises the same class
(`colomem.errors.raise_payload`). The methods are thin; the work is in the modules beside this one:

    receive.py        attach, apply a bucket, a version over the socket, the in-process (direct) load
    listener.py       the thread serving the bridge socket (sync_transport="listener")
    load_plan.py      load_weights recorded once, replayed as plain copies
    pool_backup.py    weights_backup="pool"
    kv_release.py     the KV cache released alone, the weights left mapped (sleep(keep_weights=True))
    kv_tail.py        part of it lent as each layer's tail, its blocks back as the scheduler needs them
    wake_rollback.py  undoing a wake that ran out of memory
    trainer_watch.py  ending the engine's process when the trainer that started it is gone
    ../lora_inplace.py  the trainer's LoRA adapter written into the slot vLLM activated for it
    ../checks.py      checksums and parameter sampling (shared with the trainer process)

Importing this package does not import vLLM; only the functions that need vLLM's internals do.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Optional

import torch

from colomem._torch import mem_get_info
from colomem.errors import InvalidArgumentError, error_payload

from ..checks import CHECKSUM_SAMPLE_WORDS, checksum_parts, finish_checksums, param_info, spread_sample
from .. import lora_inplace
from . import kv_release, kv_tail, pool_backup, receive
from .listener import Listener
from .state import SyncState, WorkerState, torch_device
from .trainer_watch import TrainerWatch
from .wake_rollback import rollback_wake

DEFAULT_COPY_TIMEOUT_S = 300.0
VERIFY_MODES = ("none", "sampled", "full")


def rpc_method(fn: Callable) -> Callable:
    """Runs an RPC method and returns any exception as its error payload (the parent re-raises the class)."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001  (the parent re-raises it; nothing is swallowed)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return error_payload(exc)

    return wrapper


class ColomemWorkerExtension:
    """Mixed into vLLM's Worker (`worker_extension_cls`). Every public name starts with `colomem_`, so
    nothing collides with the Worker's own attributes (vLLM asserts that)."""

    # -- hooks (a fake worker in the tests overrides the ones that reach into vLLM) ------------------------
    def _colomem(self) -> WorkerState:
        st = self.__dict__.get("_colomem_state")
        if st is None:
            st = WorkerState()
            self.__dict__["_colomem_state"] = st
        return st

    def _colomem_model(self) -> torch.nn.Module:
        return getattr(self, "model_runner").model

    def _colomem_device(self) -> torch.device:
        return torch_device(self)

    def _colomem_param_names(self) -> set:
        return {n for n, _ in self._colomem_model().named_parameters()}

    def _colomem_device_uuid(self) -> str:
        from colomem import _C

        return _C.device_uuid(self._colomem_device().index)

    def _colomem_connect(self, address: str, timeout: float) -> Any:
        from colomem.bridge import BridgeImporter

        return BridgeImporter.connect(address, timeout=timeout)

    def _colomem_weight_allocations(self) -> list:
        """[(device address, nbytes)] of every allocation vLLM tagged "weights" (params, buffers, LoRA slots).

        These are the exact ranges vLLM's own level-1 sleep backs up; copying them whole restores everything
        a level-2 sleep discards, including tensors that are not parameters.
        """
        from vllm.device_allocator.cumem import CuMemAllocator

        alloc = CuMemAllocator.get_instance()
        return [(int(ptr), int(data.handle[1])) for ptr, data in sorted(alloc.pointer_to_data.items())
                if data.tag == "weights"]

    def _colomem_cumem(self) -> Any:
        """vLLM's CuMemAllocator and its create_and_map / unmap_and_release (kv_release.cumem_api)."""
        return kv_release.cumem_api(self)

    def _colomem_is_mapped(self, ptr: int) -> bool:
        from colomem import _C

        return bool(_C.pointer_is_mapped(int(ptr)))

    def _colomem_apply(self, msg: dict) -> dict:
        return receive.apply_bucket(self, msg)

    def _colomem_lora_manager(self) -> Any:
        """vLLM's LoRAModelManager (its LoRA layers, slots and adapters); None when vLLM runs without LoRA."""
        workers = getattr(getattr(self, "model_runner", None), "lora_manager", None)
        return getattr(workers, "_adapter_manager", None)

    # -- bridge -----------------------------------------------------------------------------------------
    @rpc_method
    def colomem_attach(self, address: Any, timeout: float = 30.0, verify: str = "sampled",
                       snapshot_k: int = 8, fast_load: bool = True) -> dict:
        """Connects to the trainer's WeightBridge at `address` (a Unix socket path, or {GPU UUID: path} with
        one bridge per GPU of a tensor-parallel engine) and maps its buffers.

        snapshot_k: the ACK of a version's last bucket carries checksums of this many parameters, the
        state later checks compare against. fast_load: record what the model's load_weights copies at the
        first sync and replay those copies afterwards (load_plan.py); False always calls load_weights.
        """
        if verify not in VERIFY_MODES:
            raise InvalidArgumentError(f"verify must be 'none', 'sampled' or 'full', got {verify!r}")
        st = self._colomem()
        receive.detach(st)
        if not isinstance(address, str):
            address = receive.pick_address(address, self._colomem_device_uuid(), getattr(self, "rank", "?"))
        st.importer = self._colomem_connect(address, float(timeout))
        st.address, st.verify, st.snapshot_k, st.fast_load = address, verify, int(snapshot_k), bool(fast_load)
        st.sync = SyncState()
        return {"pid": os.getpid(), "rank": int(getattr(self, "rank", 0)), "device": str(self._colomem_device())}

    @rpc_method
    def colomem_detach(self) -> dict:
        st = self._colomem()
        receive.detach(st)
        st.address = None
        return {"detached": True}

    @rpc_method
    def colomem_listen(self, bucket_timeout: float = 60.0) -> dict:
        """Serves the attached bridge from a thread of this process: every version the trainer sends over the
        socket is applied as it comes, with no RPC per sync. Stopped by colomem_detach / colomem_close (or a
        new colomem_attach); idempotent."""
        st = receive.attached(self)
        if st.listener is None or not st.listener.alive:
            st.listener = Listener(self, st, float(bucket_timeout))
            st.listener.start()
        return {"listening": True, "pid": os.getpid()}

    @rpc_method
    def colomem_listener_state(self) -> dict:
        """{"listening", "versions", "error"} of this worker's bridge listener (the adapter asks after a
        listener sync failed, to say why)."""
        listener = self._colomem().listener
        if listener is None:
            return {"listening": False, "versions": 0, "error": None}
        return listener.state()

    @rpc_method
    def colomem_load_direct(self, named: list, version: int, first: bool = True, last: bool = True) -> dict:
        """sync_transport='direct' (vLLM's engine in the trainer's process): the trainer's (name, tensor)
        pairs straight into the model, a version in one call or in chunks from `first` to `last`. The last
        returns the same report as a bridge sync's last bucket, the others {"partial": True, "version"}."""
        return receive.load_direct(self, named, version, bool(first), bool(last))

    @rpc_method
    def colomem_watch_trainer(self, pid: int, interval_s: float = 1.0, grace_s: float = 10.0) -> dict:
        """From now on this process ends itself once the trainer process `pid` is gone (trainer_watch.py):
        a trainer killed outright must not leave the engine holding its GPU memory. Nothing to watch when
        the engine runs in the trainer's own process; idempotent."""
        st = self._colomem()
        if int(pid) == os.getpid():
            return {"watching": False, "pid": os.getpid()}
        if st.trainer_watch is None or not st.trainer_watch.watching:
            st.trainer_watch = TrainerWatch(int(pid), float(interval_s), float(grace_s)).start()
        return {"watching": True, "pid": os.getpid(), "trainer_pid": int(pid)}

    # -- LoRA adapter in place -------------------------------------------------------------------------------
    @rpc_method
    def colomem_lora_write(self, lora_id: int, adapter: list, scaling: float,
                           timeout: float = DEFAULT_COPY_TIMEOUT_S, ready: Any = None) -> dict:
        """The trainer's adapter, (peft name, tensor) pairs (the engine runs in the trainer's process, so the
        tensors themselves), written over the slot adapter `lora_id` is active in, B scaled by `scaling`
        (alpha / r), after the CUDA event `ready`. AdapterLayoutError, nothing written, for anything that does
        not map exactly (lora_inplace.py): the caller registers the adapter through files instead."""
        cache = self.__dict__.setdefault("_colomem_lora_layout", {})   # the slot's views, kept per adapter
        return lora_inplace.write_adapter(self._colomem_lora_manager(), int(lora_id), list(adapter),
                                          float(scaling), float(timeout), ready, cache)

    @rpc_method
    def colomem_lora_slot(self, lora_id: int) -> dict:
        """{"slot": the LoRA slot adapter `lora_id` is active in, -1 when none}."""
        slot = lora_inplace.active_slot(self._colomem_lora_manager(), int(lora_id))
        return {"slot": -1 if slot is None else slot}

    # -- checks -----------------------------------------------------------------------------------------
    @rpc_method
    def colomem_param_info(self) -> dict:
        """{name: [shape, dtype]} of the model's parameters (vLLM's names: fused qkv_proj, gate_up_proj)."""
        return param_info(self._colomem_model())

    @rpc_method
    def colomem_param_checksums(self, names: Optional[list] = None, sample: int = 8,
                                sample_words: int = CHECKSUM_SAMPLE_WORDS) -> dict:
        """tensor_checksum of the named parameters (or of `sample` spread over all of them)."""
        params = dict(self._colomem_model().named_parameters())
        if names is None:
            names = spread_sample(params, int(sample))
        unknown = [n for n in names if n not in params]
        if unknown:
            raise InvalidArgumentError(f"no parameter named {unknown[:4]} in the vLLM model")
        return {"checksums": finish_checksums({n: checksum_parts(params[n], sample_words) for n in names})}

    # -- pool backup (weights_backup="pool") ---------------------------------------------------------------
    @rpc_method
    def colomem_save_weights_to_pool(self, timeout: float = DEFAULT_COPY_TIMEOUT_S) -> dict:
        """Copies the bytes of every "weights" allocation into the worker's pinned pool (D2H, chunked)."""
        return pool_backup.save(self, float(timeout))

    @rpc_method
    def colomem_restore_weights_from_pool(self, timeout: float = DEFAULT_COPY_TIMEOUT_S) -> dict:
        """Copies the saved bytes back to the same addresses (vLLM re-maps them where they were)."""
        return pool_backup.restore(self, float(timeout))

    @rpc_method
    def colomem_drop_pool_copy(self) -> dict:
        """Forgets the saved copy (a full sync replaced the weights); keeps the blocks for the next save."""
        self._colomem().backup.saved = False
        return {"dropped": True}

    # -- OOM at wake ----------------------------------------------------------------------------------------
    @rpc_method
    def colomem_rollback_wake(self, tags: list, keep_weights: bool,
                              timeout: float = DEFAULT_COPY_TIMEOUT_S) -> dict:
        """Unmaps what a failed `wake_up(tags)` already mapped, so vLLM is fully asleep again (see
        wake_rollback.py); keep_weights backs up weights whose host copy was already dropped."""
        return rollback_wake(self._colomem_device(), list(tags), bool(keep_weights), float(timeout))

    # -- the KV cache alone (sleep(keep_weights=True)) --------------------------------------------------------
    @rpc_method
    def colomem_kv_release(self, nbytes: Optional[int] = None) -> dict:
        """Unmaps vLLM's "kv_cache" allocations (the fewest holding at least nbytes; None: all) and frees their
        memory; the weights stay mapped, untouched."""
        return kv_release.release(self, nbytes)

    @rpc_method
    def colomem_kv_map(self) -> dict:
        """Maps new memory at the released KV-cache addresses (bytes undefined: reset the prefix cache)."""
        return kv_release.map_back(self)

    @rpc_method
    def colomem_kv_lend(self) -> dict:
        """Takes the released KV entries out of vLLM's table for the length of vLLM's own sleep."""
        return kv_release.lend(self)

    @rpc_method
    def colomem_kv_take_back(self, slept: bool) -> dict:
        """Returns them after vLLM's sleep (slept: it ran, so vLLM's wake maps them from now on)."""
        return kv_release.take_back(self, bool(slept))

    @rpc_method
    def colomem_kv_state(self) -> dict:
        """vLLM's "weights" and "kv_cache" allocations ([address, bytes, mapped]) and what is released."""
        return kv_release.state(self)

    @rpc_method
    def colomem_kv_tail_lend(self, nbytes: Optional[int] = None) -> dict:
        """Lends at least nbytes of the KV cache (None: all but each layer's first chunk) as every layer's
        tail: its blocks out of the scheduler's queue, its memory back with the driver; the scheduler maps
        it back chunk by chunk when its free blocks run short. NotAvailableError (nothing changed) for a
        layout or a scheduler that cannot: the caller releases whole layers instead."""
        return kv_tail.lend(self, nbytes)

    @rpc_method
    def colomem_kv_tail_restore(self, mapped: bool) -> dict:
        """vLLM's KV allocations back in its table: mapped whole again (mapped=True, before the engine
        closes), or unmapped and lent out of its table as after a release (for vLLM's own sleep, between
        colomem_kv_tail_restore(False) and colomem_kv_take_back)."""
        return kv_tail.restore(self, bool(mapped))

    @rpc_method
    def colomem_kv_tail_state(self) -> dict:
        """The lent tail's figures: its chunks, blocks held, bytes mapped, chunks grown back."""
        return kv_tail.state(self)

    @rpc_method
    def colomem_param_pointers(self) -> dict:
        """{name: data_ptr} of the model's parameters (a trainer that views them needs them to stay put)."""
        return {n: int(p.data_ptr()) for n, p in self._colomem_model().named_parameters()}

    @rpc_method
    def colomem_seeded_noise(self, batched: bool) -> dict:
        """batched: vLLM's sampler draws every seeded request's noise of a step in one launch (seeded_noise.py);
        False: its own per-request draws again. Returns whether the batched draw is in place."""
        from . import seeded_noise

        if batched:
            seeded_noise.install()
        else:
            seeded_noise.uninstall()
        return {"installed": seeded_noise.installed()}

    # -- memory ---------------------------------------------------------------------------------------------
    @rpc_method
    def colomem_memory(self) -> dict:
        """What this worker holds: vLLM's cumem allocations by tag, torch's allocator, the pinned pool."""
        out: dict = {"pid": os.getpid()}
        device = self._colomem_device()
        if device.type == "cuda":
            free, total = mem_get_info(device)
            out.update(free_bytes=int(free), total_bytes=int(total),
                       torch_allocated_bytes=int(torch.cuda.memory_allocated(device)),
                       torch_reserved_bytes=int(torch.cuda.memory_reserved(device)))
        try:
            from vllm.device_allocator.cumem import CuMemAllocator

            by_tag: dict = {}
            for data in CuMemAllocator.get_instance().pointer_to_data.values():
                by_tag[data.tag] = by_tag.get(data.tag, 0) + int(data.handle[1])
            out["cumem_bytes_by_tag"] = by_tag
        except Exception:  # noqa: BLE001  (no cumem allocator: sleep mode off, or not vLLM)
            out["cumem_bytes_by_tag"] = {}
        kv = self._colomem().kv
        out["kv_released"], out["kv_released_bytes"] = bool(kv.released), int(kv.nbytes)
        bk = self._colomem().backup
        out["pool"] = pool_backup.pool_stats(bk)
        out["pool_saved"] = bool(bk.saved)
        return out

    @rpc_method
    def colomem_close(self) -> dict:
        """Detaches from the bridge and frees the pool (the engine is about to shut down)."""
        st = self._colomem()
        receive.detach(st)
        pool_backup.close(st)
        return {"closed": True}


__all__ = ["ColomemWorkerExtension", "rpc_method"]
