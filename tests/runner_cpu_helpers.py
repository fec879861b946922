"""The tiny model, the small run config and the engine spy the runner's CPU tests share
(test_runner_cpu.py, test_runner_cpu_failures.py, test_runner_cli_cpu.py, test_heap_profile.py)."""
import contextlib
from pathlib import Path

import pytest

from colomem.runner.backends import build_engines
from colomem.runner.config import RunConfig, config_from_dict

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def awake_cpu_rollout(cfg: RunConfig, task_name: str = "successor"):
    """(engines, tokenizer, task) of `cfg` on the CPU, the rollout awake with the trainer's weights (version 0);
    the engines are closed after."""
    from colomem.grpo.tasks import make_task
    from colomem.grpo.tiny_model import model_dir
    from colomem.runner import Ranks
    from colomem.runner.backends import close_engines
    from colomem.runner.job import _tokenizer

    task = make_task(task_name)
    path = str(model_dir("tiny", task.alphabet, log=lambda *_: None))
    tok = _tokenizer(path, False)
    eng = build_engines(cfg, "cpu", path, tok, Ranks(), grad_accum=1)
    try:
        r = eng.rollout
        r.wake_weights()                                 # built asleep, as the loop expects it
        r.load_weights(eng.trainer.named_weights(), 0)
        r.wake_kv()
        yield eng, tok, task
    finally:
        close_engines(eng)


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    """One tiny model for the whole session (built once, found again through COLOMEM_CACHE)."""
    from colomem.grpo.tasks import make_task
    from colomem.grpo.tiny_model import model_dir

    root = tmp_path_factory.mktemp("colomem-cache")
    model_dir("tiny", make_task("successor").alphabet, cache_dir=root / "models", log=lambda *_: None)
    return root


@pytest.fixture
def cache_env(model_cache, monkeypatch):
    monkeypatch.setenv("COLOMEM_CACHE", str(model_cache))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    return model_cache


def small_cfg(out, **kw) -> RunConfig:
    data = {"backend": "cpu", "steps": 2, "prompts_per_step": 4, "micro_batch": 8, "progress": False,
            "out": str(out), "grpo": {"group_size": 4}}
    for k, v in kw.items():
        if k == "grpo":
            data["grpo"].update(v)
        else:
            data[k] = v
    return config_from_dict(data)


class Spy:
    """Records method calls of the wrapped engine; raises a planned fault at the k-th call of a method."""

    def __init__(self, inner, faults=None, log=None):
        self.inner, self.faults = inner, dict(faults or {})
        self.calls = log if log is not None else []

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def wrapped(*a, **k):
            self.calls.append(name)
            fault = self.faults.get((name, sum(1 for c in self.calls if c == name)))
            if fault is not None:
                raise fault
            return attr(*a, **k)
        return wrapped


def spy_factory(holder, rollout_faults=None, trainer_faults=None):
    def factory(cfg, backend, model_path, tok, ranks, grad_accum):
        eng = build_engines(cfg, backend, model_path, tok, ranks, grad_accum=grad_accum)
        log = holder.setdefault("calls", [])
        eng.rollout = Spy(eng.rollout, rollout_faults, log)
        eng.trainer = Spy(eng.trainer, trainer_faults, log)
        holder["engines"] = eng
        holder["pool"] = eng.pool
        holder["trainer"] = eng.trainer.inner
        holder["rollout"] = eng.rollout.inner
        return eng
    return factory
