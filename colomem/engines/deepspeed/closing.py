"""Closing a DeepSpeedTrainer: what is still copying ends, the hooks come off, the offload sets give their pool
blocks back, the engine goes (ZeRO-3's process-wide replacements with it, and with the last trainer the
default process group its set-up started), and the memory goes back to the driver. Every part is attempted
even when one before it failed; failures are warnings."""
from __future__ import annotations

import gc
import warnings
from typing import Any

import torch

from .model import destroy_engine
from .process_group import DEFAULT_GROUP
from .state import FUNCTIONAL_LINEAR, release_cached_memory


def close_trainer(t: Any) -> None:
    """DeepSpeedTrainer.close()'s work, on a trainer already marked closed (it may be half-built: __init__
    failed part way)."""
    t._sync = None
    t._lora_cache = None
    pending = getattr(t, "_pending", None)    # (absent when __init__ failed before it)
    try:
        writes = getattr(t, "_writes", None)   # a checkpoint write still reading the pool copies freed below
        if writes is not None:
            writes.wait(t.timeout_s)
        if pending:
            pending.wait(t.timeout_s)
        if getattr(t, "_strategies", None):
            t.finish_offload()   # a deferred offload's copies end before its set closes
    except Exception as e:  # noqa: BLE001 - closing goes on
        warnings.warn(f"a deferred copy did not finish: {e!r}", RuntimeWarning, stacklevel=3)
    for name in ("_step_reload", "_start_peak"):
        hook = getattr(t, name, None)
        if hook is not None:
            hook.close()
            setattr(t, name, None)
    for s in t._strategies.values():
        try:
            s.close()
        except Exception as e:  # noqa: BLE001 - closing goes on
            warnings.warn(f"closing the {s.method} offload failed: {e!r}", RuntimeWarning, stacklevel=3)
    t._strategies = {}
    t._staging.free()
    engine = getattr(t, "engine", None)
    opt_ref = None
    if engine is not None:
        opt_ref = destroy_engine(engine, getattr(t, "zero_stage", None), t.timeout_s)
    del engine                        # a local reference would keep it alive through the collection below
    t.engine = t.model = t._ref_fn = None
    t.__dict__.pop("_weights", None)   # the weight export holds the model: it would keep the engine alive
    t._fwd_stack = None
    if getattr(t, "_holds_linear", False):
        t._holds_linear = False
        FUNCTIONAL_LINEAR.release()
    if getattr(t, "_holds_group", False):    # after the engine: its optimizer's groups are gone with it
        t._holds_group = False
        DEFAULT_GROUP.release()
    if t._owns_pool and t._pool is not None and not t._pool.closed:
        t._pool.close(force=True)
    t._pool = None
    gc.collect()
    if torch.cuda.is_available():
        release_cached_memory()
    if opt_ref is not None and opt_ref() is not None:
        version = getattr(t, "deepspeed_version", "?")
        warnings.warn(f"the closed trainer's {type(opt_ref()).__name__} is still referenced, so its GPU state "
                      "stays allocated; drop your references to trainer.engine / .optimizer / .model (with "
                      f"DeepSpeed {version}: report it if you hold none)", RuntimeWarning, stacklevel=3)


__all__ = ["close_trainer"]
