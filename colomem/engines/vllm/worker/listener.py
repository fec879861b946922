"""The bridge listener: a thread in vLLM's worker that applies each version as it arrives (the default
sync_transport, "listener"), so the trainer's sync needs no collective_rpc."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Optional

import torch

from colomem.errors import PeerAbortedError, PeerClosedError, PeerError, TransferTimeoutError

from .receive import serve_version
from .state import WorkerState

if TYPE_CHECKING:
    from . import ColomemWorkerExtension

log = logging.getLogger(__name__)


def peer_ended(exc: BaseException) -> Optional[str]:
    """"closed" when the producer closed the bridge, "abort" when it abandoned one version, else None."""
    if isinstance(exc, PeerClosedError):
        return "closed"
    if isinstance(exc, PeerAbortedError):
        return "abort"
    return None


class Listener:
    """Waits on the bridge socket and applies each version as it arrives. It polls a stop flag between
    versions; it ends when the trainer closes the bridge or dies (the error is kept in `error`)."""

    POLL_S = 0.2

    def __init__(self, worker: "ColomemWorkerExtension", st: WorkerState, bucket_timeout: float):
        self._worker, self._st, self._timeout = worker, st, bucket_timeout
        self._stop = threading.Event()
        self.error: Optional[str] = None
        self.versions = 0
        self._thread = threading.Thread(target=self._run, name="colomem-bridge-listener", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the bridge listener did not stop within %.0f s (a version in flight?)", timeout)

    def state(self) -> dict:
        return {"listening": self.alive, "versions": self.versions, "error": self.error}

    def _fail(self, exc: BaseException) -> None:
        """Stops serving for good: keeps why, and closes the bridge connection so the trainer's next sync
        fails at once (PeerError) instead of waiting out its timeout for ACKs nobody will send."""
        self.error = f"{type(exc).__name__}: {exc}"
        log.error("bridge listener stopped: %s", self.error)
        try:
            self._st.importer.close()
        except Exception as close_exc:  # noqa: BLE001 - already failing; the error above is the one kept
            log.warning("bridge listener: closing the importer failed: %s", close_exc)

    def _run(self) -> None:
        device = self._worker._colomem_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)  # this thread's copies go to the worker's GPU
        imp = self._st.importer
        while not self._stop.is_set():
            try:
                first = imp.receive(self.POLL_S)
            except TransferTimeoutError:
                continue
            except PeerError as exc:
                ended = peer_ended(exc)
                if ended == "abort":
                    continue  # a version abandoned before its first bucket came
                if ended != "closed":
                    self._fail(exc)
                return
            except Exception as exc:  # noqa: BLE001 - e.g. the importer closed under us: stop, remember why
                self._fail(exc)
                return
            try:
                serve_version(self._worker, imp, first, self._timeout)
                self.versions += 1
            except Exception as exc:  # noqa: BLE001 - the trainer got the refusal; keep serving
                log.warning("bridge listener: version %s failed: %s", first.get("version"), exc)
                if peer_ended(exc) == "closed":
                    return


__all__ = ["Listener", "peer_ended"]
