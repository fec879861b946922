"""What the rollout's KV cache must hold, and the hint a far larger cache gets: the bound from the model's
config, the placement a smaller cache would allow, and the runner's line about it."""
import json

from colomem.runner import run_job
from colomem.runner.config import config_from_dict
from colomem.runner.kv_need import kv_bytes_per_token, kv_shrink_hint, rollout_kv_bound
from colomem.runner.placement import MemoryFigures, choose

GiB = 1 << 30


def bigkv(**kw):
    """The bigkv job as measured on a 139.8 GiB GPU (GiB): vLLM at 0.85, a 112.5 GiB KV cache beside the
    trainer's 8.6 GiB left after its offload; its 256 sequences of at most 512 tokens hold 3.5 GiB."""
    f = dict(total=int(139.8 * GiB), rollout_used=int(133.5 * GiB), trainer_left=int(8.6 * GiB),
             train_peak=46 * GiB, state={"params": 3 * GiB, "other": 0, "grads": 3 * GiB,
                                         "master": 6 * GiB, "optim": 12 * GiB},
             train_other=2 * GiB, optim_created=12 * GiB, kv_cache=int(112.5 * GiB), kv_need=int(3.5 * GiB))
    f.update(kw)
    return MemoryFigures(**f)


def test_the_bound_is_every_sequence_at_max_model_len_in_whole_blocks(tmp_path):
    from colomem.bench.shapes import SHAPES

    s = SHAPES["1.5b"]
    cfg = {"model_type": "qwen2", "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
           "num_key_value_heads": s.kv_heads, "hidden_size": s.hidden, "intermediate_size": s.intermediate,
           "vocab_size": s.vocab}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    per_token = kv_bytes_per_token(str(tmp_path))
    assert per_token == 28 * 2 * 2 * 128 * 2                     # Qwen2-1.5B: 28 layers, 2 KV heads of 128, bf16
    assert rollout_kv_bound(256, 512, per_token) == 256 * 512 * per_token == int(3.5 * GiB)
    assert rollout_kv_bound(1, 17, per_token) == 32 * per_token   # two blocks of 16


def test_per_token_bytes_come_from_the_models_config(tmp_path):
    cfg = {"model_type": "qwen2", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
           "hidden_size": 256, "intermediate_size": 512, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert kv_bytes_per_token(str(tmp_path)) == 4 * 2 * 2 * 32 * 2
    cfg["head_dim"] = 64
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert kv_bytes_per_token(str(tmp_path)) == 4 * 2 * 2 * 64 * 2
    assert kv_bytes_per_token(str(tmp_path / "missing")) is None


def test_a_cache_far_larger_than_the_rollout_gets_the_utilization_that_lets_nothing_move():
    f = bigkv()
    p = choose("auto", "auto", [f])
    assert p.trainer_moves and p.rollout_sleeps                   # as measured: the moments move every step
    hint = kv_shrink_hint(p, [f], "auto", "auto", 0.85)
    assert "nothing moves" in hint and "3.50 GiB" in hint and "(now 0.85)" in hint, hint
    assert hint.endswith("--kv-cache-bytes auto sizes the cache to what the rollout holds"), hint
    # the utilization given holds the rollout with the headroom: 0.85 - (112.5 - 1.25 x 3.5) / 139.8
    assert "--gpu-memory-utilization 0.08 " in hint, hint


def test_no_hint_when_nothing_moves_already_the_figures_are_missing_or_nothing_would_change():
    f = bigkv()
    assert kv_shrink_hint(choose("auto", "auto", [f]), [bigkv(kv_cache=0)], "auto", "auto", 0.85) == ""
    assert kv_shrink_hint(choose("auto", "auto", [f]), [bigkv(kv_need=0)], "auto", "auto", 0.85) == ""
    roomy = bigkv(rollout_used=30 * GiB, kv_cache=10 * GiB)
    assert choose("auto", "auto", [roomy]).label == "nothing moves"
    assert kv_shrink_hint(choose("auto", "auto", [roomy]), [roomy], "auto", "auto", 0.2) == ""
    # the cache is barely above what the rollout holds: no gain worth a line
    tight = bigkv(kv_cache=int(4.5 * GiB))
    assert kv_shrink_hint(choose("auto", "auto", [tight]), [tight], "auto", "auto", 0.85) == ""
    # forced modes allow one placement only: nothing to offer
    forced = choose("all", "always", [f])
    assert kv_shrink_hint(forced, [f], "all", "always", 0.85) == ""


def _bigkv_run(monkeypatch, out, **options):
    """The CPU loop planning from the bigkv figures (its rollout's KV figures included): (lines said, f)."""
    from colomem.runner import train_memory_plan

    f = bigkv()
    monkeypatch.setattr(train_memory_plan, "figures_from_step",
                        lambda memory, by_cat, total, **_: bigkv(kv_cache=0, kv_need=0))
    monkeypatch.setattr(train_memory_plan, "gpu_total", lambda device: f.total)
    monkeypatch.setattr(train_memory_plan, "kv_figures", lambda cfg, rollout, world_size: (f.kv_cache, f.kv_need))
    said = []
    cfg = config_from_dict({"backend": "cpu", "steps": 2, "prompts_per_step": 4, "micro_batch": 8,
                            "progress": False, "plots": False, "report_to": ["none"], "out": str(out),
                            "grpo": {"group_size": 4}, **options})
    assert run_job(cfg, print_fn=said.append).summary["status"] == "ok"
    return said, f


def test_the_runner_prints_and_records_the_smaller_cache(job_env, tmp_path, monkeypatch):
    out = tmp_path / "kv"
    said, f = _bigkv_run(monkeypatch, out, gpu_memory_utilization=0.85)
    line = [s for s in said if s.startswith("[colomem] KV cache: the rollout holds at most")]
    assert len(line) == 1 and "nothing moves" in line[0], said
    event = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"event"' in x
             and '"placement"' in x][-1]
    assert "the rollout holds at most" in event["kv_hint"]
    assert event["figures"][0]["kv_cache"] == f.kv_cache and event["figures"][0]["kv_need"] == f.kv_need


def test_a_smaller_cache_that_lets_the_whole_trainer_stay_names_the_optimizer_out_for_the_step_placement():
    """The 7.6B full fine-tune at 0.25: 17.2 GiB of KV cache for a rollout that holds 7 GiB, and the whole
    trainer misses its place beside the awake rollout by less than a GiB. With a smaller cache it fits, and
    only the moments move, out behind the rollout."""
    f = MemoryFigures(total=int(139.8 * GiB), rollout_used=37 * GiB, trainer_left=0, train_peak=128 * GiB,
                      state={"params": 14 * GiB, "other": 0, "grads": 0, "master": 28 * GiB, "optim": 57 * GiB},
                      train_other=4 * GiB, optim_created=57 * GiB, kv_cache=int(17.2 * GiB), kv_need=7 * GiB,
                      pre_step_peak=60 * GiB)
    p = choose("auto", "auto", [f])
    assert p.keep == ("params", "other", "grads", "master")           # as measured: the moments move twice
    hint = kv_shrink_hint(p, [f], "auto", "auto", 0.25)
    assert "optimizer state out behind the rollout" in hint and "(now 0.25)" in hint, hint
    # not allowed (--optimizer-reload overlap): a smaller cache would change nothing
    assert kv_shrink_hint(p, [f], "auto", "auto", 0.25, optim_out=False) == ""


def _qwen2_1p5b_config(path):
    from colomem.bench.shapes import SHAPES

    s = SHAPES["1.5b"]
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads, "hidden_size": s.hidden, "intermediate_size": s.intermediate,
        "vocab_size": s.vocab}))
    return str(path)


def test_kv_cache_bytes_auto_holds_a_ranks_rollout_at_max_model_len_on_each_gpu(tmp_path):
    """--kv-cache-bytes auto: the bound with a quarter more, in whole MiB; tensor parallelism leaves each GPU
    its rank's share while the KV heads divide over the GPUs, a copy of one head each when they are fewer."""
    from colomem.runner.kv_need import auto_kv_cache_bytes, resolve_kv_cache

    per_token = 28 * 2 * 2 * 128 * 2                          # Qwen2-1.5B: 2 KV heads
    assert auto_kv_cache_bytes(256, 512, per_token, 2) == int(3.5 * 1.25 * GiB)
    assert auto_kv_cache_bytes(256, 512, per_token, 2, tensor_parallel_size=2) == int(3.5 * 1.25 * GiB)
    assert auto_kv_cache_bytes(256, 512, per_token, 2, tensor_parallel_size=4) == int(3.5 * 2.5 * GiB)
    assert auto_kv_cache_bytes(1, 1, 1000, 1) == 1 << 20      # at least one MiB
    model = _qwen2_1p5b_config(tmp_path / "m")
    base = {"backend": "cpu", "prompts_per_step": 32, "grpo": {"group_size": 8}, "max_model_len": 512}
    size, line = resolve_kv_cache(config_from_dict({**base, "kv_cache_bytes": "auto"}), model, 1)
    assert size == int(3.5 * 1.25 * GiB) and line.startswith("[colomem] KV cache: 4.38 GiB on each GPU")
    assert resolve_kv_cache(config_from_dict({**base, "kv_cache_bytes": "auto"}), model, 2)[0] == size // 2
    assert resolve_kv_cache(config_from_dict({**base, "kv_cache_bytes": "4GiB"}), model, 1) == (None, "")
    assert resolve_kv_cache(config_from_dict(base), model, 1) == (None, "")


def test_the_planners_kv_need_is_one_gpus_share_as_the_auto_cache_is(tmp_path):
    """What the planner weighs a cache against is the rollout's need on this GPU, split by tensor parallelism
    as --kv-cache-bytes auto splits it: the auto cache is that need with a quarter more, whatever the TP."""
    from types import SimpleNamespace

    from colomem.runner.kv_need import auto_kv_cache_bytes, kv_layout, rollout_kv_need
    from colomem.runner.train_memory_plan import kv_figures

    model = _qwen2_1p5b_config(tmp_path / "m")
    per_token, kv_heads = kv_layout(model)
    base = {"backend": "cpu", "prompts_per_step": 32, "grpo": {"group_size": 8}, "max_model_len": 512}
    for tp, share in ((1, 1), (2, 1), (4, 2)):      # 2 KV heads: on 4 GPUs each holds a copy of one
        cfg = config_from_dict({**base, "backend": "gpu", "tensor_parallel_size": tp})
        rollout = SimpleNamespace(kv_cache_bytes=9 * GiB, model_path=model)
        rows = 256 // tp                   # a rank's; the engine generates as many ranks' as it has GPUs
        cache, need = kv_figures(cfg, rollout, tp)
        assert cache == 9 * GiB and need == int(3.5 / tp * share * GiB) == rollout_kv_need(rows, 512, per_token,
                                                                                           kv_heads, tp)
        assert auto_kv_cache_bytes(rows, 512, per_token, kv_heads, tp) == int(need * 1.25)
    gone = SimpleNamespace(kv_cache_bytes=9 * GiB, model_path=str(tmp_path / "none"))
    assert kv_figures(config_from_dict(base), gone, 1) == (9 * GiB, 0)      # no config to read: no need weighed


def test_kv_cache_bytes_reaches_vllm_and_bad_values_are_refused_early(tmp_path):
    import pytest

    from colomem.errors import ConfigError, InvalidArgumentError
    from colomem.runner.kv_need import resolve_kv_cache

    base = {"backend": "cpu"}
    vcfg = config_from_dict({**base, "kv_cache_bytes": "4GiB"}).vllm_config()
    assert vcfg.kv_cache_bytes == 4 * GiB
    assert vcfg.llm_arguments("m")["kv_cache_memory_bytes"] == 4 * GiB
    assert "kv_cache_memory_bytes" not in config_from_dict(base).vllm_config().llm_arguments("m")
    auto = config_from_dict({**base, "kv_cache_bytes": "auto"})
    assert auto.vllm_config(kv_cache_bytes=GiB).llm_arguments("m")["kv_cache_memory_bytes"] == GiB
    with pytest.raises(ConfigError, match="resolved from the model's config"):
        auto.vllm_config()
    for bad in ("0", "-1GiB", "lots"):
        with pytest.raises((ConfigError, InvalidArgumentError), match="kv_cache_bytes"):
            config_from_dict({**base, "kv_cache_bytes": bad})
    assert config_from_dict({**base, "placement_margin": "0"}).placement_margin == "0"   # no margin: a choice
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="give a size instead"):
        resolve_kv_cache(auto, str(tmp_path / "bad"), 1)


def test_a_run_that_sized_its_kv_cache_gets_no_utilization_hint(job_env, tmp_path, monkeypatch):
    said, _ = _bigkv_run(monkeypatch, tmp_path / "kv", kv_cache_bytes="112GiB")
    assert not any(s.startswith("[colomem] KV cache:") for s in said), said
