"""The placement planner: given measured memory, what stays on the GPU; the modes a user can force; partial
offloads that move only what the plan says; a CPU job run with nothing moving trains exactly as one that
moves everything."""
import json
import re
from types import SimpleNamespace

import pytest
import torch

import colomem
from colomem.engines import deepspeed as dsa
from colomem.errors import ConfigError
from colomem.runner import run_job
from colomem.runner.config import config_from_dict
from colomem.runner.loop_memory import grow_sync_bucket
from colomem.runner.sync_bucket_plan import sync_bucket, sync_bucket_target
from colomem.units import format_bytes
from colomem.runner.placement import (ALL_CATEGORIES, EVERYTHING_MOVES, MemoryFigures, alternate, candidates, choose,
                                      Placement, figures_from_step, kv_hint, micro_batch_fit, micro_batch_hint,
                                      micro_batch_tokens_fit, micro_batch_tokens_hint,
                                      needs_measuring, reload_at_step, state_to_plan, train_need)
from colomem.errors import InvalidArgumentError
from colomem.grpo.config import LoraSpec
from fakes.deepspeed import bare_trainer, unchanged, zero2_swap
from fakes.models import lora_model
from fakes.placement import GB, figs, job, seven_b
from fakes.vllm import make, trainer_weights
from fakes.vllm import fake_vllm  # noqa: F401  (autouse: vLLM's modules stubbed)

CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------------- decisions
def test_nothing_moves_when_both_fit():
    p = choose("auto", "auto", [figs()], margin=2 * GB)       # 60 - 1 + 45 = 104 + 2 <= 140
    assert p.label == "nothing moves" and not p.trainer_moves and not p.rollout_sleeps
    assert set(p.keep) == set(ALL_CATEGORIES) and "104" not in p.why and "GiB" in p.why


def test_the_trainer_keeps_the_largest_prefix_that_fits_beside_the_awake_rollout():
    # train peak too large for nothing-moves (60 - 1 + 90 > 140); rollout 60 + params 3 + grads 6 + master 12
    # = 81 fits, + optim 24 = 105 too with margin 2: everything kept, vLLM sleeping (trainer resident)
    p = choose("auto", "auto", [figs(peak=90)], margin=2 * GB)
    assert p.rollout_sleeps and not p.trainer_moves and p.label == "trainer resident, rollout sleeps"
    # a larger rollout: 100 + 3 + 6 + 12 = 121 fits, + 24 does not: Adam moments go first
    p = choose("auto", "auto", [figs(rollout=100, peak=90)], margin=2 * GB)
    assert p.keep == ("params", "other", "grads", "master") and p.rollout_sleeps
    assert "did not fit: nothing moves, trainer resident" in p.why
    # 120 + 3 + 6 = 129 fits, + 12 does not: masters go too
    assert choose("auto", "auto", [figs(rollout=120, peak=90)], margin=2 * GB).keep == ("params", "other", "grads")
    # 134 + 3 = 137 + 2 fits; grads do not
    assert choose("auto", "auto", [figs(rollout=134, peak=90)], margin=2 * GB).keep == ("params", "other")
    # only the rollout fits: everything moves; not even that: the last candidate still, said to not fit
    p = choose("auto", "auto", [figs(rollout=137, peak=90)], margin=2 * GB)
    assert p.keep == () and p.rollout_sleeps and "does not fit" not in p.why
    p = choose("auto", "auto", [figs(rollout=139, peak=90)], margin=2 * GB)
    assert p.keep == () and "does not fit" in p.why


def test_the_plan_counts_the_state_the_first_optimizer_step_created():
    # the measuring step offloads before its first optimizer step: Adam's moments (and the gradients) do
    # not exist yet. vLLM at 85 % of a 140 GB GPU: 120 GB awake. From the offload alone (params 3 + masters
    # 6) the whole trainer would seem to fit beside it, and the next step's wake would run out of memory.
    offloaded = {"params": 3 * GB, "other": 0, "grads": 0, "master": 6 * GB, "optim": 0}
    after_training = {"params": 3 * GB, "other": 0, "grads": 0, "master": 6 * GB, "optim": 12 * GB, "scratch": 1}
    state = state_to_plan(offloaded, after_training)
    assert state == {**after_training, "grads": 0}
    assert state_to_plan({"grads": 5}, {"grads": 0}) == {"grads": 5}      # what was moved once counts too
    fig = lambda st: MemoryFigures(total=140 * GB, rollout_used=120 * GB, trainer_left=0,  # noqa: E731
                                   train_peak=50 * GB, state=st)
    assert choose("auto", "auto", [fig(offloaded)], margin=4 * GB).label == "trainer resident, rollout sleeps"
    p = choose("auto", "auto", [fig(state)], margin=4 * GB)
    assert p.keep == ("params", "other", "grads", "master") and f"moves {format_bytes(12 * GB)}" in p.why


def test_the_runner_plans_with_the_state_its_first_training_step_left(job_env, tmp_path, monkeypatch):
    # the CPU loop: its first offload moves no AdamW state (none exists yet); the plan still sees it
    from colomem.runner import train_memory_plan

    seen = []
    monkeypatch.setattr(train_memory_plan, "figures_from_step",
                        lambda memory, by_cat, total, **_: seen.append(dict(by_cat)))
    res = run_job(job(tmp_path / "plan", offload="auto"), print_fn=lambda *_: None)
    assert res.summary["status"] == "ok" and len(seen) == 1
    lines = [json.loads(x) for x in (tmp_path / "plan" / "metrics.jsonl").read_text().splitlines()]
    first = [x for x in lines if "reward_mean" in x][0]
    assert first["trainer_offload/moved_bytes"] > 0 and seen[0]["optim"] > 0 and seen[0]["params"] > 0


def test_every_gpu_must_fit_and_the_default_margin_scales_with_the_gpu():
    roomy, tight = figs(), figs(rollout=100, peak=90)
    assert choose("auto", "auto", [roomy, tight], margin=2 * GB).keep == ("params", "other", "grads", "master")
    assert choose("auto", "auto", [tight, roomy], margin=2 * GB).keep == ("params", "other", "grads", "master")
    # 3 % of 140 GB = 4.2 GB > 2 GiB: 104 + 4.2 fits, 104 + 36.1 does not
    assert choose("auto", "auto", [figs()]).label == "nothing moves"
    assert choose("auto", "auto", [figs()], margin=37 * GB).label != "nothing moves"


def test_forced_modes_take_their_one_placement_without_measuring():
    assert not needs_measuring("all", "auto") and not needs_measuring("none", "always")
    assert needs_measuring("auto", "auto") and needs_measuring("none", "auto")
    assert choose("all", "auto", []).keep == () and choose("all", "always", []).rollout_sleeps
    opt = choose("optimizer", "auto", [])
    assert opt.keep == ("params", "other", "grads") and opt.rollout_sleeps and opt.trainer_moves
    resident = choose("none", "always", [])
    assert not resident.trainer_moves and resident.rollout_sleeps
    still = choose("none", "never", [])
    assert still.label == "nothing moves"
    # asked for, so taken even when the figures say it does not fit (the out-of-memory names the phase)
    forced = choose("none", "never", [figs(peak=200)])
    assert forced.label == "nothing moves" and "does not fit" in forced.why
    # offload none, rollout_sleep auto: vLLM sleeps only when both do not fit together
    assert choose("none", "auto", [figs()]).label == "nothing moves"
    assert choose("none", "auto", [figs(peak=90)]).label == "trainer resident, rollout sleeps"


def test_combinations_that_cannot_work_are_refused_early(tmp_path):
    with pytest.raises(ConfigError, match="offload none"):
        candidates("all", "never")
    with pytest.raises(ConfigError, match="choose one of"):
        candidates("most", "auto")
    base = {"backend": "cpu", "out": str(tmp_path / "o")}
    with pytest.raises(ConfigError, match="rollout_sleep never"):
        config_from_dict({**base, "offload": "optimizer", "rollout_sleep": "never"})
    with pytest.raises(ConfigError, match="timesplit"):
        config_from_dict({**base, "switch": "timesplit", "offload": "none"})
    with pytest.raises(ConfigError):
        config_from_dict({**base, "placement_margin": "lots"})


def test_the_memory_left_free_is_offered_to_a_larger_micro_batch():
    # the training peak is 8 GB over the 45 GB of state: 2 GB a row at micro-batch 4. Nothing moves needs
    # 60 - 1 + 53 + 2 margin = 114 of 140: 26 GB free, 13 rows more, and 16 is the largest divisor of 64 <= 17
    f = figs(peak=53)
    p = choose("auto", "auto", [f], margin=2 * GB)
    assert p.label == "nothing moves"
    hint = micro_batch_hint(p, [f], 4, 64, margin=2 * GB)
    assert "--micro-batch up to 16 (now 4)" in hint and f"{format_bytes(26 * GB)} stays free" in hint
    assert "up to 8 (now 4)" in micro_batch_hint(p, [f], 4, 8, margin=2 * GB)        # a rank's rows cap it
    assert micro_batch_hint(p, [f], 4, 64, margin=2 * GB, taken=20 * GB) == ""       # 6 GB: 7 rows, no divisor
    assert micro_batch_hint(p, [f], 8, 8, margin=2 * GB) == ""                       # already every row
    assert micro_batch_hint(p, [figs()], 4, 64, margin=2 * GB) == ""                 # no activations measured
    # while vLLM sleeps, training has the GPU but for what stays beside the trainer (train_other)
    full = figs(total=140, rollout=137.5, peak=90)
    full.train_other = 47 * GB                                                          # 90 + 47 + 2 > 138
    assert micro_batch_hint(choose("auto", "auto", [full], margin=2 * GB), [full], 4, 64, margin=2 * GB) == ""
    full.train_other = 1 * GB                                  # 47 GB free while training: 8 (of 64 rows) fits
    assert "up to 8 (now 4)" in micro_batch_hint(choose("auto", "auto", [full], margin=2 * GB), [full], 4, 64,
                                                 margin=2 * GB)
    assert micro_batch_hint(p, [], 4, 64) == ""
    # several GPUs: the one with the least room decides
    tight = figs(rollout=80, peak=53)                   # 80 - 1 + 53 + 2 = 134: 6 GB, 3 rows: no divisor
    assert micro_batch_hint(p, [f, tight], 4, 64, margin=2 * GB) == ""


def test_the_memory_left_free_is_offered_to_a_larger_token_budget():
    # 8 GB of activations at 8192 tokens a micro-batch; 26 GB free buys 26624 tokens more
    f = figs(peak=53)
    p = choose("auto", "auto", [f], margin=2 * GB)
    hint = micro_batch_tokens_hint(p, [f], 8192, margin=2 * GB)
    assert "--micro-batch-tokens up to 34816 (now 8192)" in hint            # 8192 + 26 GB / (8 GB / 8192)
    assert micro_batch_tokens_hint(p, [f], 8192, margin=2 * GB, taken=26 * GB) == ""   # nothing left free
    assert micro_batch_tokens_hint(p, [figs()], 8192, margin=2 * GB) == ""             # no activations measured


def test_grow_micro_batch_takes_what_the_hint_names_on_the_trainer_and_says_so():
    """--grow-micro-batch: after the measuring step the trainer's micro-batch (or token budget) becomes the
    largest the free memory holds, the line says from which step, and nothing changes when none larger fits."""
    from colomem.runner.train_memory_plan import grow_micro_batch

    f = figs(peak=53)                                  # as above: 16 rows of 64 fit, or 34816 tokens
    p = choose("auto", "auto", [f], margin=2 * GB)
    assert micro_batch_fit(p, [f], 4, 64, margin=2 * GB) == 16
    assert micro_batch_fit(p, [f], 4, 64, margin=2 * GB, taken=20 * GB) == 4
    assert micro_batch_tokens_fit(p, [f], 8192, margin=2 * GB) == 34816
    assert micro_batch_tokens_fit(p, [f], 8192, margin=2 * GB, taken=26 * GB) == 8192
    # each row or token also holding what the measured step did not (layers no longer checkpointed): as much
    # again, so half as many more
    assert micro_batch_fit(p, [f], 4, 64, margin=2 * GB, unit_extra=2 * GB) == 8           # 4 + 26 / 4: 10
    assert micro_batch_tokens_fit(p, [f], 8192, margin=2 * GB, unit_extra=GB / 1024) == 8192 + 13312

    def grow(tokens=None, taken=0):
        trainer = SimpleNamespace(micro_batch=4, micro_batch_tokens=tokens)
        cfg = SimpleNamespace(micro_batch=4, micro_batch_tokens=tokens)
        line, grown = grow_micro_batch(cfg, trainer, p, [f], 64, 2 * GB, taken, 2)
        return line, grown, trainer
    line, grown, trainer = grow()
    assert trainer.micro_batch == 16 and grown == (4, 16)
    assert line.startswith("--micro-batch 4 -> 16 from step 2 on")
    line, grown, trainer = grow(tokens=8192)
    assert line.startswith("--micro-batch-tokens 8192 -> 34816")
    assert trainer.micro_batch_tokens == 34816 and trainer.micro_batch == 4 and grown == (8192, 34816)
    line, grown, trainer = grow(taken=20 * GB)                                         # nothing larger fits
    assert trainer.micro_batch == 4 and grown is None
    assert line.startswith("--micro-batch stays 4 (--grow-micro-batch: the 5.59 GiB left free") \
        and "divides the step's 64 rows" in line                                       # said, not silent
    line, grown, trainer = grow(tokens=8192, taken=26 * GB)
    assert line.startswith("--micro-batch-tokens stays 8192") and "rows" not in line
    assert trainer.micro_batch_tokens == 8192 and grown is None
    # more taken than was free (a grown sync bucket and the trim): no negative size in the line
    line, _, _ = grow(taken=40 * GB)
    assert "nothing is left free while training" in line and not re.search(r"-\d", line)


def test_grow_micro_batch_needs_the_measured_placement():
    base = {"backend": "cpu"}
    config_from_dict({**base, "grow_micro_batch": True})
    config_from_dict({**base, "grow_micro_batch": True, "offload": "none"})        # vLLM's sleep still measured
    for fixed in ({"offload": "none", "rollout_sleep": "never"}, {"offload": "all", "rollout_sleep": "always"},
                  {"switch": "timesplit"}):
        with pytest.raises(ConfigError, match="--grow-micro-batch"):
            config_from_dict({**base, "grow_micro_batch": True, **fixed})


def test_the_memory_left_free_is_offered_to_the_kv_cache():
    f = figs(total=140, rollout=60, left=1, peak=45)       # nothing moves needs 104 + 2: 34 GB free
    p = choose("auto", "auto", [f], margin=2 * GB)
    hint = kv_hint(p, [f], 0.3, margin=2 * GB)
    # 34 GB of 140 -> +0.24; with everything moving 140 - 2 - 60 = 78 GB -> +0.56
    assert "up to 0.54 (now 0.30)" in hint and "--offload all --rollout-sleep always, up to 0.86" in hint
    full = figs(total=140, rollout=137.5, peak=90)
    assert kv_hint(choose("auto", "auto", [full], margin=2 * GB), [full], 0.9, margin=2 * GB) == ""
    assert kv_hint(p, [], 0.3) == ""


def test_figures_come_from_a_step_that_moved_everything():
    memory = {"rollout": {"driver_used": 60 * GB}, "offload": {"reserved": GB},
              "train": {"peak_reserved": 45 * GB, "reserved": 44 * GB}}
    f = figures_from_step(memory, {"params": 3 * GB, "optim": 24 * GB}, 140 * GB)
    assert (f.rollout_used, f.trainer_left, f.train_peak, f.kept_bytes(["params", "optim"])) == (
        60 * GB, GB, 45 * GB, 27 * GB)
    cpu = {"rollout": {"driver_used": None}, "offload": {"reserved": None}, "train": {"peak_reserved": None}}
    assert figures_from_step(cpu, {}, 0) is None
    assert EVERYTHING_MOVES.keep == () and EVERYTHING_MOVES.rollout_sleeps


MiB, GiB = 1 << 20, 1 << 30


def test_the_weight_bridge_grows_to_one_bucket_a_sync_when_the_placement_leaves_the_memory():
    f = figs(total=140, rollout=60, left=1, peak=45)       # nothing moves: 34 GB free beside the 2 GB margin
    p = choose("auto", "auto", [f], margin=2 * GB)
    # a 3.09 GB sync in one bucket (rounded up to 64 MiB), two buffers of it
    assert sync_bucket(p, [f], 3_087_428_608, 512 * MiB, 2, margin=2 * GB) == 3008 * MiB
    # never beyond 4 GiB, and never smaller than what the bridge has
    assert sync_bucket(p, [f], 15 * GB, 512 * MiB, 2, margin=2 * GB) == 4 * GiB
    assert sync_bucket(p, [f], 400 * MiB, 512 * MiB, 2, margin=2 * GB) is None
    # little room: halved until two buffers fit beside the margin and 1 GiB
    tight = figs(total=140, rollout=60, left=1, peak=45 + 30)      # 4 GB free
    assert sync_bucket(choose("auto", "auto", [tight], margin=2 * GB), [tight], 3 * GB, 512 * MiB, 2,
                       margin=2 * GB) == 1472 * MiB
    full = figs(total=140, rollout=137.5, peak=90)
    assert sync_bucket(choose("auto", "auto", [full], margin=2 * GB), [full], 3 * GB, 512 * MiB, 2,
                       margin=2 * GB) is None
    assert sync_bucket(p, [], 3 * GB, 512 * MiB, 2) is None


def test_a_sync_from_the_pools_host_copies_keeps_a_few_buckets_so_copies_pipeline_with_the_worker():
    f = figs(total=140, rollout=60, left=1, peak=45)
    p = Placement((), True, "the trainer offloaded: the sync reads the host copies of its weights")
    # 3.09 GB read from host copies: six buckets of ~491 MiB would be smaller than 512 MiB, so 512 MiB each;
    # the bridge already has 512 MiB buckets, so nothing grows
    assert sync_bucket_target(3_087_428_608, from_host=True) == 512 * MiB
    assert sync_bucket(p, [f], 3_087_428_608, 512 * MiB, 2, margin=2 * GB) is None
    # 15 GB: six buckets of 2.5 GB, rounded up to 64 MiB
    assert sync_bucket_target(15 * GB, from_host=True) == 2432 * MiB
    assert sync_bucket(p, [f], 15 * GB, 512 * MiB, 2, margin=2 * GB) == 2432 * MiB
    # a sync smaller than the smallest host bucket is one bucket, and GPU sources still get one bucket
    assert sync_bucket_target(100 * MiB, from_host=True) == 128 * MiB
    assert sync_bucket_target(3_087_428_608, from_host=False) == 3008 * MiB
    assert sync_bucket_target(15 * GB, from_host=False) == 4 * GiB


def test_the_runner_grows_the_buckets_only_when_asked_auto_and_says_so():
    f = figs(total=140, rollout=60, left=1, peak=45)
    said, r = [], make(bucket_bytes=512 * MiB)

    placement = choose("auto", "auto", [f], margin=2 * GB)

    def grow(bucket_bytes, engine="cross-process"):
        cfg = SimpleNamespace(bucket_bytes=bucket_bytes, effective_engine=engine)
        return grow_sync_bucket(cfg, r, placement, [f], 3 * GB, 2 * GB, said.append)

    assert grow("512MiB") == 0
    assert grow("auto", "in-rank") == 0
    assert r.bucket_bytes == 512 * MiB and not said
    taken = grow("auto")
    assert r.bucket_bytes == 2880 * MiB and taken == 2 * (2880 - 512) * MiB
    assert len(said) == 1 and "buckets of 2.81 GiB x 2" in said[0]
    # the KV-cache hint counts what the larger buffers take
    p = choose("auto", "auto", [f], margin=2 * GB)
    assert "up to 0.51 (now 0.30)" in kv_hint(p, [f], 0.3, margin=2 * GB, taken=taken)
    r.close()


# ------------------------------------------------------------------------------ partial offload, moved
def test_a_partial_colomem_offload_moves_only_what_is_not_kept():
    with zero2_swap() as (_, s, (master, weight, moments), before):
        for keep in [("params", "other", "grads", "master"), ("params", "other", "grads"), ()]:
            s.keep = keep
            move = s.offload()
            assert (weight.untyped_storage().nbytes() > 0) == ("params" in keep)
            assert (master.untyped_storage().nbytes() > 0) == ("master" in keep)
            assert all(m.untyped_storage().nbytes() == 0 for m in moments)           # optim never kept here
            assert move.nbytes == sum(move.state.sizes[c] for c in dsa.CATEGORIES if c not in keep)
            if "params" in keep:
                assert s.host_view(weight) is None          # not moved: the sync reads it on the GPU
            s.reload()
            assert unchanged((master, weight, *moments), before), "bytes changed over a partial swap"
        s.close()


def test_weights_kept_on_the_device_are_read_there_while_the_rest_is_offloaded():
    """offload(keep=("params", ...)): no staging; the sync and the adapter read the trainer's own tensors."""
    pool = colomem.PinnedPool("1MiB", pin=False)
    model, _ = lora_model()
    t = bare_trainer(model, LoraSpec(), pool=pool)
    want = {k: v.clone() for k, v in t.named_weights(merged=True)}
    adapter = t.lora_state()
    t._offloaded, t._params_kept = True, True
    got = dict(t.named_weights(merged=True))
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    base = dict(t.named_weights(merged=False))
    own = {p.data_ptr() for p in model.parameters()}
    assert any(v.data_ptr() in own for v in base.values())        # views of the model's storage, not copies
    assert all(torch.equal(v, t.lora_state()[k]) for k, v in adapter.items())
    assert pool.stats()["in_use_bytes"] == 0                      # nothing staged
    t._offloaded = False
    with pytest.raises(InvalidArgumentError, match="unknown categories"):
        t.offload(method="colomem", keep=("params", "weights"))
    with pytest.raises(InvalidArgumentError, match="colomem offload method"):
        t.offload(method="deepspeed", keep=("params",))
    pool.close(force=True)


def test_a_sync_into_an_engine_that_stayed_awake_drops_its_prefix_cache():
    """Without a sleep, vLLM's cached KV blocks were computed with the old weights: they must go."""
    r = make(sync_transport="listener")
    first = r.load_weights(trainer_weights(1).items(), version=1)  # awake (a fresh engine): nothing slept
    assert r.llm.calls.count("reset_prefix_cache") == 1
    assert 0 < first.prefix_reset_seconds <= first.seconds       # its time is the sync's, and said apart
    r.sleep()
    r.wake_weights()
    second = r.load_weights(trainer_weights(2).items(), version=2)  # weights only: the sleep dropped the cache
    assert r.llm.calls.count("reset_prefix_cache") == 1 and second.prefix_reset_seconds == 0
    r.wake_kv()
    r.load_weights(trainer_weights(3).items(), version=3)
    assert r.llm.calls.count("reset_prefix_cache") == 2
    r.close()


def test_alternate_needs_the_trainer_resident():
    assert candidates("none", "alternate") == [Placement(ALL_CATEGORIES, False)]
    for offload in ("auto", "all", "optimizer"):
        with pytest.raises(ConfigError, match="needs offload none"):
            candidates(offload, "alternate")
    p = Placement(ALL_CATEGORIES, False)
    assert [alternate(p, k).rollout_sleeps for k in range(4)] == [True, False, True, False]
    assert all(alternate(p, k).keep == ALL_CATEGORIES for k in range(4))


# ------------------------------------------------------------------------ the optimizer step's own peak
def test_a_step_that_fits_only_as_the_first_one_brings_the_optimizer_state_back_inside_it():
    f = seven_b()
    # the first step's peak did not hold the moments: with them on the GPU from the start, 128 + 57 + 4
    assert train_need(f, at_step=False) == 189 * (1 << 30) and train_need(f, at_step=True) == 132 * (1 << 30)
    p = choose("auto", "auto", [f])
    # resident would need the moments through training: they go; the rest fits beside the awake rollout
    assert p.keep == ("params", "other", "grads", "master") and p.rollout_sleeps
    at, why = reload_at_step(p, [f])
    assert at and "inside the step" in why and "57" in why
    # no room either: the same, and a job whose moments existed through the measured step never does
    assert not reload_at_step(p, [seven_b(optim_created=0)])[0]
    assert not reload_at_step(Placement(ALL_CATEGORIES, True), [f])[0]
    # a small job: reloading behind forward and backward fits, so that stays
    small = figs()
    small.optim_created, small.train_other = small.state["optim"], 2 * GB
    assert not reload_at_step(Placement(("params", "other"), True), [small], margin=2 * GB)[0]


def test_keeping_the_optimizer_state_must_fit_training_too_not_only_the_rollout():
    # vLLM's awake footprint is small, so the whole trainer fits beside it while it generates; but with the
    # moments resident the step needs 4 + 128 + 57 > 139.8: the trainer may not keep them into training
    f = seven_b(rollout_used=20 * (1 << 30))
    p = choose("auto", "auto", [f])
    assert "trainer resident, rollout sleeps;" in p.why + ";" and p.optim_out
    assert "optim" not in choose("auto", "auto", [f], optim_out=False).keep
    # and nothing-moves counts the moments the first step created on top of its training peak
    g = figs(peak=70)
    assert choose("auto", "auto", [g], margin=2 * GB).label == "nothing moves"       # 60 - 1 + 70 + 2
    g.optim_created = 24 * GB                                                          # + 24 > 140
    assert choose("auto", "auto", [g], margin=2 * GB).label != "nothing moves"


def test_hints_and_bucket_growth_count_the_memory_training_takes():
    f = seven_b()
    p = choose("auto", "auto", [f])
    # 50 GiB are free while vLLM generates, none while training: no larger micro-batch, no larger buckets
    assert micro_batch_hint(p, [f], micro_batch=2, rows=256) == ""
    assert sync_bucket(p, [seven_b(train_other=8 << 30)], sync_bytes=15 << 30, current=512 << 20, buffers=2) is None
    assert "gpu-memory-utilization up to" in kv_hint(p, [f], utilization=0.25)


# ------------------------------------------------------------- the optimizer state out for the optimizer step
def test_a_trainer_that_fits_the_rollout_whole_sends_only_its_moments_out_behind_the_rollout():
    """The whole trainer fits beside the awake rollout, but its optimizer step cannot hold the moments: they
    stay in the rollout's memory while they copy out behind it (one hidden copy, one inside the step)
    instead of going out, exposed, before every rollout. The forward and backward's peak plays no part:
    the moments are gone before training starts."""
    gib = 1 << 30
    f = seven_b(rollout_used=20 * gib)              # 20 + 113 + 4.2 margin < 139.8
    p = choose("auto", "auto", [f])
    assert p.optim_out and p.keep == ALL_CATEGORIES and p.rollout_sleeps and not p.trainer_moves
    assert p.offload_keep == ("params", "other", "grads", "master")      # what the switch's offload leaves
    assert p.label == "trainer resident, rollout sleeps, optimizer state out behind the rollout"
    assert "out behind the rollout" in p.why and p.to_dict()["optim_out"]
    at, why = reload_at_step(p, [f])
    assert at and "come back inside the step" in why
    # the same with a forward and backward that would not hold the moments beside them (the 7.6B job's 78 GiB)
    assert choose("auto", "auto", [seven_b(rollout_used=20 * gib, pre_step_peak=78 * gib)]).optim_out
    # a job that asked for the state back before the step, or a trainer that cannot: never chosen
    assert not choose("auto", "auto", [f], optim_out=False).optim_out
    # the rollout must still fit with the whole trainer: with 23 GiB more it is short, and the moments move
    q = choose("auto", "auto", [seven_b(rollout_used=43 * gib)])
    assert not q.optim_out and "optim" not in q.keep
    # forced modes never pick it
    assert not any(c.optim_out for m in (("none", "always"), ("optimizer", "auto"), ("all", "auto"))
                   for c in candidates(*m))


def test_the_training_head_room_of_that_placement_is_the_measured_step_s():
    from colomem.runner import placement as pl

    gib, total = 1 << 30, int(139.8 * (1 << 30))
    f = seven_b(rollout_used=20 * gib)
    p = choose("auto", "auto", [f], margin=2 * gib)
    # the moments are in the pool when training starts and come back inside the step: 4 + 128 + 2 margin
    assert p.optim_out and pl.train_spare(p, [f], 2 * gib, 0) == total - 134 * gib
    assert micro_batch_hint(p, [f], micro_batch=2, rows=4, margin=2 * gib) == ""


def test_the_optimizer_state_that_could_come_back_before_the_step_is_what_fits_beside_the_steps_start():
    """The room beside the peak at the optimizer step's start (the gradients' cast), on the tightest GPU, at
    most the state the step brings back; nothing when that peak was not measured."""
    from colomem.runner.placement import early_reload_room

    gib = 1 << 30
    f = seven_b(step_start_peak=100 * gib)                       # 139.8 - 2 margin - 4 other - 100
    assert early_reload_room([f], margin=2 * gib) == int(139.8 * gib) - 106 * gib
    g = seven_b(step_start_peak=110 * gib)
    assert early_reload_room([f, g], margin=2 * gib) == int(139.8 * gib) - 116 * gib
    assert early_reload_room([seven_b(step_start_peak=40 * gib)], margin=2 * gib) == 57 * gib    # all of it
    assert early_reload_room([seven_b(step_start_peak=139 * gib)]) == 0
    assert early_reload_room([seven_b()]) == early_reload_room([]) == 0
    assert figures_from_step({"rollout": {"driver_used": 1}, "offload": {"reserved": 0},
                              "train": {"peak_reserved": 5}}, {}, 10, step_start_peak=4).step_start_peak == 4
