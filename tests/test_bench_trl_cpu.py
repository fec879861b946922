"""The TRL baseline's harness (benchmarks/bench_trl.py) on the CPU: TRL's GRPOTrainer on the runner's tiny
job (its model, prompts and rewards), without vLLM; and how bench_grpo runs it as one more mode."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from bench_module import load_benchmark
from child_env import child_env

REPO = Path(__file__).resolve().parents[1]


_load = load_benchmark


@pytest.fixture(scope="module")
def trl_run(tmp_path_factory):
    """Two steps of the default job's shape (fewer prompts, to stay quick; checkpointing every other layer; the
    decoder layers' parts compiled), in a fresh process."""
    pytest.importorskip("trl")
    out = tmp_path_factory.mktemp("trl-cpu")
    env = child_env(drop=("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"),
                    COLOMEM_CACHE=str(tmp_path_factory.getbasetemp() / "colomem-cache-jobs"), CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_trl.py"), "--config", str(REPO / "configs/default.yaml"),
           "--no-vllm", "--steps", "2", "--prompts-per-step", "4", "--micro-batch", "16", "--no-progress",
           "--gradient-checkpointing", "true", "--checkpoint-every", "2", "--torch-compile", "--out", str(out)]
    p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, summary, [r for r in steps if "phase_s" in r]


def test_trl_runs_the_runner_job_and_writes_its_summary(trl_run):
    out, summary, steps = trl_run
    assert summary["status"] == "ok" and summary["backend"] == "cpu"
    assert summary["steps_done"] == 2 and len(steps) == 2
    assert Path(summary["model"]).name.startswith("tiny-")          # the runner's config-built, cached model
    assert summary["trl"]["use_vllm"] is False and summary["trl"]["optimizer_steps_per_step"] == 1
    assert summary["trl"]["grpo_config"]["steps_per_generation"] == 2        # 32 rows in micro-batches of 16
    # --checkpoint-every 2 holds on TRL's model too, through every time its trainer turns checkpointing on
    assert summary["config"]["checkpoint_every"] == 2 and summary["trl"]["checkpointed_layers"] == 2
    # --torch-compile too: every part of TRL's decoder layers (4 layers: attention, MLP, two norms each)
    assert summary["config"]["torch_compile"] is True and summary["trl"]["compiled_parts"] == 16
    assert summary["first_step_s"] > 0 and summary["step_s_median"] > 0
    assert summary["steps_wall_s"] == pytest.approx(sum(r["step_s"] for r in steps))
    for r in steps:
        assert r["step_s"] > 0 and r["switch_s"] == 0.0            # no vLLM: nothing to sync or wake
        assert {"rollout", "score", "train"} <= set(r["phase_s"])
        assert sum(r["phase_s"].values()) == pytest.approx(r["step_s"])
        assert r["samples_total"] == 4 * 8
        assert 0.0 <= r["reward_mean"] <= 1.0 and 0.0 <= r["accuracy"] <= 1.0
        assert 1 <= r["completion_len_mean"] <= 3                   # the successor task's 2 digits + EOS
        # TRL's own mean of the reward it received is the runner reward functions' mean
        assert r["trl/reward"] == pytest.approx(r["reward_mean"], abs=1e-5)
    assert summary["step_s_median"] == steps[1]["step_s"]         # the first step is left out of the medians


def test_bench_grpo_reads_a_trl_run_as_one_more_mode(trl_run):
    out, summary, steps = trl_run
    bench = _load("bench_grpo")
    res = bench.analyse(out)
    assert res["status"] == "ok" and res["steps_done"] == 2
    assert res["step_s"] == steps[1]["step_s"] and res["first_step_s"] == steps[0]["step_s"]
    report = {"runs": {"full_colomem": {"result": {"step_s": 2.0}}, "full_trl": {"result": {**res, "step_s": 3.0}}}}
    bench.top_level(report)
    assert report["speedup_vs_trl"] == pytest.approx(1.5)          # the peer's step over colomem's
    # the whole run, start-up included, from each mode's rounds after its first (which compiled its graphs)
    runs = {"full_colomem": {"result": {"step_s": 2.0, "run_wall_s": 100.0}},
            "full_trl": {"result": {"step_s": 3.0, "run_wall_s": 88.0}},
            "full_trl_r2": {"result": {"step_s": 3.0, "run_wall_s": 68.0}},
            "full_trl_r3": {"result": {"step_s": 3.0, "run_wall_s": 70.0}},
            "full_colomem_r2": {"result": {"step_s": 2.0, "run_wall_s": 72.0}},
            "full_inrank": {"result": {"step_s": 2.5, "run_wall_s": 60.0}}}       # ran once: as it ran
    report = {"runs": runs}
    bench.top_level(report)
    assert report["wall_s_by_mode"] == {"colomem": 86.0, "inrank": 60.0, "trl": 70.0}     # every round
    assert report["wall_s_by_mode_warm"] == {"colomem": 72.0, "inrank": 60.0, "trl": 69.0}
    assert report["whole_run_speedup_vs_trl"] == pytest.approx(69.0 / 72.0)


def test_one_trl_step_is_one_runner_step_of_the_benchmark_job(tmp_path):
    pytest.importorskip("trl")
    from trl import GRPOConfig

    from colomem.runner.config import load_run_config

    bench = _load("bench_trl")
    cfg = load_run_config(["--config", str(REPO / "configs/grpo_1p5b_full.yaml")])
    kw, notes = bench.trl_settings(cfg, steps=5, max_new_tokens=256, use_vllm=True, sleep=False, cuda=True,
                                   out=tmp_path)
    ds = kw.pop("deepspeed")
    assert ds["zero_optimization"]["stage"] == 2 and ds["bf16"]["enabled"]
    assert ds["train_micro_batch_size_per_gpu"] == 8 and ds["gradient_accumulation_steps"] == 32
    assert ds["optimizer"]["params"]["lr"] == cfg.lr and ds["gradient_clipping"] == cfg.max_grad_norm
    args = GRPOConfig(**{**kw, "use_cpu": True, "bf16": False})   # this machine: no GPU for bf16 checks
    assert args.generation_batch_size == 32 * 8                   # one generation = the runner's step
    assert args.steps_per_generation == args.gradient_accumulation_steps == 32   # = one optimizer step
    assert args.max_steps == 5 and args.num_iterations == 1
    assert args.max_completion_length == 256 and args.vllm_mode == "colocate"
    assert args.vllm_gpu_memory_utilization == cfg.gpu_memory_utilization and not args.vllm_enable_sleep_mode
    assert args.beta == 0.0 and args.loss_type == "dapo" and not args.vllm_importance_sampling_correction
    assert any("n - 1" in n for n in notes)


def test_trl_gets_the_runners_learning_rate_schedule_and_sampling_filters(tmp_path):
    pytest.importorskip("trl")
    from trl import GRPOConfig

    from colomem.runner.config import load_run_config

    bench = _load("bench_trl")
    cfg = load_run_config(["--config", str(REPO / "configs/grpo_1p5b_full.yaml"), "--lr-scheduler",
                           "cosine_with_min_lr", "--warmup-steps", "2", "--min-lr-rate", "0.05", "--top-k", "20",
                           "--min-p", "0.1", "--repetition-penalty", "1.2", "--mini-batches", "2", "--steps", "6"])
    kw, _ = bench.trl_settings(cfg, steps=6, max_new_tokens=256, use_vllm=True, sleep=False, cuda=True,
                               out=tmp_path)
    kw.pop("deepspeed")
    args = GRPOConfig(**{**kw, "use_cpu": True, "bf16": False})
    assert args.max_steps == 12 and args.warmup_steps == 4          # optimizer steps, on both sides
    assert args.lr_scheduler_type == "cosine_with_min_lr" and args.lr_scheduler_kwargs == {"min_lr_rate": 0.05}
    assert args.top_k == 20 and args.min_p == 0.1 and args.repetition_penalty == 1.2
    plain = load_run_config(["--config", str(REPO / "configs/grpo_1p5b_full.yaml")])
    kw, _ = bench.trl_settings(plain, steps=6, max_new_tokens=256, use_vllm=True, sleep=False, cuda=True,
                               out=tmp_path)
    assert kw["lr_scheduler_type"] == "constant" and kw["top_k"] == 0 and kw["min_p"] is None \
        and kw["repetition_penalty"] == 1.0


def test_a_peer_mode_without_its_package_is_skipped_with_the_reason(tmp_path, monkeypatch):
    bench = _load("bench_grpo")
    monkeypatch.setitem(bench.PEER_MODULES, "trl", "no_such_module_for_this_test")
    info = bench.run_peer("trl", "full_trl", [], tmp_path / "full_trl", 10.0)
    assert info["result"]["status"] == "skipped" and "no_such_module_for_this_test" in info["result"]["error"]
    report = {"runs": {"full_colomem": {"result": {"step_s": 2.0}}, "full_trl": info}}
    bench.top_level(report)
    assert "speedup_vs_trl" not in report


def test_the_peer_runs_eager_exactly_when_the_runner_does():
    bench = _load("bench_grpo")
    cfg = ["--config", str(REPO / "configs/grpo_1p5b_full.yaml")]
    assert bench.runner_eager(cfg) is True                         # the config's enforce_eager
    assert bench.runner_eager(cfg + ["--enforce-eager", "false"]) is False
    # a peer mode's runner flags stay in (only the peer's own flags leave): its "false" is not the eager one's
    args = cfg + bench.MODES["trl_nogc"] + ["--enforce-eager", "false"]
    assert bench.runner_eager([a for a in args if a not in bench.PEER_ONLY_FLAGS]) is False


def test_colomem_and_trl_with_the_same_recompute_and_each_in_its_best_setting():
    bench = _load("bench_grpo")
    res = lambda **kw: {"result": {"status": "ok", **kw}}  # noqa: E731
    report = {"runs": {"full_colomem": res(step_s=7.0), "full_trl": res(step_s=11.0),
                       "full_nogc": res(step_s=6.0), "full_trl_nogc": res(step_s=9.0),
                       "lora7b_shared": res(step_s=29.0), "lora7b_trl": res(step_s=30.0),
                       "lora7b_shared_nogc": res(step_s=20.0), "lora7b_trl_nogc": res(step_s=21.0)}}
    bench.top_level(report)
    assert report["full_speedup_vs_trl_by_recompute"] == pytest.approx({"config": 11 / 7, "nogc": 1.5})
    assert report["full_speedup_vs_trl_best"] == pytest.approx(9 / 6)      # TRL in its strongest setting
    assert report["full_best_recompute"] == {"colomem": "nogc", "trl": "nogc"}
    assert report["lora7b_speedup_vs_trl_best"] == pytest.approx(21 / 20)
    only_plain = {"runs": {"full_colomem": res(step_s=7.0), "full_trl": res(step_s=11.0)}}
    bench.top_level(only_plain)
    assert "full_speedup_vs_trl_best" not in only_plain and only_plain["speedup_vs_trl"] == pytest.approx(11 / 7)
    assert set(bench.MODES) >= {"nogc", "trl_nogc", "ckpt2", "trl_ckpt2", "shared_nogc", "mb32", "trl_mb32", "grow"}
    assert all(bench.PEER_SCRIPTS[m] == "benchmarks/bench_trl.py" for m in ("trl_nogc", "trl_ckpt2", "trl_mb32"))
    assert "grow" not in bench.PEER_SCRIPTS and "--grow-micro-batch" in bench.MODES["grow"]
    # --torch-compile on both sides: the runner compiles its trainer's layers, the TRL harness its model's
    assert bench.PEER_SCRIPTS["trl_compile"] == "benchmarks/bench_trl.py"
    assert all("--torch-compile" in bench.MODES[m] for m in ("compile", "shared_compile", "trl_compile"))
    compiled = {"runs": {"full_colomem": res(step_s=7.0), "full_trl": res(step_s=11.0),
                         "full_compile": res(step_s=5.0), "full_trl_compile": res(step_s=9.0)}}
    bench.top_level(compiled)
    assert compiled["full_speedup_vs_trl_by_recompute"] == pytest.approx({"config": 11 / 7, "compile": 9 / 5})
    assert compiled["full_speedup_vs_trl_best"] == pytest.approx(9 / 5)
    # --trim-recompute alone (no TRL twin) and with the compiled layers (TRL compiled, no checkpointing)
    assert "--trim-recompute" in bench.MODES["trim"] and bench.PEER_SCRIPTS["trl_tuned"] == "benchmarks/bench_trl.py"
    assert bench.MODES["trl_tuned"] == ["--torch-compile", "--gradient-checkpointing", "false"]
    tuned = {"runs": {"full_colomem": res(step_s=7.0), "full_trl": res(step_s=11.0), "full_trim": res(step_s=6.0),
                      "full_tuned": res(step_s=4.0), "full_trl_tuned": res(step_s=8.0)}}
    bench.top_level(tuned)
    assert tuned["full_speedup_vs_trl_by_recompute"] == pytest.approx({"config": 11 / 7, "tuned": 8 / 4})
    assert tuned["full_speedup_vs_trl_best"] == pytest.approx(8 / 4)
    assert tuned["full_best_recompute"] == {"colomem": "tuned", "trl": "tuned"}


GROWN_CASES = [  # (job, its runs' step seconds by mode, speedup by setting, best against best, the best settings)
    pytest.param("full", {"colomem": 7.0, "trl": 11.0, "mb32": 5.0, "trl_mb32": 8.0, "grow": 4.8},
                 {"config": 11 / 7, "mb32": 8 / 5}, 8 / 4.8, {"colomem": "grow", "trl": "mb32"}, id="full"),
    # a LoRA job's shared base with TRL's mb32 micro-batch and grown
    pytest.param("lora7b", {"shared": 29.0, "trl": 30.0, "shared_mb32": 14.0, "trl_mb32": 21.0, "shared_grow": 12.0},
                 {"config": 30 / 29, "mb32": 21 / 14}, 21 / 12, {"colomem": "grow", "trl": "mb32"}, id="lora7b-shared"),
]


@pytest.mark.parametrize("job, steps, by, best, best_setting", GROWN_CASES)
def test_the_same_micro_batch_on_both_sides_and_the_grown_one_against_trls_best(job, steps, by, best, best_setting):
    """mb32 against trl_mb32 (the same micro-batch), and the planner's grown micro-batch as one more colomem
    setting: the best of each side against the other's."""
    bench = _load("bench_grpo")
    res = lambda **kw: {"result": {"status": "ok", **kw}}  # noqa: E731
    assert "--grow-micro-batch" in bench.MODES["shared_grow"] and "--shared-base" in bench.MODES["shared_grow"]
    assert bench.MODES["shared_mb32"][-2:] == ["--micro-batch", "32"] and "shared_grow" not in bench.PEER_SCRIPTS
    report = {"runs": {f"{job}_{mode}": res(step_s=s) for mode, s in steps.items()}}
    bench.top_level(report)
    assert report[f"{job}_speedup_vs_trl_by_recompute"] == pytest.approx(by)
    assert report[f"{job}_speedup_vs_trl_best"] == pytest.approx(best)
    assert report[f"{job}_best_recompute"] == best_setting


def test_a_grown_micro_batch_counts_against_trls_plain_run_alone():
    bench = _load("bench_grpo")
    res = lambda **kw: {"result": {"status": "ok", **kw}}  # noqa: E731
    grown = {"runs": {"full_colomem": res(step_s=7.0), "full_trl": res(step_s=11.0), "full_grow": res(step_s=5.5)}}
    bench.top_level(grown)
    assert grown["full_speedup_vs_trl_best"] == pytest.approx(11 / 5.5)
    # a colomem setting against TRL's plain run, with no setting run on both sides (nor colomem's own plain one)
    alone = {"runs": {"full_trl": res(step_s=9.5), "full_tuned": res(step_s=5.0)}}
    bench.top_level(alone)
    assert alone["full_speedup_vs_trl_best"] == pytest.approx(9.5 / 5.0)
    assert alone["full_best_recompute"] == {"colomem": "tuned", "trl": "config"}
    assert "full_speedup_vs_trl_by_recompute" not in alone


def test_the_lora_jobs_figures_against_trl_and_the_shared_base():
    bench = _load("bench_grpo")
    res = lambda **kw: {"result": {"status": "ok", **kw}}  # noqa: E731
    report = {"runs": {
        "lora7b_colomem": res(step_s=6.0, switch_overhead_fraction=0.05, gpu_used_in_rollout_gib=60.0,
                              gpu_used_in_train_gib=70.0),
        "lora7b_shared": res(step_s=4.0, switch_overhead_fraction=0.004, phase_s={"sync": 0.012},
                             shared_base={"lora_base_copies_on_gpu": 1}, gpu_used_in_rollout_gib=45.0,
                             gpu_used_in_train_gib=55.0),
        "lora7b_shared_r2": res(step_s=5.0, switch_overhead_fraction=0.006, phase_s={"sync": 0.016},
                                shared_base={"lora_base_copies_on_gpu": 1}),
        "lora7b_trl": res(step_s=9.0)}}
    bench.top_level(report)
    assert report["lora7b_shared_speedup_vs_trl"] == pytest.approx(9.0 / 4.5)    # medians over the rounds
    assert report["lora7b_speedup_vs_trl"] == pytest.approx(1.5)
    assert report["lora7b_shared_switch_fraction"] == pytest.approx(0.005)
    assert report["lora_base_copies_on_gpu"] == 1 and report["adapter_sync_ms"] == pytest.approx(14.0)
    assert report["lora7b_gpu_used_rollout_train_gib"] == {"colomem": [60.0, 70.0], "shared": [45.0, 55.0]}


def test_the_jobs_that_must_move_report_their_switch_share_by_mode():
    bench = _load("bench_grpo")
    res = lambda **kw: {"result": {"status": "ok", **kw}}  # noqa: E731
    report = {"runs": {"bigkv_colomem": res(step_s=10.0, switch_overhead_fraction=0.03,
                                            placement={"label": "trainer keeps params+other+grads+master"}),
                       "bigkv_overlap": res(step_s=9.9, switch_overhead_fraction=0.018),
                       "full7b_colomem": res(step_s=30.0, switch_overhead_fraction=0.05)}}
    bench.top_level(report)
    assert report["offload_needed_switch_fraction"] == 0.03            # the default's, not the best mode's
    assert report["bigkv_switch_fraction_by_mode"] == {"colomem": 0.03, "overlap": 0.018}
    assert report["bigkv_placement"].startswith("trainer keeps") and report["full7b_step_s"] == 30.0


def test_rounds_over_two_calls_make_one_interleaved_report(tmp_path, monkeypatch):
    # a device call fits one round of the 1.5B job against TRL: the second call continues the first's report
    bench = _load("bench_grpo")
    steps = {"colomem": iter([7.0, 8.0]), "trl": iter([11.0, 10.0])}
    monkeypatch.setattr(bench, "run_one", lambda name, args, d, t: {"rc": 0, "wall_s": 1.0})
    monkeypatch.setattr(bench, "analyse", lambda d: {"status": "ok", "step_s": next(steps["colomem"]),
                                                     "switch_overhead_fraction": 0.004})
    monkeypatch.setattr(bench, "run_peer", lambda mode, name, args, d, t: {
        "rc": 0, "result": {"status": "ok", "step_s": next(steps["trl"])}})
    # no warm-up imports: the bench's own modules look absent. Only those: find_spec is the process's, and
    # a package imported for the first time meanwhile (transformers) would cache its optional ones as missing
    real, warm = bench.importlib.util.find_spec, {"vllm", "deepspeed", "transformers", "peft", "trl"}
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda m, *a: None if m in warm else real(m, *a))
    common = ["--configs", "full", "--modes", "colomem,trl", "--rounds", "1"]
    assert bench.main(["--out", str(tmp_path / "call1"), *common]) == 0
    first = tmp_path / "call1" / "grpo_bench.json"
    assert bench.main(["--out", str(tmp_path / "call2"), *common, "--continue-from", str(first)]) == 0
    report = json.loads((tmp_path / "call2" / "grpo_bench.json").read_text())
    assert sorted(report["runs"]) == ["full_colomem", "full_colomem_r2", "full_trl", "full_trl_r2"]
    assert report["step_s_by_mode"] == {"colomem": 7.5, "trl": 10.5}          # medians over both calls
    assert report["speedup_vs_trl"] == pytest.approx(10.5 / 7.5)
    assert [c["runs"] for c in report["calls"]] == [["full_colomem", "full_trl"], ["full_colomem_r2", "full_trl_r2"]]
    assert [c["first_run"] for c in report["calls"]] == ["full_colomem", "full_colomem_r2"]
    # a round that would replace a run of the earlier report is refused before anything runs
    with pytest.raises(SystemExit, match="holds full_colomem, full_trl already: start at round 2"):
        bench.main(["--out", str(tmp_path / "call3"), *common, "--continue-from", str(first), "--first-round", "1"])
    assert not (tmp_path / "call3").exists()


def test_a_runs_figures_say_what_the_planner_changed_and_whether_it_compiled(tmp_path):
    bench = _load("bench_grpo")
    def step(s):
        return {"step": s, "step_s": 2.0, "switch_s": 0.1, "phase_s": {"rollout": 1.0, "train": 0.9},
                "train/recomputed_layers": 28 if s == 0 else 0}

    lines = [{"event": "start", "time": 0.0}, step(0),
             {"event": "placement", "from_step": 1, "micro_batch_grown": None, "recompute_trimmed": [28, 0]},
             step(1), step(2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "summary.json").write_text(json.dumps({"status": "ok", "config": {"torch_compile": True}}))
    res = bench.analyse(tmp_path)
    assert res["planner_changes"] == {"micro_batch_grown": None, "recompute_trimmed": [28, 0]}
    assert res["torch_compile"] is True and res["step_s"] == 2.0
    assert res["recomputed_layers"] == [28, 0, 0]          # what each step's backward recomputed


def test_the_default_that_trims_and_every_layer_recomputed_both_against_trls_config():
    """The default trims the checkpointed layers where memory is free; `recompute` keeps every one, as the
    config says and TRL's run of it does: both are set against that one TRL run, which counts once in the
    best against the best."""
    bench = _load("bench_grpo")
    res = lambda **kw: {"result": {"status": "ok", **kw}}  # noqa: E731
    assert bench.MODES["recompute"][-2:] == ["--trim-recompute", "false"]
    assert "--shared-base" in bench.MODES["shared_recompute"] and "recompute" not in bench.PEER_SCRIPTS
    assert bench.MODES["recompute_grow"][-3:] == ["--trim-recompute", "false", "--grow-micro-batch"]
    report = {"runs": {"full_colomem": res(step_s=5.0), "full_recompute": res(step_s=7.0),
                       "full_trl": res(step_s=9.0)}}
    bench.top_level(report)
    assert report["speedup_vs_trl"] == pytest.approx(9 / 5)
    assert report["full_speedup_vs_trl_by_recompute"] == pytest.approx({"config": 9 / 5, "recompute": 9 / 7})
    assert report["full_speedup_vs_trl_best"] == pytest.approx(9 / 5)
    assert report["full_best_recompute"] == {"colomem": "config", "trl": "config"}
    only_plain = {"runs": {"full_colomem": res(step_s=5.0), "full_trl": res(step_s=9.0)}}
    bench.top_level(only_plain)
    assert "full_speedup_vs_trl_best" not in only_plain          # the plain pair alone: speedup_vs_trl says it
