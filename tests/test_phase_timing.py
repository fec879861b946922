"""Phase timing on a GPU run: the train phase waits for its queued kernels before its time is taken, so the
optimizer step's tail is not counted in the next phase (the weight sync when nothing moves)."""
import types

from colomem.runner import timeline


def test_settle_waits_for_the_device_of_a_gpu_run_and_nothing_on_the_cpu(monkeypatch):
    waited = []
    fake = types.SimpleNamespace(synchronize=waited.append)
    monkeypatch.setattr(timeline, "_cuda", lambda device: fake if device is not None else None)
    timeline.settle(None)
    timeline.settle(3)
    assert waited == [3]

