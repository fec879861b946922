"""What an engine inside the caller's process needs around its construction: the torchrun variables vLLM's
external launcher reads, and the caller's random state kept as it was.

`distributed_executor_backend="external_launcher"` (vLLM's ExecutorWithExternalLauncher) takes the worker's
rank from RANK and its GPU from LOCAL_RANK, and joins torch.distributed's world with `env://` (MASTER_ADDR,
MASTER_PORT) when nothing started it yet. Under torchrun all of them are set. A job of one process started
without torchrun gets the values of a one-rank world here, so the same engine runs with and without it; with
WORLD_SIZE > 1 a missing variable is an error (guessing it would pair ranks wrongly).

vLLM seeds Python's, NumPy's and torch's generators when its worker starts. In its own process that touches
nothing of the caller's; in the caller's process it would reseed the trainer, so a run with the engine inside
would draw other random numbers than the same run with the engine outside. `kept_random_state` puts them back.
"""
from __future__ import annotations

import contextlib
import random
import socket
from typing import Any, Iterator, Mapping, Optional

from colomem.errors import InvalidArgumentError

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launcher_env(environ: Mapping[str, str], port: Optional[int] = None) -> dict[str, str]:
    """The torchrun variables `environ` lacks, with the values of a one-rank world (MASTER_PORT: `port`, or a
    free one); empty when torchrun set them all. InvalidArgumentError when WORLD_SIZE > 1 and one is missing."""
    world = environ.get("WORLD_SIZE", "").strip()
    if world and world != "1":
        missing = [k for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if not environ.get(k)]
        if missing:
            raise InvalidArgumentError(
                f"WORLD_SIZE={world} but {', '.join(missing)} not set: vLLM's external launcher takes each rank "
                "from the torchrun variables; start the job with torchrun")
        return {}
    rank = environ.get("RANK", "0") or "0"
    if rank != "0":
        raise InvalidArgumentError(f"RANK={rank} in a job of one rank (WORLD_SIZE unset or 1); start the job "
                                   "with torchrun, which sets both")
    defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1"}
    out = {k: v for k, v in defaults.items() if not environ.get(k)}
    if not environ.get("MASTER_PORT"):
        out["MASTER_PORT"] = str(port if port is not None else _free_port())
    return out


@contextlib.contextmanager
def kept_random_state(device: Optional[int] = None) -> Iterator[None]:
    """Python's, NumPy's and torch's random state (the CPU generator and `device`'s) as they were on entry."""
    import torch

    py = random.getstate()
    np_random: Any = None
    try:
        import numpy as np
        np_random = np.random
    except ImportError:
        pass
    np_state = np_random.get_state() if np_random is not None else None
    devices = [device] if device is not None and torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py)
        if np_random is not None:
            np_random.set_state(np_state)


__all__ = ["TORCHRUN_VARS", "kept_random_state", "launcher_env"]
