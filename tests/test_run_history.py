"""What the runner keeps of its steps: the summary's figures from compact per-step columns, the same as from the
whole records; a bounded, small cost per step in host memory; the whole records read back from the metrics
file, this run's only."""
import math
import random
import statistics
import tracemalloc

from colomem.runner.history import StepHistory, read_step_records
from colomem.runner.phases import SWITCH_PHASES
from colomem.runner.plots import every_kth
from colomem.runner.timeline import MetricsWriter, StepRecord


def _record(k: int, rng: random.Random, *, gpu: bool = True) -> StepRecord:
    phases = {p: rng.uniform(0.001, 0.2) for p in ("offload", "wake_weights", "sync", "rollout", "sleep",
                                                   "reload", "train")}
    if k % 3 == 0:
        phases["checkpoint"] = rng.uniform(0.1, 1.0)       # a phase some steps have and others not
    memory = {}
    for p in phases:
        memory[p] = {"allocated": rng.randrange(1 << 30) if gpu else None,
                     "reserved": rng.randrange(1 << 30) if gpu else None,
                     "driver_used": rng.randrange(1 << 34) if gpu else None, "pinned_host": 1 << 28}
    rec = StepRecord(step=k, phase_s=phases, memory=memory, step_s=sum(phases.values()) + rng.uniform(0, 0.1))
    rec.metrics = {"reward_mean": rng.random(), "reward_std": rng.random(),
                   "samples": [{"prompt": "x" * 200, "completion": "y" * 200}]}
    if k % 2:
        rec.metrics["accuracy"] = rng.random()
    return rec


def _reference(recs: list[StepRecord]) -> dict:
    """The summary as computed from whole records (what the runner did before it kept numbers only)."""
    warm = recs[1:] if len(recs) > 1 else recs
    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None
    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None
    rewards = [r.metrics.get("reward_mean") for r in recs]
    acc = [r.metrics.get("accuracy") for r in recs]
    phases = sorted({p for r in warm for p in r.phase_s})
    return {"steps_done": len(recs), "reward_first5_mean": mean(rewards[:5]), "reward_last5_mean": mean(rewards[-5:]),
            "accuracy_first5_mean": mean(acc[:5]), "accuracy_last5_mean": mean(acc[-5:]),
            "step_s_median": med([r.step_s for r in warm]), "switch_s_median": med([r.switch_s for r in warm]),
            "switch_overhead_fraction": med([r.switch_s / r.step_s for r in warm if r.step_s]),
            "phase_s_median": {p: med([r.phase_s.get(p) for r in warm]) for p in phases},
            "gpu_used_after_sleep_max": max([r.memory.get("sleep", {}).get("driver_used") for r in recs
                                             if r.memory.get("sleep", {}).get("driver_used") is not None],
                                            default=None),
            "gpu_used_max": max([v.get("driver_used") or 0 for r in recs for v in r.memory.values()],
                                default=None) or None,
            "trainer_reserved_after_offload_max": max([r.memory.get("offload", {}).get("reserved") for r in recs
                                                       if r.memory.get("offload", {}).get("reserved") is not None],
                                                      default=None),
            "pinned_host_max": max([v.get("pinned_host") or 0 for r in recs for v in r.memory.values()],
                                   default=None) or None}


def _close(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=0)


def test_the_summary_from_columns_equals_the_one_from_whole_records():
    for gpu in (True, False):
        for n in (1, 2, 7, 40):
            rng = random.Random(n)
            recs = [_record(k, rng, gpu=gpu) for k in range(n)]
            h = StepHistory()
            for r in recs:
                h.add(r)
            got, want = h.summary(), _reference(recs)
            assert got.keys() == want.keys()
            for k in want:
                assert _close(got[k], want[k]), (gpu, n, k, got[k], want[k])


def test_tables_and_plot_rows_come_from_the_columns():
    rng = random.Random(0)
    recs = [_record(k, rng) for k in range(6)]
    h = StepHistory()
    for r in recs:
        h.add(r)
    table = h.phase_table()
    assert "| checkpoint |" in table and "| train |" in table and "**step**" in table
    want_train = statistics.median([r.phase_s["train"] for r in recs[1:]])
    assert f"| train | {want_train:.4f} |" in table
    assert "GPU driver-used" in h.memory_table() and "| sleep |" in h.memory_table()
    rows = list(h.plot_rows())
    assert [r["step"] for r in rows] == list(range(6))
    for row, rec in zip(rows, recs):
        assert row["phase_s"] == rec.phase_s                      # a step without a phase has none here either
        assert math.isclose(row["switch_fraction"],
                            sum(rec.phase_s.get(p, 0.0) for p in SWITCH_PHASES) / rec.step_s)
        assert row["reward_mean"] == rec.metrics["reward_mean"] and row["accuracy"] == rec.metrics.get("accuracy")
    empty = StepHistory()
    assert empty.phase_table() == "" and empty.memory_table() == "" and empty.summary()["steps_done"] == 0


def test_a_step_costs_the_history_well_under_a_kilobyte():
    """A whole record with its memory snapshots and samples is ~15 KB; the columns keep ~half a KB of it."""
    rng = random.Random(1)
    h = StepHistory()
    for k in range(50):                                    # every column exists before measuring
        h.add(_record(k, rng))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    steps = 20_000
    for k in range(50, 50 + steps):
        h.add(_record(k, rng))                             # each record is dropped after add, as in the loop
    kept = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert h.count == steps + 50
    assert kept / steps < 1024, kept / steps


def test_the_records_read_back_are_this_runs_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rng = random.Random(2)
    first = MetricsWriter(path, fsync=False)
    first.write({"event": "start", "time": 0})
    for k in range(3):
        first.write(_record(k, rng).to_json())
    first.close()
    with open(path, "a") as f:
        f.write('{"step": 3, "phase_s": {"offl')               # killed mid-line
    again = MetricsWriter(path, fsync=False)                    # a resumed run appends after the torn line
    again.write({"event": "start", "time": 1})
    mine = [_record(k, rng) for k in range(3, 6)]
    for r in mine:
        again.write(r.to_json())
    failed = _record(6, rng)
    failed.metrics.update(failed="train", error="boom")
    again.write(failed.to_json())
    again.write({"event": "eval", "step": 6, "eval/n": 4})
    again.close()
    back = read_step_records(path, again.start)
    assert [r.step for r in back] == [3, 4, 5]
    for got, want in zip(back, mine):
        assert got.phase_s == want.phase_s and got.memory == want.memory and got.step_s == want.step_s
        assert got.metrics == want.metrics and got.switch_s == want.switch_s
    assert [r.step for r in read_step_records(path)] == [0, 1, 2, 3, 4, 5]
    assert read_step_records(tmp_path / "none.jsonl") == []


def test_a_long_timeline_shows_one_step_in_k():
    rows = list(range(1000))
    picked, k = every_kth(rows)
    assert k == 13 and picked[0] == 0 and picked[-1] == 999 and len(picked) <= 80 + 1
    assert every_kth(list(range(80))) == (list(range(80)), 1)
    assert every_kth([]) == ([], 1)
