"""--trainer-expandable: the trainer's process switches torch's allocator to expandable segments after vLLM's
engine process started (its environment unchanged, so the engine never sees the setting) and before the
trainer allocates; refused where vLLM shares the trainer's process."""
import os

import pytest

from colomem import _torch
from colomem.errors import ConfigError
from colomem.runner import backends
from colomem.runner.config import config_from_dict, load_run_config
from colomem.runner.ranks import Ranks


@pytest.fixture
def settings(monkeypatch):
    """The allocator's setting as a list of what was set (the real one is process-wide and sticky)."""
    seen: list = []
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setattr(_torch, "_set_allocator_settings", seen.append)
    monkeypatch.setattr(_torch, "_allocator_settings", lambda: ",".join(seen))
    return seen


def test_the_switch_is_made_once_and_left_where_the_process_chose(settings, monkeypatch):
    assert _torch.use_expandable_segments() is True and settings == ["expandable_segments:True"]
    assert _torch.use_expandable_segments() is False and len(settings) == 1     # already on
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ                       # children inherit nothing


def test_an_allocator_without_expandable_segments_is_left_as_it_is(monkeypatch):
    def refuse(conf):
        raise RuntimeError("expandable_segments not supported with cudaMallocAsync")
    monkeypatch.setattr(_torch, "_allocator_settings", lambda: "backend:cudaMallocAsync")
    monkeypatch.setattr(_torch, "_set_allocator_settings", refuse)
    assert _torch.use_expandable_segments() is False


def test_it_needs_the_cross_process_engine(tmp_path):
    base = {"backend": "gpu", "out": str(tmp_path / "o"), "trainer_expandable": True}
    assert config_from_dict(base).trainer_expandable
    for bad in ({"engine": "in-rank"}, {"shared_base": True, "lora": {}}):
        with pytest.raises(ConfigError, match="cross-process engine"):
            config_from_dict({**base, **bad})
    assert load_run_config(["--trainer-expandable", "--backend", "cpu"]).trainer_expandable
    assert not load_run_config(["--backend", "cpu"]).trainer_expandable


class _Rollout:
    def __init__(self, path, config=None):
        order.append("rollout")

    def sleep(self, keep_weights=False):
        order.append("sleep")

    def close(self):
        pass


class _Trainer:
    def __init__(self, path, **kw):
        order.append("trainer")

    def close(self):
        pass


order: list = []


@pytest.mark.parametrize("on", [True, False])
def test_the_gpu_build_switches_after_the_engine_started_and_before_the_trainer(settings, monkeypatch, tmp_path,
                                                                                 on):
    # the GPU branch of build_engines with the engines stood in for: where the switch lands in the order
    import colomem.engines.deepspeed as ds
    import colomem.engines.vllm as vl

    order.clear()
    monkeypatch.setattr(vl, "VLLMRollout", _Rollout)
    monkeypatch.setattr(ds, "DeepSpeedTrainer", _Trainer)
    monkeypatch.setattr(_torch, "_set_allocator_settings", lambda conf: (settings.append(conf), order.append(conf)))
    cfg = config_from_dict({"backend": "cpu", "out": str(tmp_path / "o"), "trainer_expandable": on})
    said: list = []
    eng = backends.build_engines(cfg, "gpu", "model", None, Ranks(), grad_accum=1, log_fn=said.append)
    try:
        want = ["rollout", "sleep", "expandable_segments:True", "trainer"] if on else ["rollout", "sleep", "trainer"]
        assert order == want
        assert any("expandable segments" in s for s in said) == on
    finally:
        eng.pool.close()
