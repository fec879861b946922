"""Several nodes on CPU: two torchrun agents on localhost (c10d rendezvous, one rank each, each with its own
output directory and model cache as two machines would have) run the whole CPU job and agree on every
step's reduced metrics; rank 0 writes the job's outputs, every rank its own timeline; a killed agent makes
the other fail (at a bounded barrier, or through its launcher when the rendezvous store went with the killed
node) instead of hanging. And the work split of Ranks for TP x DP layouts, checked without processes."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from child_env import child_env
from ports import free_port

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "runners" / "grpo_colocated.py"
TINY = ["--backend", "cpu", "--prompts-per-step", "4", "--micro-batch", "8", "--group-size", "4",
        "--no-progress", "--report-to", "none", "--no-plots"]
# metrics every rank computes from reduced (summed over the ranks) values or replicated state
REDUCED = ("reward_mean", "reward_std", "accuracy", "completion_len_mean", "truncated_frac", "groups_no_signal",
           "samples_total", "unscorable_frac", "reward/char_match", "train/grad_norm", "train/micro_batches",
           "train/optimizer_steps", "train/lr", "weight_version", "sync/nbytes", "sync/ntensors")


# ------------------------------------------------------------------------------------------ two nodes
def _caches(tmp_path):
    """One pre-built model cache per simulated node (no shared filesystem between them)."""
    from colomem.grpo.tasks import make_task
    from colomem.grpo.tiny_model import model_dir

    caches = [tmp_path / f"node{n}" / "cache" for n in range(2)]
    for c in caches:
        model_dir("tiny", make_task("successor").alphabet, cache_dir=c / "models", log=lambda *_: None)
    return caches


def _agents(tmp_path, args):
    """Two torchrun agents, one per simulated node, each in a process group of its own. Node 0 hosts the
    rendezvous store (on one machine both would match the endpoint's host and the first to bind would host
    it), so which node takes the store down with it when killed is known."""
    port, procs = free_port(), []
    for n, cache in enumerate(_caches(tmp_path)):
        env = child_env(drop=("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"),
                        COLOMEM_CACHE=str(cache), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "multinode-test",
               "--rdzv-conf", f"is_host={int(n == 0)}",
               "--node-rank", str(n), "--max-restarts", "0", str(RUNNER), *TINY, *args,
               "--out", str(tmp_path / f"node{n}" / "out")]
        log = open(tmp_path / f"node{n}" / "log", "w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT),
                                      start_new_session=True))
        log.close()
    return procs


def _log(tmp_path, n):
    return (tmp_path / f"node{n}" / "log").read_text(errors="replace")


def _wait(p, timeout, what):
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_agent(p)
        pytest.fail(f"{what} still running after {timeout} s")


def _children(pid):
    """Processes whose parent is pid (torchrun starts its workers in sessions of their own)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _kill_agent(p):
    """SIGKILL an agent's process group and its workers (as a node that loses power), by their ids."""
    workers = _children(p.pid) if p.poll() is None else []
    for pgid in [p.pid, *workers]:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    p.wait(timeout=30)


def _rank_dirs(tmp_path):
    """{rank: the node output directory holding its per-rank file} (c10d picks which node gets rank 0)."""
    found = {}
    for n in range(2):
        for f in (tmp_path / f"node{n}" / "out" / "ranks").glob("rank*.jsonl"):
            found[int(f.stem[4:])] = n
    return found


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_two_nodes_agree_on_every_step_and_rank0_writes_the_job_outputs(tmp_path):
    procs = _agents(tmp_path, ["--steps", "3", "--save-every", "3", "--barrier-timeout-s", "60"])
    try:
        for n, p in enumerate(procs):
            assert _wait(p, 240, f"agent {n}") == 0, _log(tmp_path, n)[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_agent(p)
    where = _rank_dirs(tmp_path)
    assert sorted(where) == [0, 1] and where[0] != where[1]          # one rank per node
    out = {r: tmp_path / f"node{n}" / "out" for r, n in where.items()}
    # every rank writes its own timeline, into its node's directory, and only that one
    for r in (0, 1):
        assert sorted(p.name for p in (out[r] / "ranks").iterdir()) == [f"rank{r}.jsonl"]
    recs = {r: _lines(out[r] / "ranks" / f"rank{r}.jsonl") for r in (0, 1)}
    for r in (0, 1):
        assert [x["step"] for x in recs[r]] == [0, 1, 2] and {x["rank"] for x in recs[r]} == {r}
        assert all("barrier_wake" in x["phase_s"] for x in recs[r])
    # the reduced metrics are the same on both ranks, step by step
    for a, b in zip(recs[0], recs[1]):
        assert {k: a.get(k) for k in REDUCED} == {k: b.get(k) for k in REDUCED}
        assert "reward_mean" in a and "train/loss" in a
    # rank 0 writes the job's outputs; the other node's directory holds nothing else
    assert sorted(p.name for p in out[1].iterdir()) == ["ranks"]
    metrics = _lines(out[0] / "metrics.jsonl")
    steps = [x for x in metrics if "phase_s" in x]
    assert [x["rank"] for x in steps] == [0, 0, 0]
    assert [x["reward_mean"] for x in steps] == [x["reward_mean"] for x in recs[1]]
    summary = json.loads((out[0] / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["world_size"] == 2 and summary["steps_done"] == 3
    assert sorted(p.name for p in (out[0] / "checkpoints").iterdir()) == ["step-3"]
    state = json.loads((out[0] / "checkpoints" / "step-3" / "state.json").read_text())
    assert state["world_size"] == 2 and state["step"] == 3
    # only rank 0 prints the step lines and the summary
    log0, log1 = _log(tmp_path, where[0]), _log(tmp_path, where[1])
    assert "[colomem] ok: 3 steps" in log0 and "[colomem] ok:" not in log1


@pytest.mark.parametrize("killed", [1, 0])
def test_a_killed_agent_makes_the_other_fail_instead_of_hanging(tmp_path, killed):
    """`killed` is the node whose agent dies; node 0 holds the rendezvous store. With node 1 gone the
    survivor's rank fails at a bounded barrier and says which rank it is and that a peer is stuck or died.
    With node 0 gone the store goes too: the survivor's launcher loses the rendezvous and stops its worker
    (torchrun's own error), or the worker's barrier fails first; either way the survivor stops, non-zero."""
    procs = _agents(tmp_path, ["--steps", "500", "--barrier-timeout-s", "20"])
    try:
        deadline = time.monotonic() + 180          # both ranks finished a step: the job is under way
        while len(_rank_dirs(tmp_path)) < 2 or any(
                not (tmp_path / f"node{n}" / "out" / "ranks" / f"rank{r}.jsonl").read_text().strip()
                for r, n in _rank_dirs(tmp_path).items()):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                pytest.fail("the two-node job did not get going:\n" + _log(tmp_path, 0)[-3000:] +
                            _log(tmp_path, 1)[-3000:])
            time.sleep(0.2)
        survivor = 1 - killed
        rank = {n: r for r, n in _rank_dirs(tmp_path).items()}[survivor]
        _kill_agent(procs[killed])
        rc = _wait(procs[survivor], 150, "the surviving agent")      # barrier timeout 20 s, plus teardown
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_agent(p)
    log = _log(tmp_path, survivor)
    assert rc != 0, log[-4000:]
    barrier = "BarrierTimeoutError" in log and f"rank {rank}:" in log and "stuck or died" in log
    if killed == 1:
        assert barrier, log[-4000:]
    else:
        assert barrier or "RendezvousConnectionError" in log, log[-4000:]
    summary_path = tmp_path / f"node{survivor}" / "out" / "summary.json"
    if rank == 0 and (killed == 1 or summary_path.exists()):      # rank 0's summary records the failure
        summary = json.loads(summary_path.read_text())
        # its launcher may stop it first, having seen the peer node go (a slow machine: the barrier's 20 s
        # outlast the launcher's notice); the step the signal kept from finishing then names the barrier
        assert summary["status"] in ("error", "interrupted") and summary["steps_done"] < 500, summary
        if killed == 1:
            assert "BarrierTimeoutError" in summary["error"], summary


# ------------------------------------------------------------------------------------------ work split
LAYOUTS = [(w, tp) for w in range(2, 17) for tp in (1, 2, 4, 8) if w % tp == 0]


def _ranks(world, tp, per_node=None):
    from colomem.runner.ranks import Ranks

    per = per_node or world
    return [Ranks(r, world, r % per, tp, local_world_size=per_node) for r in range(world)]


@pytest.mark.parametrize("world,tp", LAYOUTS)
def test_every_prompt_group_is_generated_once_and_trained_once(world, tp):
    ranks = _ranks(world, tp)
    for n_groups in (world, 3 * world):
        # each group is generated by exactly one rollout group
        gen_by = {}
        for r in ranks:
            for i in r.generate_groups(n_groups):
                gen_by.setdefault(i, set()).add(r.rollout_group)
        assert sorted(gen_by) == list(range(n_groups)) and all(len(g) == 1 for g in gen_by.values())
        # every rank of a TP group generates the same groups (its engine's), a superset of what it trains on
        for r in ranks:
            assert all(ranks[o].generate_groups(n_groups) == r.generate_groups(n_groups) for o in r.group_ranks)
            assert set(r.train_groups(n_groups)) <= set(r.generate_groups(n_groups))
        # each group is trained on by exactly one rank, every rank on as many
        trained = sorted(i for r in ranks for i in r.train_groups(n_groups))
        assert trained == list(range(n_groups))
        assert {len(r.train_groups(n_groups)) for r in ranks} == {n_groups // world}
    # the rollout groups: world / tp of them, tp consecutive ranks each, every rank in its own group
    assert {r.rollout_group for r in ranks} == set(range(world // tp))
    for r in ranks:
        assert len(r.group_ranks) == tp and r.rank in r.group_ranks
        assert r.group_ranks == list(range(r.group_ranks[0], r.group_ranks[0] + tp))
        assert all(ranks[o].rollout_group == r.rollout_group for o in r.group_ranks)


@pytest.mark.parametrize("world,tp", LAYOUTS)
def test_a_tp_group_never_spans_nodes(world, tp):
    for per_node in [p for p in range(tp, world + 1, tp) if world % p == 0]:
        ranks = _ranks(world, tp, per_node)
        for r in ranks:
            assert r.node == r.rank // per_node
            assert {ranks[o].node for o in r.group_ranks} == {r.node}
            assert [ranks[o].local_rank for o in r.group_ranks] == \
                list(range(r.local_rank - r.rank % tp, r.local_rank - r.rank % tp + tp))


@pytest.mark.parametrize("world,tp", [(6, 4), (3, 2), (12, 8), (2, 4), (10, 4)])
def test_a_tp_that_does_not_divide_the_ranks_is_refused(world, tp):
    from colomem.errors import InvalidArgumentError
    from colomem.runner.ranks import Ranks

    with pytest.raises(InvalidArgumentError, match=f"tensor_parallel_size={tp} must divide the number of ranks"):
        Ranks(0, world, 0, tp)


@pytest.mark.parametrize("world,tp,per_node", [(8, 4, 2), (16, 8, 4), (4, 4, 1), (12, 4, 6), (16, 8, 2)])
def test_a_tp_larger_than_a_node_or_not_dividing_it_is_refused(world, tp, per_node):
    from colomem.errors import InvalidArgumentError
    from colomem.runner.ranks import Ranks

    with pytest.raises(InvalidArgumentError, match=f"does not fit the {per_node} ranks per node") as e:
        Ranks(0, world, 0, tp, local_world_size=per_node)
    assert "--nproc-per-node" in str(e.value) and "--tensor-parallel-size" in str(e.value)


@pytest.mark.parametrize("env,match", [
    ({"WORLD_SIZE": "8", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, "does not fit the 2 ranks"),
    ({"WORLD_SIZE": "8", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3"}, "does not divide WORLD_SIZE"),
    ({"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "4", "LOCAL_WORLD_SIZE": "4"}, "LOCAL_RANK=4"),
    ({"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}, "numbered consecutively"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 but WORLD_SIZE=2"),
    ({"WORLD_SIZE": "6", "RANK": "0"}, "must divide the number of ranks"),
])
def test_from_env_refuses_a_layout_before_starting_anything(monkeypatch, env, match):
    from colomem.errors import InvalidArgumentError
    from colomem.runner.ranks import Ranks

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(InvalidArgumentError, match=match):
        Ranks.from_env(tp=4)


def test_torchrun_layout_of_two_nodes_is_accepted():
    from colomem.runner.ranks import Ranks

    # node 1 of 2, 4 GPUs each, TP 2: rank 6 is GPU 2 of node 1, in the engine of ranks 6 and 7
    r = Ranks(6, 8, 2, 2, local_world_size=4)
    assert (r.node, r.rollout_group, r.group_ranks, r.is_main) == (1, 3, [6, 7], False)
    one = Ranks(0, 1, 0, 1, local_world_size=1)                       # a single process
    assert one.generate_groups(3) == one.train_groups(3) == [0, 1, 2]


def test_a_peer_failure_inside_torch_distributed_is_named_as_one():
    from colomem.runner.ranks import BarrierTimeoutError, Ranks

    fake = {}
    exec(compile("def all_reduce():\n    raise RuntimeError('Connection closed by peer [127.0.0.1]:1')\n",
                 os.path.join("site-packages", "torch", "distributed", "distributed_c10d.py"), "exec"), fake)

    def raised(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            return e

    gloo = raised(fake["all_reduce"])
    e = Ranks(1, 2, 1, 1).peer_failure(gloo, "train")
    assert isinstance(e, BarrierTimeoutError) and e.__cause__ is gloo
    assert str(e).startswith("rank 1: a collective with the other ranks failed during train (Connection closed")
    assert "stuck or died" in str(e)
    assert Ranks().peer_failure(gloo) is None                                  # one rank: nothing to blame
    class DistBackendError(RuntimeError):                                      # what NCCL failures raise
        pass
    fake["DistBackendError"] = DistBackendError
    exec(compile("def barrier():\n    raise DistBackendError('NCCL communicator was aborted')\n",
                 os.path.join("site-packages", "torch", "distributed", "distributed_c10d.py"), "exec"), fake)
    nccl = raised(fake["barrier"])
    assert "rank 0: a collective with the other ranks failed (NCCL" in str(Ranks(0, 2, 0, 1).peer_failure(nccl))
    def ours():
        raise RuntimeError("a bug of this rank")
    assert Ranks(1, 2, 1, 1).peer_failure(raised(ours)) is None                # not from torch.distributed
    assert Ranks(1, 2, 1, 1).peer_failure(ValueError("x")) is None


def test_a_node_whose_cache_lacks_the_model_says_what_to_do(tmp_path, monkeypatch):
    # with torch.distributed started, a rank other than 0 that builds the config-built model (its node does
    # not share rank 0's cache) gets a directory without config or weights: refused, not loaded
    import colomem.grpo.tiny_model as tiny
    from colomem.errors import ConfigError
    from colomem.runner.config import config_from_dict
    from colomem.runner.job import _model_path
    from colomem.runner.ranks import Ranks

    hollow = tmp_path / "models" / "tiny-x"
    hollow.mkdir(parents=True)
    (hollow / "done").write_text("ok\n")
    (hollow / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(tiny, "model_dir", lambda *a, **k: hollow)
    r = Ranks(1, 2, 0, 1, local_world_size=1)
    monkeypatch.setattr(r, "barrier", lambda *a, **k: None)
    with pytest.raises(ConfigError, match="rank 1: the config-built model .* has no config.json") as e:
        _model_path(config_from_dict({"backend": "cpu"}), "0123456789>", r, lambda *_: None)
    assert "COLOMEM_CACHE" in str(e.value) and str(hollow) in str(e.value)
    (hollow / "config.json").write_text("{}")                   # a complete cache entry is used as it is
    assert _model_path(config_from_dict({"backend": "cpu"}), "0123456789>", r, lambda *_: None) == str(hollow)
