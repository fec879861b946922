"""The in-rank vLLM engine without vLLM: the --engine flag and its messages, the options and environment the
engine is built with (external launcher, one seed per tensor-parallel group, the torchrun variables), the
caller's random state kept across the build, the ZeRO-3 gather in buckets, and the check that the ranks of
one tensor-parallel engine generated the same completions (real gloo ranks, TP x DP layouts)."""
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ports import free_port
from child_env import child_env

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4), (8, 2), (8, 4), (8, 8)]


def _cfg(**kw):
    from colomem.runner.config import config_from_dict

    return config_from_dict(kw)


# ------------------------------------------------------------------------------------------ the flag
def test_auto_is_the_in_rank_engine_unless_vllm_cannot_sit_in_the_trainers_process(monkeypatch):
    import types

    assert _cfg().engine == "auto" and _cfg().effective_engine == "in-rank"
    assert _cfg(tensor_parallel_size=2).effective_engine == "in-rank"
    # torch's expandable segments in the trainer's process: vLLM's sleep-mode allocator refuses them there
    assert _cfg(trainer_expandable=True, backend="gpu").effective_engine == "cross-process"
    assert _cfg(backend="cpu").effective_engine == "cross-process"          # no vLLM there
    # a process that already built an engine with sleep mode (a notebook's second job): vLLM keeps one such
    # allocator a process, so the next engine gets a process of its own; observed when the config is made
    held = {"bytes": 1 << 20}
    cumem = types.ModuleType("vllm.device_allocator.cumem")
    setattr(cumem, "CuMemAllocator", types.SimpleNamespace(
        instance=types.SimpleNamespace(get_current_usage=lambda: held["bytes"])))
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", cumem)
    second = _cfg()
    assert second.effective_engine == "cross-process"
    held["bytes"] = 0
    assert second.effective_engine == "cross-process"       # the run keeps the engine it was planned with
    assert _cfg().effective_engine == "in-rank"
    assert _cfg(tensor_parallel_size=2).effective_engine == "in-rank"   # spans the ranks whatever else
    assert _cfg(engine="in-rank").effective_engine == "in-rank"
    assert _cfg(engine="cross-process").effective_engine == "cross-process"


@pytest.mark.parametrize("options,match", [
    ({"engine": "cross-process", "tensor_parallel_size": 2}, "cannot span the torchrun ranks.*--engine in-rank"),
    ({"engine": "in-rank", "backend": "cpu"}, "the CPU backend has no vLLM"),
    ({"tensor_parallel_size": 4, "backend": "cpu"}, "tensor_parallel_size=4 needs the gpu backend"),
    ({"engine": "inrank"}, "'auto', 'in-rank' or 'cross-process'"),
])
def test_an_engine_that_cannot_run_is_refused_with_what_to_use(options, match):
    from colomem.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        _cfg(**options)


def test_the_flag_is_on_the_command_line():
    from colomem.runner.config import load_run_config

    assert load_run_config(["--engine", "in-rank", "--tensor-parallel-size", "2"]).effective_engine == "in-rank"
    from colomem.errors import ConfigError

    with pytest.raises(ConfigError, match="--engine"):
        load_run_config(["--engine", "cross-process", "--tensor-parallel-size", "2"])


# ------------------------------------------------------------------------------------ the engine's options
def test_the_in_rank_engine_is_built_with_the_external_launcher_and_the_direct_sync():
    v = _cfg(engine="in-rank", tensor_parallel_size=2, seed=7).vllm_config(device=1, rollout_group=3)
    assert v.engine_in_process and v.external_launcher and v.sync_transport == "direct" and v.device == 1
    kw = v.llm_arguments("/m")
    assert kw["distributed_executor_backend"] == "external_launcher" and kw["tensor_parallel_size"] == 2
    assert kw["seed"] == 10                                   # the group's seed: 7 + group 3


def test_the_cross_process_engine_has_its_own_process_and_the_bridge():
    v = _cfg(engine="cross-process", seed=7).vllm_config(device=0, rollout_group=3)
    assert not v.engine_in_process and not v.external_launcher and v.sync_transport == "listener"
    kw = v.llm_arguments("/m")
    assert "distributed_executor_backend" not in kw and kw["seed"] == 7


def test_an_engine_process_started_from_a_torchrun_rank_hosts_its_own_store(monkeypatch):
    # torchrun sets TORCHELASTIC_USE_AGENT_STORE in its ranks; an engine process inheriting it would wait for a
    # store nobody serves (its own one-process group's); the rank keeps the variable
    import types

    from colomem.engines.vllm.engine_calls import build_llm

    seen = []
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(
        LLM=lambda **kw: seen.append(os.environ.get("TORCHELASTIC_USE_AGENT_STORE")) or "engine"))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert build_llm({"model": "/m"}, False, lambda: None) == "engine"
    assert seen == [None] and os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    build_llm({"model": "/m"}, False, lambda: None)
    assert seen == [None, None] and "TORCHELASTIC_USE_AGENT_STORE" not in os.environ


def test_the_external_launcher_needs_the_engine_in_process():
    from colomem.engines.vllm.config import VLLMConfig
    from colomem.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="external_launcher=True .* engine_in_process=True"):
        VLLMConfig(external_launcher=True)
    assert VLLMConfig(external_launcher=True, engine_in_process=True, sync_transport="direct").external_launcher


@pytest.mark.parametrize("world,tp", LAYOUTS)
def test_seeds_are_one_per_engine_as_vllm_groups_the_ranks(world, tp):
    """vLLM's external launcher lays the world out as (W / TP engines) x TP shards: ranks g*TP .. g*TP+TP-1
    make engine g. Its shards share one seed; two engines never do."""
    from colomem.runner.inrank import engine_seed
    from colomem.runner.ranks import Ranks

    vllm_groups = torch.arange(world).reshape(-1, 1, 1, 1, tp).view(-1, tp).tolist()   # vLLM's TP groups
    ranks = [Ranks(r, world, r, tp) for r in range(world)]
    assert sorted(r.group_ranks for r in ranks) == sorted(g for g in vllm_groups for _ in g)
    seeds = {tuple(g): {engine_seed(5, ranks[r].rollout_group) for r in g} for g in vllm_groups}
    assert all(len(s) == 1 for s in seeds.values())
    assert len({next(iter(s)) for s in seeds.values()}) == world // tp


# ------------------------------------------------------------------------------------ the environment
def test_torchrun_variables_are_left_as_torchrun_set_them():
    from colomem.engines.vllm.launcher import launcher_env

    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "29500"}
    assert launcher_env(env) == {}


def test_a_job_of_one_process_without_torchrun_gets_a_one_rank_world():
    from colomem.engines.vllm.launcher import launcher_env

    got = launcher_env({}, port=12345)
    assert got == {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "12345"}
    assert 0 < int(launcher_env({"WORLD_SIZE": "1"})["MASTER_PORT"]) < 65536       # a free port by default


@pytest.mark.parametrize("env,match", [
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "h"}, "MASTER_PORT not set"),
    ({"WORLD_SIZE": "4"}, "RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set"),
    ({"RANK": "2"}, "RANK=2 in a job of one rank"),
])
def test_a_torchrun_environment_with_a_hole_is_refused(env, match):
    from colomem.engines.vllm.launcher import launcher_env
    from colomem.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=match):
        launcher_env(env)


def test_the_callers_random_state_survives_an_engine_that_reseeds_everything():
    import numpy as np

    from colomem.engines.vllm.launcher import kept_random_state

    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    want = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    with kept_random_state():
        torch.manual_seed(99), random.seed(99), np.random.seed(99)     # what vLLM's worker does at start
        torch.rand(5)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]


# ------------------------------------------------------------------------------------ ZeRO-3 in buckets
@pytest.mark.parametrize("sizes,limit,want", [
    ([4, 4, 4, 4], 8, [(0, 2), (2, 4)]),
    ([4, 4, 4], 100, [(0, 3)]),
    ([20, 1, 1, 20], 8, [(0, 1), (1, 3), (3, 4)]),      # a group larger than the bucket is one of its own
    ([], 8, []),
])
def test_buckets_are_consecutive_and_bounded(sizes, limit, want):
    from colomem.engines.deepspeed.gather import plan_buckets

    assert plan_buckets(sizes, limit) == want


class _Partitioned:
    """What ZeRO-3 does to a model between gathers, on CPU: every parameter's data is an empty slice until a
    gather puts the whole tensor back (the full values are kept aside); counts the gathers."""

    def __init__(self, model):
        self.full = {id(p): p.data.clone() for p in model.parameters()}
        self.gathers, self.live = 0, set()
        for p in model.parameters():
            p.data = torch.empty(0)

    def gather(self, params):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            self.gathers += 1
            for p in params:
                p.data = self.full[id(p)].clone()
                self.live.add(id(p))
            try:
                yield
            finally:
                for p in params:
                    p.data = torch.empty(0)
                    self.live.discard(id(p))
        return ctx()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)])     # 6 modules, 1088 bytes each


def test_the_weights_come_whole_with_one_gather_per_bucket():
    from colomem.engines import lora
    from colomem.engines.deepspeed.gather import BucketedGather

    model = _model()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    zero = _Partitioned(model)
    groups = list(lora.param_groups(model))
    full = BucketedGather(groups, 3 * 1088, lambda p: zero.full[id(p)].numel() * 4, zero.gather)
    got = {}
    for name, t, _ in lora.named_weights(model, full=full, direct=False):
        got[name] = t.clone()
        assert zero.live                                   # read while its bucket is gathered
    full.close()
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    assert zero.gathers == full.gathers == 2 and not zero.live       # 6 modules in buckets of 3, all released


def test_parameters_asked_for_out_of_the_planned_order_are_a_typed_error():
    from colomem.engines import lora
    from colomem.engines.deepspeed.gather import BucketedGather
    from colomem.errors import ColomemError

    model = _model()
    zero = _Partitioned(model)
    groups = list(lora.param_groups(model))
    full = BucketedGather(groups[::-1], 1 << 20, lambda p: 4, zero.gather)
    with pytest.raises(ColomemError, match="out of the planned order"):
        list(lora.named_weights(model, full=full, direct=False))


# ------------------------------------------------------------------------ a TP group's ranks agree (gloo)
AGREE = textwrap.dedent(r'''
    import json, os, sys
    out, liar = sys.argv[1], int(sys.argv[2])
    rank, world, tp = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(sys.argv[3])
    from colomem.grpo.batch import Completion
    from colomem.runner.inrank import RolloutMismatchError, check_group_agrees, rollout_digest
    from colomem.runner.ranks import Ranks

    r = Ranks.from_env(tp=tp, barrier_timeout_s=60)
    gen = r.generate_groups(2 * world)
    # what an engine's shard would return: the same tokens on every rank of a group, the liar differs
    comps = [[Completion([g, r.rollout_group, k], None, "stop") for k in range(2)] for g in gen]
    if rank == liar:
        comps[0][0] = Completion([99], None, "length")
    res = {"gen": gen}
    try:
        check_group_agrees(r, rollout_digest(gen, comps), "step 0")
        res["error"] = None
    except RolloutMismatchError as e:
        res["error"] = str(e)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    r.close()
''')


@pytest.mark.parametrize("world,tp,liar", [(2, 2, -1), (2, 2, 1), (4, 2, 3), (4, 4, 0), (8, 2, 5), (8, 8, 2)])
def test_the_ranks_of_one_engine_must_have_generated_the_same(tmp_path, world, tp, liar):
    script = tmp_path / "agree.py"
    script.write_text(AGREE)
    port, procs = free_port(), []
    for rank in range(world):
        env = child_env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path), str(liar), str(tp)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank hung in the agreement check")
        assert p.returncode == 0, out[-3000:]
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r in range(world):
        same_group = liar >= 0 and r // tp == liar // tp
        if same_group:
            assert res[r]["error"] and f"rollout group {r // tp}" in res[r]["error"], res[r]
        else:
            assert res[r]["error"] is None, res[r]
        assert res[r]["gen"] == res[r // tp * tp]["gen"]       # a group's ranks were given the same prompts


def test_lora_layers_are_gathered_with_their_adapters_and_merged_the_same():
    from peft import LoraConfig, get_peft_model

    from colomem.engines import lora
    from colomem.engines.deepspeed.gather import BucketedGather

    model = get_peft_model(_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["0", "3"],
                                                init_lora_weights=False))
    want = {n: t.clone() for n, t, _ in lora.named_weights(model)}          # complete tensors: plain merge
    zero = _Partitioned(model)
    full = BucketedGather(list(lora.param_groups(model)), 2 * 1088, lambda p: zero.full[id(p)].numel() * 4,
                          zero.gather)
    got = {n: t.clone() for n, t, _ in lora.named_weights(model, full=full, direct=False)}
    full.close()
    assert got.keys() == want.keys() and all(torch.allclose(got[n], want[n], rtol=0, atol=0) for n in want)
    assert 1 < full.gathers < len(full.groups) and not zero.live
