"""Keeping part of a category through the rollout: the planner keeps, of the first category it moves, the
whole tensors that fit beside the awake rollout (Adam's moments are a few large tensors under ZeRO), and the
DeepSpeed trainer's colomem offload leaves exactly those on the device while the rest round-trips byte for
byte; the runner hands the part to a trainer that can keep one, and to no other."""
import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

import colomem
from colomem.errors import InvalidArgumentError
from colomem.grpo.config import LoraSpec
from colomem.runner import run_job
from colomem.runner.placement import MIN_KEPT_PART, Placement, choose, fits, keep_part_fit
from colomem.runner.train_memory_plan import with_kept_part
from fakes.deepspeed import bare_trainer, unchanged, zero2_swap
from fakes.models import lora_model
from fakes.placement import GB, figs, job

MOVES_MOMENTS = ("params", "other", "grads", "master")


def test_the_room_beside_the_rollout_is_kept_of_the_first_category_that_moves():
    f = figs(rollout=100, peak=90)                  # 100 + 3 + 6 + 12 = 121 fits, + 24 of moments does not
    p = choose("auto", "auto", [f], margin=2 * GB)
    assert p.keep == MOVES_MOMENTS
    assert keep_part_fit(p, [f], 2 * GB) == ("optim", 17 * GB)         # 140 - 2 - 121
    kept = replace(p, keep_part=("optim", 17 * GB))
    assert fits(kept, [f], 2 * GB) and not fits(replace(p, keep_part=("optim", 18 * GB)), [f], 2 * GB)
    assert kept.label == "trainer keeps params+other+grads+master and up to 15.83 GiB of optim, rollout sleeps"
    assert kept.to_dict()["keep_part"] == ["optim", 17 * GB]
    # every GPU must hold it: the tightest decides
    assert keep_part_fit(p, [f, figs(rollout=105, peak=90)], 2 * GB) == ("optim", 12 * GB)


def test_nothing_is_kept_of_a_category_where_it_would_not_pay_or_not_fit():
    f = figs(rollout=100, peak=90)
    p = choose("auto", "auto", [f], margin=2 * GB)
    assert keep_part_fit(p, [figs(rollout=116, peak=90)], 2 * GB) == ("", 0)     # 1 GB < MIN_KEPT_PART
    assert MIN_KEPT_PART > GB
    assert keep_part_fit(choose("auto", "auto", [figs()], margin=2 * GB), [figs()], 2 * GB) == ("", 0)  # nothing moves
    assert keep_part_fit(Placement(("params", "other"), True), [f], 2 * GB) == ("grads", 6 * GB)
    assert keep_part_fit(Placement((), True), [f], 2 * GB) == ("", 0)            # params+other: two categories
    # the moments come back inside the optimizer step: a part kept would sit through training's peak
    at_step = replace(figs(rollout=100, peak=120), optim_created=24 * GB)
    q = choose("auto", "auto", [at_step], margin=2 * GB)
    assert q.keep == MOVES_MOMENTS and keep_part_fit(q, [at_step], 2 * GB) == ("", 0)


def test_the_plan_keeps_a_part_only_for_a_trainer_that_can_and_says_so():
    f = figs(rollout=100, peak=90)
    p = choose("auto", "auto", [f], margin=2 * GB)
    cfg = SimpleNamespace(offload="auto", optimizer_state_memory="torch", optimizer_reload="auto")
    kept = with_kept_part(cfg, SimpleNamespace(keeps_part=True), p, [f], 2 * GB)
    assert kept.keep_part == ("optim", 17 * GB) and "whole tensors up to 15.83 GiB stay too" in kept.why
    assert with_kept_part(cfg, SimpleNamespace(), p, [f], 2 * GB) is p                  # the CPU stand-in
    can = SimpleNamespace(keeps_part=True)

    def but(**kw):
        return SimpleNamespace(**{**vars(cfg), **kw})
    assert with_kept_part(but(optimizer_state_memory="mapped"), can, p, [f], 2 * GB) is p   # moments move whole
    assert with_kept_part(but(offload="optimizer"), can, p, [f], 2 * GB) is p     # the user chose what moves
    assert with_kept_part(but(optimizer_reload="step"), can, p, [f], 2 * GB) is p   # back inside the step


def test_the_colomem_offload_leaves_the_kept_tensors_and_round_trips_the_rest():
    with zero2_swap() as (_, s, (master, weight, moments), before):
        assert len(moments) >= 2
        one = moments[0].untyped_storage().nbytes()
        s.keep, s.keep_part = MOVES_MOMENTS, ("optim", one)
        s.offload()
        stayed = [m for m in moments if m.untyped_storage().nbytes() > 0]
        assert len(stayed) == 1 and stayed[0].untyped_storage().nbytes() <= one
        assert master.untyped_storage().nbytes() > 0 and weight.untyped_storage().nbytes() > 0
        s.reload()
        assert unchanged((master, weight, *moments), before), "bytes changed over a swap that kept part of the moments"
        s.keep_part = ("", 0)                        # a new layout: every moment moves again
        s.offload()
        assert all(m.untyped_storage().nbytes() == 0 for m in moments)
        s.reload()
        assert unchanged((master, weight, *moments), before)
        s.close()


def test_the_trainer_refuses_a_part_it_cannot_keep():
    pool = colomem.PinnedPool("1MiB", pin=False)
    model, _ = lora_model()
    t = bare_trainer(model, LoraSpec(), pool=pool)
    with pytest.raises(InvalidArgumentError, match="colomem offload method"):
        t.offload(method="deepspeed", keep_part=("optim", 1 << 20))
    with pytest.raises(InvalidArgumentError, match="not kept whole"):
        t.offload(method="colomem", keep=("params", "optim"), keep_part=("optim", 1 << 20))
    with pytest.raises(InvalidArgumentError, match="not kept whole"):
        t.offload(method="colomem", keep_part=("moments", 1 << 20))
    with pytest.raises(InvalidArgumentError, match="whole number"):
        t.offload(method="colomem", keep_part=("optim", 2.5))
    pool.close(force=True)


def test_the_runner_hands_the_part_to_a_trainer_that_can_keep_one(job_env, tmp_path, monkeypatch):
    """The CPU loop with GPU-like figures and a stand-in that says it can keep a part: every offload after the
    plan carries the planned part (the stand-in itself moves whole sets)."""
    from colomem.engines.stand_ins import TorchTrainer
    from colomem.runner import train_memory_plan

    seen = []
    real = TorchTrainer.offload

    def offload(self, *, keep_part=("", 0), **kw):
        seen.append(tuple(keep_part))
        return real(self, **kw)
    monkeypatch.setattr(train_memory_plan, "figures_from_step", lambda *a, **k: figs(rollout=100, peak=90))
    monkeypatch.setattr(TorchTrainer, "keeps_part", True, raising=False)
    monkeypatch.setattr(TorchTrainer, "offload", offload)
    res = run_job(job(tmp_path / "k", placement_margin="2GB"), print_fn=lambda *_: None)
    assert res.summary["status"] == "ok", res.summary.get("error")
    lines = [json.loads(x) for x in (tmp_path / "k" / "metrics.jsonl").read_text().splitlines()]
    (plan,) = [x for x in lines if x.get("event") == "placement"]
    assert plan["keep_part"] == ["optim", 17 * GB] and "up to 15.83 GiB of optim" in plan["label"]
    assert seen[0] == ("", 0) and set(seen[1:]) == {("optim", 17 * GB)}
