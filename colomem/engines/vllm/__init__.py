"""vLLM as the rollout side of a colocated step: `VLLMRollout` (colomem.engines.protocols.Rollout).

The LLM object lives in the trainer's process; vLLM runs the model in its EngineCore process, and
`ColomemWorkerExtension` (worker/) is mixed into vLLM's worker there. New weights cross processes through
colomem's WeightBridge: the first sync goes through the model's `load_weights` (recorded), later ones as the
recorded copies, then as one batched copy per bucket layout. ACKs come after the copies finished. How fast
each way is: docs/performance.md.

One step: sleep() -> [trainer works] -> wake_weights() -> load_weights(...) -> check() -> wake_kv() ->
generate(...). Every call into vLLM runs with a timeout (engine_calls.py): a hung or dead engine raises
TransferTimeoutError / PeerError instead of blocking, and close() kills the engine process if it must.

Weight sync (`sync_transport`, transports.py): "listener" (default; a thread in vLLM's worker serves the
bridge socket, no RPC per sync) or "direct" (engine_in_process=True: the worker reads the trainer's tensors).

Sleep modes (`sleep_level`, `weights_backup`):
  sleep_level=1, weights_backup="vllm"  vLLM's level 1: weights copied to pinned host memory vLLM allocates.
  sleep_level=2, weights_backup="vllm"  vLLM's level 2: weights discarded. generate() refuses until a sync
                                        wrote every parameter (the garbage-after-wake trap, vllm#29341).
  weights_backup="pool"                 the worker copies vLLM's "weights" allocations into a colomem pinned
                                        pool (chunked, pinned once) and vLLM sleeps at level 2; wake_weights()
                                        copies them back (restore=False skips that before a full sync).
  sleep(keep_weights=True)              the KV cache alone is unmapped (worker/kv_release.py, kv_sleep.py); the
                                        weights stay mapped and untouched, for a trainer whose base views them.
                                        The rollout stays WEIGHTS_ONLY; wake_kv() maps the cache back in place.

Logprobs: `logprobs_mode="processed_logprobs"` (default) returns log-softmax(logits / temperature) of each
sampled token (after top-k/top-p), what the GRPO ratio compares against at top_p=1; "raw_logprobs" ignores the
temperature.

LoRA (`lora=LoraSpec`, `lora_mode`, lora_adapter.py):
  "merged"  (default) vLLM serves a plain model; the trainer merges the adapter and syncs full weights. Always
            correct whatever the sleep level, and the bridge makes a full sync cheap.
  "adapter" vLLM's LoRA support (enable_lora): tensors named *lora_A* / *lora_B* are written as a peft adapter
            and registered with a fresh id per version; the base weights must survive sleep, so this mode
            needs sleep_level=1 or weights_backup="pool" (a level-2 sleep without a backup would leave garbage
            under a correct adapter, verl#3516). The adapter is registered again after every wake (vllm#53888).
            With engine_in_process=True, every version after the first is instead copied from the trainer's
            tensors into the slot vLLM already filled, same id, no file (lora_inplace.py); anything it cannot
            place exactly goes through the files. SyncStats.adapter_inplace says which way a version went.

    config.py        VLLMConfig: every option, validated before vLLM starts (no torch, no vLLM imported)
    rollout.py       VLLMRollout: phases, guards, sleep / wake, sync bookkeeping, check, generate, close
    engine_calls.py  the engine-call thread, bounded waits, engine death, killing the engine's processes
    wake_memory.py   a wake by tag within the GPU's free memory, a partial wake rolled back, the OOM message
    kv_sleep.py      sleep(keep_weights=True): the KV cache released and mapped back, vLLM's bookkeeping kept
    weight_sync.py   the base weights' sync through the transport, its SyncStats, the trainer-side checksums
    weight_check.py  what check() compares vLLM's parameters against, and the comparison
    transports.py    the weight sync: listener, direct
    lora_adapter.py  lora_mode="adapter"
    lora_inplace.py  the adapter written into vLLM's LoRA slot in place (called in the worker)
    sampling.py      vLLM's sampling requests and outputs
    checks.py        checksums shared with the worker
    worker/          ColomemWorkerExtension, inside vLLM's worker process

Importing this package imports neither torch nor vLLM until VLLMRollout is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import SYNC_TRANSPORTS, WORKER_EXTENSION, VLLMConfig
from .lora_adapter import hf_base_name, is_lora_name, peft_adapter_name

if TYPE_CHECKING:
    from .rollout import VLLMRollout


def __getattr__(name: str) -> Any:
    if name == "VLLMRollout":
        from .rollout import VLLMRollout

        return VLLMRollout
    raise AttributeError(f"module 'colomem.engines.vllm' has no attribute {name!r}")


__all__ = ["SYNC_TRANSPORTS", "VLLMConfig", "VLLMRollout", "WORKER_EXTENSION", "hf_base_name", "is_lora_name",
           "peft_adapter_name"]
