"""The training diagnostic (benchmarks/diag_train.py) on the CPU trainer: each variant really runs with its
micro-batch and its recompute (the micro-batches a step ran, the decoder layers checkpointed), the executed
FLOPs count the recompute, a bad variant is refused before anything is built, a variant out of memory is
recorded and the others go on, and the JSON and table are written."""
import json

import pytest
import torch

from bench_module import load_benchmark
from colomem.errors import ConfigError

diag = load_benchmark("diag_train")


def test_variants_parse_with_the_configs_checkpointing_and_bad_ones_are_refused():
    assert diag.parse_variants(None, 4, 16, True) == [
        ("mb4", 4, 1), ("mb8", 8, 1), ("mb16", 16, 1), ("mb4-nogc", 4, 0), ("mb8-nogc", 8, 0), ("mb16-nogc", 16, 0)]
    assert diag.parse_variants(None, 8, 8, False) == [("mb8", 8, 0)]
    assert diag.parse_variants("mb2,mb2-gc3", 4, 8, False) == [("mb2", 2, 0), ("mb2-gc3", 2, 3)]
    assert diag.parse_variants("mb2-rmb,mb2-nogc-rmb", 4, 8, True) == [("mb2-rmb", 2, 1), ("mb2-nogc-rmb", 2, 0)]
    assert diag.reduction_per_step("mb2-rmb", True) is False and diag.reduction_per_step("mb2", True) is True
    assert diag.reduction_per_step("mb2", False) is False
    for bad in ("mb0", "mb9", "mbx", "mb2-gc0", "mb2-fast", "mb2,mb2", "mb2-rmb-gc3", "mb2-rmb,mb2-rmb"):
        with pytest.raises(ConfigError):
            diag.parse_variants(bad, 4, 8, True)


def test_the_flops_count_the_trainable_weights_and_the_recomputed_layers():
    full = diag.step_flops(100, 80, 1.0, 10, 1)
    assert full == (6 * 100 + 2 * 80) * 10
    assert diag.step_flops(100, 80, 1.0, 10, 0) == 6 * 100 * 10
    assert diag.step_flops(100, 80, 1.0, 10, 2) == (6 * 100 + 80) * 10
    assert diag.step_flops(100, 80, 0.0, 10, 0) == 4 * 100 * 10       # LoRA-like: no weight gradients


def test_each_variant_runs_as_named_on_the_cpu_trainer(tmp_path, job_env):
    out = tmp_path / "diag"
    rc = diag.main(["--out", str(out), "--rows", "8", "--completion-len", "6", "--rounds", "2", "--profile",
                    "--micro-batch", "4", "--gradient-checkpointing", "true",
                    "--variants", "mb4,mb8,mb4-nogc,mb2-gc2"])
    assert rc == 0
    res = json.loads((out / "diag_train.json").read_text())
    v = res["variants"]
    layers = v["mb4"]["checkpointed_layers"]
    assert layers >= 2 and res["backend"] == "TorchTrainer"
    assert res["recompute_probe"]["checkpointed"] == layers and res["recompute_probe"]["per_layer_row"] > 0
    assert [v[n]["micro_batches"] for n in ("mb4", "mb8", "mb4-nogc", "mb2-gc2")] == [2, 1, 2, 4]
    assert v["mb4-nogc"]["checkpointed_layers"] == 0 and v["mb2-gc2"]["checkpointed_layers"] == -(-layers // 2)
    assert all(len(r["step_s"]) == 2 and r["oom"] is None for r in v.values())
    fastest = min(v, key=lambda n: v[n]["step_s_median"])
    assert {n for n in v if "profile" in v[n]} == {"mb4", fastest}     # the config's and the fastest
    assert v["mb4"]["flops"] > v["mb2-gc2"]["flops"] > v["mb4-nogc"]["flops"] > 0
    assert v["mb4"]["speedup_vs_config"] == 1.0
    assert "| mb2-gc2 |" in (out / "diag_train.md").read_text()


def test_a_variant_out_of_memory_is_a_result_and_the_others_go_on(tmp_path, job_env, monkeypatch):
    real_step, real_after = diag.timed_step, diag.after_oom
    rebuilt = []

    def step(trainer, batch, device):
        if trainer.micro_batch == 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_step(trainer, batch, device)

    def after(trainer, *a):
        rebuilt.append(trainer.micro_batch)
        return real_after(trainer, *a)

    monkeypatch.setattr(diag, "timed_step", step)
    monkeypatch.setattr(diag, "after_oom", after)
    out = tmp_path / "diag"
    assert diag.main(["--out", str(out), "--rows", "8", "--completion-len", "4", "--rounds", "2",
                      "--micro-batch", "4", "--variants", "mb4,mb8,mb2"]) == 0
    v = json.loads((out / "diag_train.json").read_text())["variants"]
    assert v["mb8"]["oom"].startswith("OutOfMemoryError") and v["mb8"]["step_s"] == []
    assert rebuilt == [8]                                  # once: left out of the later rounds
    assert len(v["mb4"]["step_s"]) == len(v["mb2"]["step_s"]) == 2
    assert "out of memory" in (out / "diag_train.md").read_text().lower()
