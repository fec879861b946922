"""COLOMEM_HEAP_PROFILE_EVERY: the runner names the line of a Python leak (a reward function that keeps
every completion it scores) in heap_profile.jsonl; a bad value is refused before anything is built."""
import json

import pytest

from colomem.errors import ConfigError
from colomem.runner import run_job
from colomem.runner.heap_profile import ENV, every_from_env

from runner_cpu_helpers import cache_env, model_cache, small_cfg  # noqa: F401  (fixtures)

pytest.importorskip("transformers")
KEPT: list = []


def hoarding_reward(prompt, completion, **meta):
    KEPT.append(bytearray(64 << 10))           # the leak: 64 KiB per scored completion, never freed
    return 0.0


def test_the_profile_names_the_leaking_line(cache_env, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "1")
    KEPT.clear()
    out = tmp_path / "run"
    res = run_job(small_cfg(out, steps=4), reward_fns=[hoarding_reward], print_fn=lambda *_: None)
    KEPT.clear()
    assert res.summary["status"] == "ok"
    lines = [json.loads(x) for x in (out / "heap_profile.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 3]
    assert lines[0]["top"] == [] and all(x["since_step"] == 0 for x in lines[1:])
    last = lines[-1]
    top = last["top"][0]                        # 3 steps x 16 completions x 64 KiB since the baseline
    assert top["where"].endswith(f"test_heap_profile.py:{hoarding_reward.__code__.co_firstlineno + 1}"), top
    assert top["size_diff_bytes"] >= 3 * 16 * (64 << 10)
    assert last["traced_bytes"] > lines[0]["traced_bytes"]


def test_no_profile_unless_asked_and_bad_values_refused(cache_env, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert every_from_env({}) == 0 and every_from_env({ENV: " 25 "}) == 25
    res = run_job(small_cfg(tmp_path / "plain", steps=1), print_fn=lambda *_: None)
    assert res.summary["status"] == "ok" and not (tmp_path / "plain" / "heap_profile.jsonl").exists()
    for bad in ("-1", "ten", "1.5"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ConfigError, match=ENV):
            run_job(small_cfg(tmp_path / f"bad{bad}", steps=1), print_fn=lambda *_: None)
        assert not (tmp_path / f"bad{bad}" / "metrics.jsonl").exists()
