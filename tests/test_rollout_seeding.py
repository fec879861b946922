"""--rollout-seeding: per-request seeds (the default: a resume samples what the unbroken run did) or the
engine's own generator, seeded once (as TRL runs vLLM). What each mode hands the rollout, what the stand-in
rollout does with no seed, and a CPU job in each mode."""
import json

import pytest
import torch

from colomem.runner import run_job
from colomem.runner.config import config_from_dict
from colomem.runner.loop import rollout_seed

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory):
    from colomem.grpo.tasks import make_task
    from colomem.grpo.tiny_model import model_dir

    root = tmp_path_factory.mktemp("colomem-cache")
    model_dir("tiny", make_task("successor").alphabet, cache_dir=root / "models", log=lambda *_: None)
    return root


def test_request_seeding_gives_every_step_and_group_a_seed_and_engine_seeding_none():
    seeds = {rollout_seed(3, k, g, "request") for k in range(20) for g in range(4)}
    assert len(seeds) == 80 and all(0 <= s < 2 ** 31 for s in seeds)
    assert rollout_seed(3, 5, 1, "request") == rollout_seed(3, 5, 1, "request")
    starts = sorted(seeds)                          # each step's 32 x 8 completions take a range of seeds
    assert all(b - a >= 256 for a, b in zip(starts, starts[1:]))
    assert rollout_seed(3, 5, 1, "engine") is None


def test_engine_seeding_gives_each_engine_its_own_seed():
    req = config_from_dict({"backend": "cpu"})
    eng = config_from_dict({"backend": "cpu", "rollout_seeding": "engine", "seed": 7})
    assert req.rollout_seeding == "request" and req.rollout_engine_seed(0) == req.rollout_engine_seed(1)
    assert eng.rollout_engine_seed(0) != eng.rollout_engine_seed(1)   # no two engines draw the same noise
    assert eng.vllm_config(rollout_group=1).seed == eng.rollout_engine_seed(1)
    assert config_from_dict({"backend": "cpu", "seeded_noise": "vllm"}).vllm_config().seeded_noise == "vllm"
    assert req.vllm_config().seeded_noise == "batched"
    with pytest.raises(Exception, match="rollout_seeding"):
        config_from_dict({"backend": "cpu", "rollout_seeding": "per-token"})


def test_unseeded_stand_in_draws_like_an_engine_generator(model_cache, monkeypatch):
    from colomem.engines.stand_ins import HFRollout
    from colomem.grpo.tasks import make_task
    from colomem.grpo.tiny_model import model_dir

    monkeypatch.setenv("COLOMEM_CACHE", str(model_cache))
    d = model_dir("tiny", make_task("successor").alphabet, log=lambda *_: None)
    prompts = [[2, 4, 5, 6], [2, 7, 8, 9]]

    def draws(seed):
        r = HFRollout(d, eos_token_id=1, pad_token_id=0, seed=seed)
        outer = torch.random.get_rng_state()
        got = [[c.token_ids for c in g] for _ in range(3)
               for g in r.generate(prompts, n=4, max_new_tokens=6, temperature=1.0, seed=None)]
        assert torch.equal(torch.random.get_rng_state(), outer)      # the caller's generator untouched
        return got

    a, b, c = draws(0), draws(0), draws(1)
    assert a == b                                   # the same engine seed: the same draws, call after call
    assert a != c
    assert a[0] != a[2]                             # each call advances the generator: no sample repeats


@pytest.mark.parametrize("seeding", ["request", "engine"])
def test_a_cpu_job_runs_in_either_mode(model_cache, monkeypatch, tmp_path, seeding):
    monkeypatch.setenv("COLOMEM_CACHE", str(model_cache))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    out = tmp_path / seeding
    cfg = config_from_dict({"backend": "cpu", "steps": 2, "prompts_per_step": 4, "micro_batch": 8,
                            "progress": False, "out": str(out), "grpo": {"group_size": 4},
                            "rollout_seeding": seeding})
    run_job(cfg, print_fn=lambda *_: None)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps_done"] == 2
    assert summary["config"]["rollout_seeding"] == seeding
