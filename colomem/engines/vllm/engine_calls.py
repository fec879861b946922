"""Every call into vLLM, with a bound on how long it may take, and the engine's death detected and reported.

vLLM's synchronous client has no timeout of its own (a dead engine can leave a call waiting forever), so
calls run one at a time on a daemon thread and the caller waits with a timeout: a hung or dead engine raises
TransferTimeoutError / PeerError instead of blocking, and `shutdown` kills the engine's processes if they do
not exit in time. A daemon thread stuck in such a call does not keep the interpreter from exiting.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import queue
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator, Optional

from colomem.errors import ColomemError, ConfigError, PeerError, PoolClosedError, TransferTimeoutError, raise_payload

from .launcher import kept_random_state, launcher_env

AGENT_STORE_VAR = "TORCHELASTIC_USE_AGENT_STORE"   # set by torchrun in every rank it starts

log = logging.getLogger(__name__)

POLL_S = 0.25          # how often a wait on the engine looks whether its processes are still alive
DEATH_GRACE_S = 2.0    # how long vLLM may take to raise a dead engine's error itself before we do


class EngineThread:
    """Runs engine calls one at a time on a daemon thread."""

    def __init__(self, init: Optional[Callable[[], None]] = None):
        self._q: "queue.Queue" = queue.Queue()
        self._init = init
        self._t = threading.Thread(target=self._loop, name="colomem-vllm-calls", daemon=True)
        self._t.start()

    def _loop(self) -> None:
        if self._init is not None:
            try:
                self._init()
            except Exception as exc:  # noqa: BLE001 - every call then reports it
                log.warning("engine-call thread set-up failed: %s", exc)
        while True:
            item = self._q.get()
            if item is None:
                return
            self._run(*item)
            # a finished call's arguments (a weight sync's tensors) must not live on until the next call comes
            del item

    @staticmethod
    def _run(fn: Callable[[], Any], fut: concurrent.futures.Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as exc:  # noqa: BLE001  (delivered to the caller)
            fut.set_exception(exc)

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put((fn, fut))
        return fut

    def stop(self) -> None:
        self._q.put(None)


class EngineCalls:
    """The vllm.LLM and the calls into it. Once a wait ran out or the engine died, it is `broken`: every
    later call fails at once (the rollout must be closed and started again)."""

    def __init__(self, rpc_timeout_s: float, init: Optional[Callable[[], None]] = None):
        self.llm: Any = None
        self.rpc_timeout_s = float(rpc_timeout_s)
        self.broken: Optional[str] = None
        self.closed = False
        self.pids: list = []
        self._thread = EngineThread(init)

    def attach(self, llm: Any) -> None:
        """The engine was built: remember it and the processes it started (killed at shutdown if needed).
        An engine in processes of its own is told to end itself if this process dies without closing it (a
        SIGKILL), instead of holding its GPU memory as an orphan (worker/trainer_watch.py)."""
        self.llm = llm
        self.pids = engine_pids(llm)
        if self.pids:
            try:
                self.rpc("colomem_watch_trainer", os.getpid())
            except ColomemError as exc:
                log.warning("vLLM's engine will outlive this process if it is killed (no trainer watch: %s)", exc)

    def engine_dead(self) -> bool:
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        res = getattr(core, "resources", None)
        if getattr(res, "engine_dead", False):
            return True
        # vLLM's own monitor may not have seen it yet: a process of the engine that has an exit code is dead
        for p in getattr(getattr(res, "engine_manager", None), "processes", []) or []:
            try:
                if getattr(p, "exitcode", None) is not None:
                    return True
            except Exception:  # noqa: BLE001  (not ours to poll)
                pass
        return False

    def death_note(self, wait_s: float = 2.0) -> str:
        """How vLLM's engine process ended, for the error a user reads ("killed by SIGKILL ...")."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        mgr = getattr(getattr(core, "resources", None), "engine_manager", None)
        for p in getattr(mgr, "processes", []) or []:
            try:
                p.join(wait_s)                  # a dying engine may still be exiting
                code = p.exitcode
            except Exception:  # noqa: BLE001  (not ours to wait for, or already reaped elsewhere)
                code = None
            if code is not None:
                return describe_exit(code)
        return "its exit status is unknown; its log above may say why"

    def start(self, fn: Callable[[Any], Any], what: str) -> concurrent.futures.Future:
        """Queues fn(llm) without waiting for it (collect it with wait)."""
        if self.closed:
            raise PoolClosedError(f"VLLMRollout is closed; cannot {what}")
        if self.broken:
            raise PeerError(f"the vLLM engine is unusable ({self.broken}); close() it and start a new one")
        if self.engine_dead():
            note = self.death_note()
            self.broken = f"its engine process died, {note}"
            raise PeerError(f"vLLM's engine process died before {what} ({note}); close() this rollout and "
                            "start a new one")
        llm = self.llm
        return self._thread.submit(lambda: fn(llm))

    def _result(self, fut: concurrent.futures.Future, timeout: float, what: str) -> Any:
        """fut's result within `timeout`, watching the engine's processes meanwhile: vLLM's synchronous client
        can wait forever on an engine that died mid-call (its monitor shuts the output thread down without
        waking the waiting call), so a death is reported here once vLLM had DEATH_GRACE_S to raise it."""
        deadline = time.monotonic() + timeout
        died_at: Optional[float] = None
        while True:
            left = deadline - time.monotonic()
            try:
                return fut.result(timeout=max(0.0, min(POLL_S, left)))
            except concurrent.futures.TimeoutError:
                if fut.done():
                    raise
                now = time.monotonic()
                if died_at is None and self.pids and self.engine_dead():
                    died_at = now
                if died_at is not None and now - died_at >= DEATH_GRACE_S:
                    note = self.death_note()
                    self.broken = f"its engine process died, {note}"
                    raise PeerError(f"vLLM's engine process died during {what} ({note}); close() this rollout "
                                    "and start a new one") from None
                if now >= deadline:
                    raise

    def wait(self, fut: concurrent.futures.Future, timeout: float, what: str) -> Any:
        try:
            return self._result(fut, timeout, what)
        except BaseException as exc:
            if isinstance(exc, TimeoutError) and not fut.done():  # our wait ran out, not the call
                self.broken = f"{what} timed out after {timeout:.0f} s"
                raise TransferTimeoutError(
                    f"vLLM did not finish {what} within {timeout:.0f} s; the engine is stuck or dead. close() "
                    f"kills it (raise the timeout if the work is just slow)") from None
            if isinstance(exc, ColomemError):
                raise
            if type(exc).__name__ == "EngineDeadError" or self.engine_dead():
                note = self.death_note()
                self.broken = f"its engine process died, {note}"
                raise PeerError(f"vLLM's engine process died during {what} ({note}): {exc}; close() this "
                                "rollout and start a new one") from exc
            raise

    def call(self, fn: Callable[[Any], Any], timeout: float, what: str) -> Any:
        return self.wait(self.start(fn, what), timeout, what)

    def rpc(self, method: str, *args: Any, timeout: Optional[float] = None) -> list:
        """Calls the worker extension's <method>(*args) on every vLLM worker; one result per worker, an
        error in a worker raised as its colomem class (colomem.errors.raise_payload)."""
        t = self.rpc_timeout_s if timeout is None else float(timeout)
        results = self.call(lambda llm: llm.collective_rpc(method, args=tuple(args)), t, method)
        return [raise_payload(r, method, where="vLLM's worker") for r in results]

    def shutdown(self, timeout: float) -> None:
        """Shuts the engine down within `timeout` seconds, then SIGKILLs what is left of its processes."""
        self.closed = True
        pids = _with_children(self.pids)
        llm, self.llm = self.llm, None
        try:
            core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                t = threading.Thread(target=_quiet(core.shutdown), args=(timeout,), daemon=True,
                                     name="colomem-vllm-shutdown")
                t.start()
                t.join(timeout + 2.0)
        finally:
            _kill(pids)
            self._thread.stop()


def describe_exit(code: int) -> str:
    """A process's exit code as words: "exit code 1 ...", "killed by SIGKILL ..."."""
    if code >= 0:
        return f"exit code {code}; its log above says why"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    why = ""
    if -code == signal.SIGKILL:
        why = " (by another process, or by the kernel's out-of-memory killer: `dmesg` says so)"
    return f"killed by {name}{why}"


@contextlib.contextmanager
def _without_agent_store() -> Iterator[None]:
    """Hides torchrun's TORCHELASTIC_USE_AGENT_STORE from an engine process started meanwhile (it inherits
    this environment). vLLM's engine sets up a process group of its own (world 1, a tcp:// store it hosts);
    with that variable set, torch instead connects to a store it expects torchrun's agent to host at that
    address, which nobody serves there, and the engine waits for it until its timeout."""
    old = os.environ.pop(AGENT_STORE_VAR, None)
    try:
        yield
    finally:
        if old is not None:
            os.environ[AGENT_STORE_VAR] = old


def sleeping_engine_bytes() -> int:
    """Bytes vLLM's sleep-mode allocator holds in this process: 0 when it was never created here (no engine
    with sleep mode was built in this process), or vLLM has no such allocator. Read from the singleton as it
    is: creating it would load its library in a process that never used it (and it refuses torch's
    expandable segments)."""
    cumem = sys.modules.get("vllm.device_allocator.cumem")
    instance = getattr(getattr(cumem, "CuMemAllocator", None), "instance", None)
    if instance is None:
        return 0
    try:
        return int(instance.get_current_usage())
    except (AttributeError, RuntimeError, AssertionError):
        return 0


def refuse_second_sleeping_engine() -> None:
    """vLLM's sleep mode has one allocator per process, and an engine built while it holds memory fails deep
    inside vLLM (an assertion while loading weights). Say so before anything is built."""
    held = sleeping_engine_bytes()
    if held:
        raise ConfigError(
            f"an in-process vLLM engine with sleep mode already holds {held} bytes of vLLM's sleep-mode allocator "
            "in this process, and vLLM allows one such engine per process (its memory stays with the process "
            "after the engine closes). Start this engine in its own process (--engine cross-process, or "
            "engine_in_process=False), or run each in-process engine in a process of its own")


def build_llm(kwargs: dict, in_process: bool, set_device: Callable[[], None]) -> Any:
    """vllm.LLM(**kwargs); with in_process, EngineCore and its worker run in this process (with the external
    launcher: as this torchrun rank's shard of a tensor-parallel engine), the caller's random state kept."""
    from vllm import LLM

    # The runner touches CUDA (pool, trainer) before vLLM starts its engine process; a forked engine
    # then cannot initialise CUDA, so spawn unless the user chose otherwise.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if not in_process:
        with _without_agent_store():
            return LLM(**kwargs)
    from vllm import envs as vllm_envs

    if kwargs.get("enable_sleep_mode"):
        refuse_second_sleeping_engine()
    # vLLM reads this when it builds the engine: 0 keeps EngineCore and its worker in this process. An
    # in-process EngineCore also freezes vLLM's environment reads (enable_envs_cache): undone after, so
    # a later engine of this process is not built in-process too.
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    was_cached = getattr(vllm_envs, "_is_envs_cache_enabled", lambda: False)()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if kwargs.get("distributed_executor_backend") == "external_launcher":
        os.environ.update(launcher_env(os.environ))      # a one-process job started without torchrun
    try:
        set_device()
        import torch

        with kept_random_state(torch.cuda.current_device() if torch.cuda.is_available() else None):
            return LLM(**kwargs)
    finally:
        if old is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old
        if not was_cached and hasattr(vllm_envs, "disable_envs_cache"):
            vllm_envs.disable_envs_cache()


def engine_pids(llm: Any) -> list:
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    mgr = getattr(getattr(core, "resources", None), "engine_manager", None)
    return [p.pid for p in getattr(mgr, "processes", []) or [] if getattr(p, "pid", None)]


def _quiet(fn: Callable) -> Callable:
    def run(*a):
        try:
            fn(*a)
        except Exception as exc:  # noqa: BLE001  (shutdown of a dying engine may raise; we kill it next)
            log.debug("vLLM shutdown: %s", exc)
    return run


def _with_children(pids: list) -> list:
    try:
        import psutil
    except ImportError:
        return list(pids)
    out = []
    for pid in pids:
        try:
            out += [c.pid for c in psutil.Process(pid).children(recursive=True)]
        except Exception:  # noqa: BLE001  (already gone)
            pass
        out.append(pid)
    return out


def _kill(pids: list) -> None:
    """SIGKILL what is still alive among the engine processes this adapter started."""
    for pid in pids:
        try:
            os.kill(pid, 0)
        except OSError:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            log.warning("killed vLLM process %d that did not exit in time", pid)
        except OSError:
            pass


__all__ = ["refuse_second_sleeping_engine", "EngineCalls", "EngineThread", "build_llm", "describe_exit", "engine_pids"]
