"""RunConfig from YAML and flags: precedence, validation errors that name the field, safe defaults."""
import pytest
import yaml

from colomem.errors import InvalidArgumentError
from colomem.errors import ConfigError
from colomem.grpo.config import GRPOConfig, LoraSpec
from colomem.runner.config import RunConfig, config_from_dict, load_run_config


def _yaml(tmp_path, data, name="job.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return str(p)


def test_defaults_are_the_embedded_job_and_safe():
    cfg = load_run_config([])
    assert cfg.trust_remote_code is False
    assert cfg.model is None and cfg.model_shape == "tiny" and cfg.task == "successor"
    assert cfg.lora is None and cfg.switch == "colomem" and cfg.backend == "auto"
    assert cfg.steps >= 30 and cfg.cpu_steps < cfg.steps
    assert cfg.effective_sleep_level == 2 and cfg.trainer_offload == "colomem"


def test_cli_overrides_yaml_overrides_defaults(tmp_path):
    y = _yaml(tmp_path, {"steps": 7, "lr": 1e-4, "seed": 3, "grpo": {"clip_eps": 0.3, "group_size": 4}})
    cfg = load_run_config(["--config", y, "--steps", "9", "--group-size", "6"])
    assert cfg.steps == 9                      # flag beats YAML
    assert cfg.lr == 1e-4 and cfg.seed == 3    # YAML beats default
    assert cfg.grpo.clip_eps == 0.3 and cfg.grpo.group_size == 6
    assert cfg.grpo.kl_coef == 0.0             # default kept
    assert cfg.explicitly_set("steps") and not cfg.explicitly_set("lr")


def test_defaults_yaml_then_config_then_flags(tmp_path):
    base = _yaml(tmp_path, {"steps": 5, "prompts_per_step": 8}, "base.yaml")
    over = _yaml(tmp_path, {"prompts_per_step": 4}, "over.yaml")
    cfg = load_run_config(["--config", over], defaults_yaml=base)
    assert cfg.steps == 5 and cfg.prompts_per_step == 4


def test_cpu_steps_apply_only_without_an_explicit_steps_flag(tmp_path):
    cfg = load_run_config(["--config", _yaml(tmp_path, {"steps": 40, "cpu_steps": 5})])
    assert cfg.steps_for("cpu") == 5 and cfg.steps_for("gpu") == 40
    cfg = load_run_config(["--steps", "40", "--cpu-steps", "5"])
    assert cfg.steps_for("cpu") == 40


def test_bool_flags_lists_dicts_and_none():
    cfg = load_run_config(["--trust-remote-code", "--no-plots", "--rewards", "exact_match, char_match",
                           "--task-options", "{base: 16}", "--max-grad-norm", "none", "--progress", "false"])
    assert cfg.trust_remote_code is True and cfg.plots is False and cfg.progress is False
    assert cfg.rewards == ["exact_match", "char_match"]
    assert cfg.task_options == {"base": 16} and cfg.max_grad_norm is None


def test_lora_flags(tmp_path):
    assert load_run_config(["--lora"]).lora == LoraSpec()
    cfg = load_run_config(["--lora-r", "8", "--lora-target-modules", "q_proj,v_proj"])
    assert cfg.lora.r == 8 and cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert load_run_config(["--lora"]).lora.target_modules == "all-linear"        # peft's every-linear-layer
    cfg = load_run_config(["--config", _yaml(tmp_path, {"lora": {"r": 4}}), "--no-lora"])
    assert cfg.lora is None
    assert load_run_config(["--config", _yaml(tmp_path, {"lora": True}, "l.yaml")]).lora == LoraSpec()
    with pytest.raises(ConfigError, match="--no-lora"):
        load_run_config(["--no-lora", "--lora-r", "4"])


def test_validation_errors_name_field_value_and_source(tmp_path):
    y = _yaml(tmp_path, {"grpo": {"clip_eps": -0.5}, "steps": 0})
    with pytest.raises(ConfigError) as ei:
        load_run_config(["--config", y, "--lr", "fast"])
    msg = str(ei.value)
    assert "grpo.clip_eps = -0.5" in msg and y in msg and "greater than 0" in msg
    assert "steps = 0" in msg
    assert "lr = 'fast' (from --lr)" in msg
    assert isinstance(ei.value, InvalidArgumentError) and isinstance(ei.value, ValueError)


def test_unknown_yaml_key_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"stepz.*unknown field"):
        load_run_config(["--config", _yaml(tmp_path, {"stepz": 3})])
    with pytest.raises(ConfigError, match=r"grpo.clip_epsilon.*unknown field"):
        load_run_config(["--config", _yaml(tmp_path, {"grpo": {"clip_epsilon": 0.1}})])


def test_unknown_flag_exits():
    with pytest.raises(SystemExit):
        load_run_config(["--stepz", "3"])


def test_bad_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_run_config(["--config", str(tmp_path / "missing.yaml")])
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_run_config(["--config", str(bad)])
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_run_config(["--config", str(lst)])


def test_model_path_is_checked(tmp_path):
    with pytest.raises(ConfigError, match=r"model = .*does not exist.*nothing is downloaded"):
        load_run_config(["--model", str(tmp_path / "nope")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        load_run_config(["--model", str(tmp_path / "empty")])
    (tmp_path / "ok").mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / "ok" / name).write_text("{}")
    assert load_run_config(["--model", str(tmp_path / "ok")]).model == str((tmp_path / "ok").resolve())


def test_a_hub_id_is_found_in_the_local_hub_cache_and_never_downloaded(tmp_path, monkeypatch):
    import huggingface_hub.constants

    hub = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")          # were anything fetched, this fails instead
    with pytest.raises(ConfigError, match=r"'acme/tiny-lm' is not in the local Hugging Face cache.*hf download"):
        load_run_config(["--model", "acme/tiny-lm"])
    snap = hub / "models--acme--tiny-lm" / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (hub / "models--acme--tiny-lm" / "refs").mkdir()
    (hub / "models--acme--tiny-lm" / "refs" / "main").write_text("0123abcd")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (snap / name).write_text("{}")
    assert load_run_config(["--model", "acme/tiny-lm"]).model == str(snap.resolve())
    (snap / "tokenizer.json").unlink()                 # a cached snapshot still has to be a whole checkpoint
    with pytest.raises(ConfigError, match="no tokenizer"):
        load_run_config(["--model", "acme/tiny-lm"])


def test_sizes_and_literals():
    assert load_run_config(["--pool-bytes", "2GiB"]).pool_bytes == "2GiB"
    with pytest.raises(ConfigError, match="pool_bytes"):
        load_run_config(["--pool-bytes", "lots"])
    with pytest.raises(ConfigError, match="switch"):
        load_run_config(["--switch", "magic"])
    with pytest.raises(ConfigError, match="loss_norm"):
        load_run_config(["--loss-norm", "batch"])
    cfg = load_run_config(["--switch", "timesplit"])
    assert cfg.effective_sleep_level == 1 and cfg.trainer_offload == "deepspeed"
    assert cfg.effective_weights_backup == "vllm"
    # a literal of numbers takes the number the flag names (the flag's string is not one of the choices)
    cfg = load_run_config(["--zero-stage", "3", "--sleep-level", "1"])
    assert cfg.zero_stage == 3 and cfg.sleep_level == 1 and cfg.deepspeed_config().zero_stage == 3
    with pytest.raises(ConfigError, match="zero_stage"):
        load_run_config(["--zero-stage", "1"])


def test_models_can_be_built_in_code():
    cfg = config_from_dict({"steps": 3, "grpo": {"group_size": 4}, "lora": {"r": 2}})
    assert isinstance(cfg, RunConfig) and cfg.grpo == GRPOConfig(group_size=4) and cfg.lora.r == 2
    assert GRPOConfig(clip_eps=0.2, clip_eps_high=0.3).clip_high == 0.3
    with pytest.raises(ConfigError):
        config_from_dict({"tensor_parallel_size": 2, "backend": "cpu"})


def test_every_flag_is_documented():
    from pathlib import Path

    from colomem.runner.config import _flag_table
    doc = (Path(__file__).resolve().parents[1] / "docs" / "colocated-training.md").read_text()
    missing = [f for f in _flag_table() if f"`{f}" not in doc and f"{f}`" not in doc and f"{f}," not in doc]
    assert not missing, f"flags missing from docs/colocated-training.md: {missing}"


def test_the_engine_choice_replaces_the_transport_options():
    # where vLLM runs decides how the weights get there: --engine (tests/test_inrank_engine_cpu.py)
    for gone in ({"sync_transport": "direct"}, {"engine_in_process": True}):
        with pytest.raises(ConfigError, match="unknown field"):
            config_from_dict(gone)
    with pytest.raises(ConfigError, match="zero_stage"):
        config_from_dict({"zero_stage": 1})


def test_a_model_dir_missing_weights_or_tokenizer_is_refused_with_the_config(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="has no weights"):
        config_from_dict({"model": str(tmp_path)})
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="has no tokenizer.*tokenizer.save_pretrained"):
        config_from_dict({"model": str(tmp_path)})
    (tmp_path / "tokenizer.json").write_text("{}")
    assert config_from_dict({"model": str(tmp_path)}).model == str(tmp_path.resolve())


def test_out_naming_a_file_is_a_config_error_not_a_traceback(tmp_path):
    from colomem.runner import run_job

    f = tmp_path / "taken"
    f.write_text("keep me")
    with pytest.raises(ConfigError, match="is a file"):
        run_job(config_from_dict({"backend": "cpu", "out": str(f)}), print_fn=lambda *_: None)
    assert f.read_text() == "keep me"


def test_every_shipped_config_loads():
    from pathlib import Path

    from colomem.grpo.tiny_model import SHAPES
    for path in sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml")):
        cfg = load_run_config(["--config", str(path)])
        assert cfg.model is not None or cfg.model_shape in SHAPES, path.name



def test_help_lists_every_option_without_failing():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "colomem.runner", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--offload" in out.stdout and "--rollout-sleep" in out.stdout and "--placement-margin" in out.stdout


def test_mapped_moments_reach_the_trainer_config_and_only_with_the_colomem_switch():
    cfg = load_run_config(["--optimizer-state-memory", "mapped"])
    assert cfg.deepspeed_config().optimizer_state_memory == "mapped"
    assert load_run_config([]).deepspeed_config().optimizer_state_memory == "torch"
    with pytest.raises(ConfigError, match="timesplit"):
        load_run_config(["--optimizer-state-memory", "mapped", "--switch", "timesplit"])
    with pytest.raises(ConfigError, match="optimizer_state_memory"):
        load_run_config(["--optimizer-state-memory", "everywhere"])


def test_every_flag_takes_its_own_default_written_out():
    """Each flag given its default as text (what --help shows) parses back to that default: numbers, literals
    of numbers, booleans, lists."""
    from colomem.runner.config import _SUBMODELS, _flag_table

    checked = 0
    for flag, path in _flag_table().items():
        model = RunConfig if len(path) == 1 else _SUBMODELS[path[0]]
        default = model.model_fields[path[-1]].get_default(call_default_factory=True)
        if default is None or isinstance(default, dict):
            continue
        text = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        value = load_run_config((["--lora"] if path[0] == "lora" else []) + [flag, text])
        for name in path:
            value = getattr(value, name)
        as_list = (lambda v: list(v) if isinstance(v, tuple) else v)  # noqa: E731
        assert as_list(value) == as_list(default), (flag, text, value)
        checked += 1
    assert checked > 50
