"""The runner as a user starts it on the CPU: the embedded default, the command line, what the GPU path would
need, the default task learned, a float32 checkpoint, inputs refused before anything starts, --prepare-only."""

import pytest
import torch
import yaml

from colomem.runner.config import RunConfig, config_from_dict
from colomem.runner import run_job
from colomem.runner.backends import build_engines
from colomem.runner.timeline import read_jsonl

from runner_cpu_helpers import cache_env, model_cache  # noqa: F401  (fixtures)
from runner_cpu_helpers import ROOT, small_cfg

pytest.importorskip("transformers")


def test_default_yaml_is_the_embedded_default():
    data = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    assert config_from_dict(data).model_dump() == RunConfig().model_dump()


def test_cli_main(cache_env, tmp_path, capsys):
    from colomem.runner.cli import main

    rc = main(["--backend", "cpu", "--steps", "1", "--prompts-per-step", "4", "--group-size", "2",
               "--out", str(tmp_path / "cli"), "--no-progress", "--no-plots"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "step   1/1" in out and "ok: 1 steps" in out
    assert (tmp_path / "cli" / "summary.json").is_file() and not (tmp_path / "cli" / "timeline.png").exists()
    assert main(["--clip-eps", "2"]) == 2
    assert "grpo.clip_eps = '2' (from --clip-eps)" in capsys.readouterr().err


def test_cpu_explains_what_the_gpu_path_needs(cache_env, tmp_path, capsys):
    from colomem.runner.backends import resolve_backend
    backend, why = resolve_backend("auto")
    if backend != "cpu":
        pytest.skip("the GPU path is available here; this checks the fallback on machines without it")
    assert "vllm" in why and "deepspeed" in why and "CUDA" in why
    res = run_job(small_cfg(tmp_path / "auto", backend="auto", steps=40, cpu_steps=1), print_fn=print)
    assert res.summary["backend"] == "cpu" and res.summary["steps_done"] == 1
    out = capsys.readouterr().out
    assert "1 steps instead of 40" in out and "The GPU path needs" in out


@pytest.mark.slow
def test_default_task_is_learned_on_cpu(cache_env, tmp_path):
    """GRPO on the tiny model learns the default task: the reward rises within 10 steps (16 prompts x 8)."""
    run_job(config_from_dict({"backend": "cpu", "steps": 10, "prompts_per_step": 16, "progress": False,
                              "plots": False, "out": str(tmp_path / "l")}), print_fn=lambda *_: None)
    r = [x["reward_mean"] for x in read_jsonl(tmp_path / "l" / "metrics.jsonl") if "step" in x]
    assert len(r) == 10
    assert sum(r[-3:]) / 3 > sum(r[:3]) / 3 + 0.1, r


def test_a_cross_process_engine_over_several_ranks_is_refused_before_anything_starts():
    from colomem.errors import InvalidArgumentError
    from colomem.runner.ranks import Ranks

    cfg = config_from_dict({"tensor_parallel_size": 2, "backend": "gpu"})
    assert cfg.effective_engine == "in-rank"                          # TP above 1: the engine inside the ranks
    forced = cfg.model_copy(update={"engine": "cross-process"})       # past the run config's own check
    with pytest.raises(InvalidArgumentError, match="needs the in-rank engine"):
        build_engines(forced, "gpu", "/nonexistent", None, Ranks(), grad_accum=1)


def test_a_float32_checkpoint_trains_on_the_cpu(cache_env, tmp_path):
    """A checkpoint saved in float32 (most small ones are) loads as safetensors' read-only file mapping on the
    CPU; the trainer must still offload and reload it (it used to raise ForeignTensorError)."""
    from safetensors.torch import load_file

    from colomem.grpo.tasks import make_task
    from colomem.grpo.tiny_model import model_dir

    path = model_dir("tiny", make_task("successor").alphabet, dtype="float32", cache_dir=tmp_path / "models",
                     log=lambda *_: None)
    assert all(t.dtype == torch.float32 for t in load_file(str(path / "model.safetensors")).values())
    res = run_job(small_cfg(tmp_path / "fp32", model=str(path), steps=2), print_fn=lambda *_: None)
    assert res.summary["status"] == "ok" and res.summary["steps_done"] == 2


def test_a_gpu_sized_config_on_the_cpu_says_it_needs_a_gpu(cache_env, tmp_path):
    import time
    from pathlib import Path

    from colomem.errors import NotAvailableError
    from colomem.runner.config import load_run_config
    from colomem.runner.host_memory import check_cpu_fits

    root = Path(__file__).resolve().parents[1]
    cfg = load_run_config(["--config", str(root / "configs" / "grpo_1p5b_full.yaml"), "--backend", "cpu",
                           "--out", str(tmp_path / "big")])
    t0 = time.monotonic()
    with pytest.raises(NotAvailableError, match=r"1\.54 B parameters.*GPU path"):
        check_cpu_fits({"hidden_size": 1536, "num_hidden_layers": 28, "intermediate_size": 8960,
                        "vocab_size": 151936, "num_attention_heads": 12, "num_key_value_heads": 2},
                       "a 1.5B model", available=16 << 30)
    check_cpu_fits({"hidden_size": 256, "num_hidden_layers": 4, "vocab_size": 64}, "tiny", available=16 << 30)
    from colomem.runner.host_memory import available_host_bytes
    if (available_host_bytes() or 0) < 24e9 * 1.25:     # machines like CI's: the run is refused before building
        with pytest.raises(NotAvailableError, match="GPU path"):
            run_job(cfg, print_fn=lambda *_: None)
        assert time.monotonic() - t0 < 60                              # refused before any model was built
        assert not list((cache_env / "models").glob("qwen2-1.5b*"))


def test_prepare_only_builds_the_model_into_an_empty_cache_and_runs_nothing(tmp_path, monkeypatch, capsys):
    from colomem.runner.cli import main

    cache = tmp_path / "fresh-cache"
    monkeypatch.setenv("COLOMEM_CACHE", str(cache))
    out = tmp_path / "out"
    assert main(["--prepare-only", "--backend", "cpu", "--seed", "3", "--out", str(out)]) == 0
    built = [p for p in (cache / "models").iterdir() if (p / "config.json").is_file()]
    assert len(built) == 1 and any(built[0].glob("*.safetensors"))
    assert str(built[0]) in capsys.readouterr().out
    assert not out.exists()                                  # no run: no outputs, no engines
    # the same config then finds it: a second prepare builds nothing new
    assert main(["--prepare-only", "--backend", "cpu", "--seed", "3"]) == 0
    assert [p for p in (cache / "models").iterdir() if (p / "config.json").is_file()] == built


def test_prepare_only_reports_a_bad_input_without_starting_anything(tmp_path, monkeypatch, capsys):
    from colomem.runner.cli import main

    monkeypatch.setenv("COLOMEM_CACHE", str(tmp_path / "cache"))
    assert main(["--prepare-only", "--backend", "cpu", "--model", str(tmp_path / "no-such-model")]) == 2
    assert "error:" in capsys.readouterr().err
