"""Old home of the worker extension, kept for one release: `LLM(worker_extension_cls=...)` configurations
that name "colomem.engines.vllm_worker.ColomemWorkerExtension" keep working. New code names
`colomem.engines.vllm.worker.ColomemWorkerExtension` (colomem.engines.vllm.WORKER_EXTENSION)."""

from colomem.engines.vllm.worker import ColomemWorkerExtension

__all__ = ["ColomemWorkerExtension"]
