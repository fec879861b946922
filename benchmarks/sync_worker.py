"""The benchmark's worker extension: ColomemWorkerExtension plus the RPCs only bench_sync.py needs.

vLLM's worker imports it by its dotted path, so bench_sync.py puts this folder on PYTHONPATH for vLLM's
processes and passes VLLMRollout(worker_extension=WORKER_EXTENSION).
"""

from __future__ import annotations

import os
import time

import torch

from colomem.engines.vllm.worker import ColomemWorkerExtension, rpc_method
from colomem.engines.vllm.worker.state import synchronize

WORKER_EXTENSION = "sync_worker.BenchWorkerExtension"


class BenchWorkerExtension(ColomemWorkerExtension):
    @rpc_method
    def colomem_ping(self) -> dict:
        """Does nothing: what one collective_rpc round trip costs."""
        return {"pid": os.getpid()}

    @rpc_method
    def colomem_apply_torch_ipc(self, entries: list) -> dict:
        """The per-tensor CUDA IPC baseline: loads tensors the trainer shared one by one with torch's
        `reduce_tensor`. entries: [{"name", "args": the rebuild_cuda_tensor arguments, classes and dtype as
        strings}]."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        device = self._colomem_device()
        t0 = time.perf_counter()

        def tensors():
            for e in entries:
                a = list(e["args"])
                yield e["name"], rebuild_cuda_tensor(
                    torch.Tensor, tuple(a[0]), tuple(a[1]), int(a[2]), torch.storage.TypedStorage,
                    getattr(torch, a[3]), device.index, a[4], int(a[5]), int(a[6]), bool(a[7]), a[8],
                    int(a[9]), a[10], bool(a[11]))

        loaded = getattr(self._colomem_model(), "load_weights")(tensors())
        synchronize(device)
        return {"ntensors": len(entries), "loaded": len(loaded or ()), "apply_ms": (time.perf_counter() - t0) * 1e3}
