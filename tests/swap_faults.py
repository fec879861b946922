"""A host copy engine that refuses its n-th submission: for the tests of a SwapSet's rollback when an offload
or reload fails part way (staging chunks, slabs)."""
import pytest
import torch

from colomem import _torch
from colomem.errors import InvalidArgumentError


class FailingEngine:
    """The process's host engine, with its n-th submission (counted from 1) refused."""

    def __init__(self, real, fail_at):
        self.real, self.fail_at, self.calls = real, fail_at, 0

    def submit(self, direction, copies, **kw):
        self.calls += 1
        if self.calls == self.fail_at:
            raise InvalidArgumentError("injected: this submission is refused")
        return self.real.submit(direction, copies, **kw)

    def stream(self, direction):
        return self.real.stream(direction)


@pytest.fixture
def failing_engine(monkeypatch):
    """(arm(fail_at), disarm()): from arm on, the host engine refuses its fail_at-th submission."""
    real = _torch.engine_for(torch.device("cpu"))
    box = {}

    def engine_for(device):
        return box.get("engine") or real

    monkeypatch.setattr(_torch, "engine_for", engine_for)
    return lambda fail_at: box.__setitem__("engine", FailingEngine(real, fail_at)), lambda: box.pop("engine")
