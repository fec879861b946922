"""The planner's partial KV release: a rollout put to sleep so that training has room releases only the part
of its KV cache training needs (its weights and the rest staying mapped), from the measured figures; the CPU
loop with GPU-like figures asks the rollout for exactly that, says so, and --kv-release all keeps the whole
sleep."""
import json
from dataclasses import replace

import pytest

from colomem.runner import run_job
from colomem.runner.placement import Placement, choose, kv_release_fit
from fakes.placement import GB, figs, job


def big_kv(**kw):
    """figs(rollout=100, peak=90): the trainer keeps all but Adam's moments, vLLM sleeps; its 80 GB KV cache
    and 3 GB of weights named. Training then has 140 - 90 - 2 (margin) = 48 GB beside nothing of vLLM's."""
    f = figs(rollout=100, peak=90)
    return replace(f, kv_cache=80 * GB, rollout_weights=3 * GB, **kw)


def sleeping(f) -> Placement:
    p = choose("auto", "auto", [f], margin=2 * GB)
    assert p.rollout_sleeps and p.keep == ("params", "other", "grads", "master")
    return p


def test_the_release_is_what_training_lacks_beside_the_weights_and_the_rest_of_the_cache():
    f = big_kv()
    p = sleeping(f)
    assert kv_release_fit(p, [f], 2 * GB) == 35 * GB                       # 3 + 80 - 48
    assert kv_release_fit(p, [f], 2 * GB, taken=5 * GB) == 40 * GB         # held through training: 5 more
    # a shared base's weights stay through every sleep: the measured training had them beside it already
    assert kv_release_fit(p, [f], 2 * GB, weights_stay=True) == 32 * GB
    # every GPU must fit: the one that needs the most decides
    assert kv_release_fit(p, [f, replace(f, train_peak=100 * GB)], 2 * GB) == 45 * GB


def test_the_whole_sleep_when_a_figure_is_unknown_or_training_needs_more_than_the_cache():
    f = big_kv()
    p = sleeping(f)
    assert kv_release_fit(p, [replace(f, kv_cache=0)], 2 * GB) == 0
    assert kv_release_fit(p, [replace(f, rollout_weights=0)], 2 * GB) == 0
    assert kv_release_fit(p, [replace(f, rollout_weights=0)], 2 * GB, weights_stay=True) == 32 * GB
    assert kv_release_fit(p, [replace(f, train_peak=135 * GB)], 2 * GB) == 80 * GB    # all of the cache does
    assert kv_release_fit(p, [replace(f, train_peak=136 * GB)], 2 * GB) == 0          # the weights must go too
    assert kv_release_fit(Placement(p.keep, False), [f], 2 * GB) == 0                 # vLLM never sleeps
    assert kv_release_fit(p, [], 2 * GB) == 0


def test_a_cache_training_needs_none_of_still_releases_one_allocation():
    f = replace(big_kv(), kv_cache=10 * GB)
    assert kv_release_fit(sleeping(f), [f], 2 * GB) == 1


def test_the_label_and_the_event_say_how_much_goes():
    p = replace(sleeping(big_kv()), kv_release=35 * GB)
    assert p.label == "trainer keeps params+other+grads+master, rollout releases 32.60 GiB of its KV cache"
    assert p.to_dict()["kv_release"] == 35 * GB


@pytest.fixture
def gpu_like(monkeypatch):
    """The CPU loop planning from big_kv()'s figures, its stand-in rollout reporting the same cache."""
    from colomem.engines.hf_rollout import HFRollout
    from colomem.runner import train_memory_plan

    monkeypatch.setattr(train_memory_plan, "figures_from_step", lambda *a, **k: figs(rollout=100, peak=90))
    monkeypatch.setattr(train_memory_plan, "kv_figures", lambda *a, **k: (80 * GB, 0))
    monkeypatch.setattr(HFRollout, "weights_bytes", 3 * GB, raising=False)


def events(out):
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x.get("event") == "placement"], [x for x in lines if "reward_mean" in x]


def test_the_runner_asks_the_rollout_for_that_part_and_says_so(job_env, tmp_path, gpu_like):
    said = []
    res = run_job(job(tmp_path / "p", placement_margin="2GB"), print_fn=said.append)
    assert res.summary["status"] == "ok", res.summary.get("error")
    (plan,), steps = events(tmp_path / "p")
    assert plan["kv_release"] == 35 * GB and plan["rollout_sleeps"]
    assert any("releases 32.60 GiB of its 74.51 GiB KV cache" in x for x in said), said
    # the first step measured with the whole sleep; every later one released only that part
    assert [s.get("rollout/kv_release_asked_bytes") for s in steps] == [0, 35 * GB, 35 * GB]
    # the weights wake after the measuring step's whole sleep only; no step reports an earlier step's wake
    assert ["rollout/wake_weights_s" in s for s in steps] == [True, True, False]


def test_kv_release_tail_and_layers_ask_for_the_same_part(job_env, tmp_path, gpu_like):
    """--kv-release tail and layers: the same part as auto; tail builds vLLM with the scheduler that lends a
    tail (the plan says so), layers and auto (for now) without it."""
    from colomem.runner.config import KV_TAIL_BY_DEFAULT, RunConfig

    for mode, lends in (("tail", True), ("layers", False), ("auto", KV_TAIL_BY_DEFAULT)):
        out = tmp_path / mode
        res = run_job(job(out, placement_margin="2GB", kv_release=mode), print_fn=lambda *_: None)
        assert res.summary["status"] == "ok", res.summary.get("error")
        (plan,), steps = events(out)
        assert plan["kv_release"] == 35 * GB and ("lent as the tail" in plan["why"]) == lends
        assert [s.get("rollout/kv_release_asked_bytes") for s in steps] == [0, 35 * GB, 35 * GB]
        assert RunConfig(kv_release=mode).vllm_config().kv_tail is lends


def test_kv_release_all_keeps_the_whole_sleep(job_env, tmp_path, gpu_like):
    res = run_job(job(tmp_path / "a", placement_margin="2GB", kv_release="all"), print_fn=lambda *_: None)
    assert res.summary["status"] == "ok", res.summary.get("error")
    (plan,), steps = events(tmp_path / "a")
    assert plan["kv_release"] == 0 and plan["rollout_sleeps"] and "releases" not in plan["label"]
    assert [s.get("rollout/kv_release_asked_bytes") for s in steps] == [0, 0, 0]


def test_a_sleep_the_user_forced_stays_whole(job_env, tmp_path, gpu_like):
    res = run_job(job(tmp_path / "f", placement_margin="2GB", offload="optimizer", rollout_sleep="always"),
                  print_fn=lambda *_: None)
    assert res.summary["status"] == "ok", res.summary.get("error")
    assert all(s.get("rollout/kv_release_asked_bytes") == 0 for s in events(tmp_path / "f")[1])
