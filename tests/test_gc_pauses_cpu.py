"""colomem.runner.gc_pauses: the collector's pauses summed by a gc.callbacks hook, per step and per phase in
the runner's metrics, the hook gone after the run."""
import gc
import json

from colomem.runner import train
from colomem.runner.gc_pauses import PAUSES, GcPauses
from test_dataset_job import TEMPLATE, successor_rows


def test_a_full_collection_is_counted_once_and_take_starts_over():
    p = GcPauses()
    assert p.take() == {}                          # not installed: nothing to say
    p.install()
    p.install()                                    # nested: one hook
    try:
        assert gc.callbacks.count(p._hook) == 1
        p.take()
        gc.collect()
        got = p.take()
        assert got["host/gc_full"] >= 1 and got["host/gc_s"] > 0 and 0 < got["host/gc_max_s"] <= got["host/gc_s"]
        assert p.total >= got["host/gc_s"]
        assert p.take() == {"host/gc_s": 0.0, "host/gc_max_s": 0.0, "host/gc_full": 0}
    finally:
        p.remove()
        assert p.installed and p._hook in gc.callbacks
        p.remove()
    assert not p.installed and p._hook not in gc.callbacks
    p.remove()                                     # one remove too many changes nothing


def test_the_runner_records_the_pauses_of_each_step_and_of_the_phase_they_fell_in(job_env, tmp_path):
    def collecting(prompt, completion, *, answer, **meta):
        gc.collect()                               # a reward that makes the collector run while scoring
        return 1.0 if completion.strip() == answer else 0.0

    tpl = tmp_path / "chat.jinja"
    tpl.write_text(TEMPLATE)
    res = train(reward_funcs=[collecting], train_dataset=successor_rows(16), backend="cpu", steps=2,
                prompts_per_step=2, micro_batch=4, group_size=2, max_new_tokens=2, chat_template=str(tpl),
                progress=False,
                report_to=["none"], out=str(tmp_path / "run"), print_fn=lambda *_: None)
    assert res.summary["status"] == "ok"
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "phase_s" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["host/gc_full"] >= 4                            # one a completion scored, at least
        assert r["gc/score_s"] > 0 and r["host/gc_s"] >= r["gc/score_s"] - 1e-9
        assert set(k[3:-2] for k in r if k.startswith("gc/")) <= set(r["phase_s"])
    assert not PAUSES.installed and PAUSES._hook not in gc.callbacks
