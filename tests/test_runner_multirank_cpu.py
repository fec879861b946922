"""Two ranks on CPU (torchrun-style environment, gloo): barriers, the work split, the whole loop with its
checkpoint, and a stalled rank that makes the other fail with a clear timeout instead of hanging."""
import json
import subprocess
import sys
import textwrap

import pytest

from child_env import child_env
from ports import free_port


WORKER = textwrap.dedent(r'''
    import json, os, sys, time
    mode, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    from colomem.runner.ranks import BarrierTimeoutError, Ranks

    def dump(obj):
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(obj, f)

    def gloo_threads():
        # the threads gloo runs for a group (named gloo_tcp_loop, pt_gloo_runloop)
        names = [open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task")]
        return sum("gloo" in n for n in names)

    if mode == "barrier":
        r = Ranks.from_env(barrier_timeout_s=60)
        r.barrier("one")
        r.barrier("two")
        res = {"world": r.world_size, "gen": r.generate_groups(6), "train": r.train_groups(6),
               "sum": r.sum([rank, 1.0]), "main": r.is_main, "gloo_up": gloo_threads()}
        r.close()
        res["gloo_left"] = gloo_threads()
        dump(res)
    elif mode == "leave":
        # rank 1 is slow to tear its group down: rank 0, which hosts the store, must not leave before it
        import torch.distributed as dist
        r = Ranks.from_env(barrier_timeout_s=60)
        real = dist.destroy_process_group

        def slow_destroy(*a, **kw):
            if rank == 1:
                time.sleep(1.5)
            real(*a, **kw)
            dump({"destroyed": time.time()})
        dist.destroy_process_group = slow_destroy
        r.close()
        with open(os.path.join(out, f"rank{rank}.left"), "w") as f:
            f.write(repr(time.time()))
    elif mode == "bridges":
        # tensor parallel 2 over both ranks: each rank's bridge (a fake GPU UUID and socket path) must reach
        # the engine's worker on that GPU
        r = Ranks.from_env(tp=2, barrier_timeout_s=60)
        addrs = r.bridge_addresses(f"GPU-fake-{rank}", f"/run/colomem/bridge-{rank}.sock")
        try:
            r.bridge_addresses("GPU-same", "/x")    # two ranks on one GPU
            same = None
        except Exception as e:
            same = type(e).__name__
        dump({"addrs": addrs, "group": r.group_ranks, "same": same})
        r.close()
    elif mode.startswith("stall"):
        staller = int(mode[-1])
        r = Ranks.from_env(barrier_timeout_s=3)
        r.barrier("warm-up")                     # both ranks are up
        if rank == staller:
            time.sleep(120)                      # stuck (the test kills it)
        try:
            r.barrier("before wake, step 0")
            dump({"error": None})
        except BarrierTimeoutError as e:
            dump({"error": str(e), "type": type(e).__name__, "timeout": isinstance(e, TimeoutError)})
            sys.exit(3)
    elif mode == "stop":
        # a SIGTERM that reaches rank 1 only, during its first training step
        import signal
        from colomem.runner.config import config_from_dict
        from colomem.runner import run_job
        from colomem.runner.backends import build_engines

        def factory(cfg, backend, model_path, tok, ranks, grad_accum):
            eng = build_engines(cfg, backend, model_path, tok, ranks, grad_accum=grad_accum)
            train_step = eng.trainer.train_step

            def train_step_then_signal(*a, **kw):
                out = train_step(*a, **kw)
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGTERM)
                return out
            eng.trainer.train_step = train_step_then_signal
            return eng
        cfg = config_from_dict({"backend": "cpu", "steps": 4, "prompts_per_step": 4, "micro_batch": 8,
                                "progress": False, "plots": False, "out": os.path.join(out, "job"),
                                "barrier_timeout_s": 60, "grpo": {"group_size": 4}})
        res = run_job(cfg, engines_factory=factory, print_fn=print)
        dump({"status": res.summary["status"], "error": res.summary.get("error"), "steps": len(res.records)})
    elif mode == "defaultout":
        # no --out: each rank's clock would name its own folder (a second apart here); rank 0's is taken
        from colomem.runner import job
        from colomem.runner.config import config_from_dict
        os.chdir(out)
        job.default_out_dir = lambda: job.Path("runs") / f"started-on-rank{rank}"
        cfg = config_from_dict({"backend": "cpu", "steps": 1, "prompts_per_step": 4, "micro_batch": 8,
                                "progress": False, "plots": False, "report_to": ["none"],
                                "barrier_timeout_s": 60, "grpo": {"group_size": 4}})
        res = job.run_job(cfg, print_fn=print)
        dump({"out": str(res.out_dir), "final_model": res.summary.get("final_model")})
    elif mode == "run":
        import torch
        from colomem.runner.config import config_from_dict
        from colomem.runner import run_job
        from colomem.runner.backends import build_engines
        seen = {}

        def factory(cfg, backend, model_path, tok, ranks, grad_accum):
            eng = build_engines(cfg, backend, model_path, tok, ranks, grad_accum=grad_accum)
            close = eng.trainer.close

            def close_and_record():
                w = {n: float(t.double().sum()) for n, t in eng.trainer.named_weights()}
                seen["weights"] = w
                close()
            eng.trainer.close = close_and_record
            return eng
        cfg = config_from_dict({"backend": "cpu", "steps": 2, "prompts_per_step": 4, "micro_batch": 8,
                                "progress": False, "plots": False, "out": os.path.join(out, "job"),
                                "barrier_timeout_s": 60, "grpo": {"group_size": 4}, "save_every": 2,
                                "eval_every": 1, "eval_prompts": 5})
        res = run_job(cfg, engines_factory=factory, print_fn=print)
        dump({"status": res.summary["status"], "weights": seen["weights"], "gloo_left": gloo_threads(),
              "rewards": [r.metrics["reward_mean"] for r in res.records],
              "train_rows": [r.metrics["train/micro_batches"] for r in res.records],
              "eval": [res.summary["eval_first"], res.summary["eval_last"]]})
''')


def _launch(tmp_path, mode, cache=None):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    procs = []
    for rank in range(2):
        env = child_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
        if cache:
            env["COLOMEM_CACHE"] = str(cache)
        procs.append(subprocess.Popen([sys.executable, str(script), mode, str(tmp_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def _finish(p, timeout):
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        pytest.fail(f"rank process hung past {timeout} s:\n{out[-3000:]}")
    return p.returncode, out


def _result(tmp_path, rank):
    return json.loads((tmp_path / f"rank{rank}.json").read_text())


def test_barriers_and_work_split(tmp_path):
    procs = _launch(tmp_path, "barrier")
    for p in procs:
        rc, out = _finish(p, 120)
        assert rc == 0, out[-3000:]
    r0, r1 = _result(tmp_path, 0), _result(tmp_path, 1)
    assert r0["world"] == r1["world"] == 2 and r0["main"] and not r1["main"]
    # the group's threads ran while it was up and are gone once close returns (a rank tells rank 0 it has
    # left only then: threads torn down later, at interpreter exit, could abort once rank 0 is gone)
    assert r0["gloo_up"] > 0 and r1["gloo_up"] > 0
    assert r0["gloo_left"] == r1["gloo_left"] == 0
    assert r0["sum"] == r1["sum"] == [1.0, 2.0]
    # tensor parallel 1: each rank generates exactly the groups it trains on; together they cover all
    assert r0["gen"] == r0["train"] == [0, 2, 4] and r1["gen"] == r1["train"] == [1, 3, 5]


def test_rank_0_leaves_only_after_every_rank_tore_its_group_down(tmp_path):
    procs = _launch(tmp_path, "leave")
    for p in procs:
        rc, out = _finish(p, 120)
        assert rc == 0, out[-3000:]
    left0 = float((tmp_path / "rank0.left").read_text())
    assert left0 >= _result(tmp_path, 1)["destroyed"]


def test_tensor_parallel_group_collects_one_bridge_per_gpu(tmp_path):
    procs = _launch(tmp_path, "bridges")
    for p in procs:
        rc, out = _finish(p, 120)
        assert rc == 0, out[-3000:]
    want = {"GPU-fake-0": "/run/colomem/bridge-0.sock", "GPU-fake-1": "/run/colomem/bridge-1.sock"}
    for rank in (0, 1):
        r = _result(tmp_path, rank)
        assert r["addrs"] == want and r["group"] == [0, 1] and r["same"] == "InvalidArgumentError"


@pytest.mark.parametrize("staller", [1, 0])
def test_a_stalled_rank_makes_the_other_fail_with_a_timeout(tmp_path, staller):
    procs = _launch(tmp_path, f"stall{staller}")
    waiter = procs[1 - staller]
    try:
        rc, out = _finish(waiter, 120)          # bounded: it must give up by itself
    finally:
        procs[staller].kill()                    # the stuck rank (ours) is ended here
        procs[staller].communicate()
    assert rc == 3, out[-3000:]
    res = _result(tmp_path, 1 - staller)
    assert res["type"] == "BarrierTimeoutError" and res["timeout"]
    assert "before wake, step 0" in res["error"] and "within 3 s" in res["error"]
    assert "stuck or died" in res["error"]


def _run_both(tmp_path, mode):
    """Both ranks of a `mode` job on the tiny model (built first, in a cache of their own); both must exit 0."""
    from colomem.grpo.tasks import make_task
    from colomem.grpo.tiny_model import model_dir

    cache = tmp_path / "cache"
    model_dir("tiny", make_task("successor").alphabet, cache_dir=cache / "models", log=lambda *_: None)
    procs = _launch(tmp_path, mode, cache)
    outs = [_finish(p, 300) for p in procs]
    for rc, out in outs:
        assert rc == 0, out[-4000:]
    return outs, _result(tmp_path, 0), _result(tmp_path, 1)


def test_two_rank_loop_keeps_ranks_in_step(tmp_path):
    outs, r0, r1 = _run_both(tmp_path, "run")
    assert r0["status"] == r1["status"] == "ok"
    # the job tore its groups down: none of gloo's threads is left to be torn down at interpreter exit
    assert r0["gloo_left"] == r1["gloo_left"] == 0
    # gradients are averaged over the ranks: both trainers hold the same weights after every step
    assert r0["weights"] == r1["weights"]
    # the printed reward is the global one, the same on both ranks
    assert r0["rewards"] == r1["rewards"]
    # the evaluation: 5 prompts split over the two engines (3 + 2), its sums reduced: the same on both ranks
    def timeless(evs):
        return [{k: v for k, v in e.items() if k not in ("eval/seconds", "cycle_s")} for e in evs]
    assert timeless(r0["eval"]) == timeless(r1["eval"]) and [e["step"] for e in r0["eval"]] == [0, 2]
    assert all(e["eval/n"] == 5 for e in r0["eval"])
    assert "step   2/2" in outs[0][1] and "step   2/2" not in outs[1][1]       # only rank 0 prints
    job = tmp_path / "job"
    lines = [json.loads(x) for x in (job / "metrics.jsonl").read_text().splitlines()]
    assert [x.get("rank") for x in lines if "phase_s" in x] == [0, 0]          # rank 0 writes the metrics
    assert [x["step"] for x in lines if x.get("event") == "eval"] == [0, 1, 2]
    for rank in (0, 1):                                                       # every rank its timeline
        recs = [json.loads(x) for x in (job / "ranks" / f"rank{rank}.jsonl").read_text().splitlines()]
        assert [x["rank"] for x in recs] == [rank, rank] and "barrier_wake" in recs[0]["phase_s"]
    # the checkpoint: every rank passed its barriers, rank 0 wrote the (replicated) state and renamed it
    assert sorted(p.name for p in (job / "checkpoints").iterdir()) == ["step-2"]
    state = json.loads((job / "checkpoints" / "step-2" / "state.json").read_text())
    assert state["world_size"] == 2 and state["step"] == 2 and state["trainer"] == "torch"
    assert (job / "checkpoints" / "step-2" / "trainer.pt").is_file()


def test_ranks_without_an_out_folder_share_rank_0s_and_its_trained_model(tmp_path):
    _, r0, r1 = _run_both(tmp_path, "defaultout")
    assert r0["out"] == r1["out"] == "runs/started-on-rank0"
    assert r0["final_model"] == "runs/started-on-rank0/model" and r1["final_model"] is None   # rank 0 writes it
    assert (tmp_path / "runs" / "started-on-rank0" / "model" / "config.json").is_file()
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["started-on-rank0"]


def test_a_signal_that_reaches_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    _, r0, r1 = _run_both(tmp_path, "stop")
    assert r0["status"] == r1["status"] == "interrupted"
    assert r0["steps"] == r1["steps"] == 1                   # both stopped after the step the signal came in
    assert r1["error"] == "interrupted (SIGTERM) after step 1", r1
    assert r0["error"] == "interrupted (a stop signal on another rank) after step 1", r0
    # the stop's checkpoint: every rank took part (one rank alone would wait at its barrier)
    assert sorted(p.name for p in (tmp_path / "job" / "checkpoints").iterdir()) == ["step-1"]
