"""The examples work as examples/README.md says: the dataset script, and a short run of the chat example's
command on the CPU backend."""
import importlib.util
import json
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
DATA_OUT = "examples/data/out"          # the script's default folder, as the README's command names it


def _script():
    spec = importlib.util.spec_from_file_location("make_datasets", EXAMPLES / "data" / "make_datasets.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _readme_command() -> list[str]:
    """The arguments of the colomem-grpo command in the block after `<!-- chat-example-command -->`."""
    text = (EXAMPLES / "README.md").read_text()
    block = text.split("<!-- chat-example-command -->", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    words = shlex.split(block.replace("\\\n", " "))
    cut = words.index("colomem-grpo")
    assert words[:cut] == ["python", "examples/data/make_datasets.py", "&&"], words[:cut]
    return words[cut + 1:]


def test_the_dataset_script_is_seeded_and_its_files_read_back(tmp_path):
    from colomem.grpo.dataset_task import DatasetTask

    make = _script()
    make.main([str(tmp_path / "a"), "--train", "40", "--eval", "8"])
    make.main([str(tmp_path / "b"), "--train", "40", "--eval", "8"])
    make.main([str(tmp_path / "c"), "--train", "40", "--eval", "8", "--seed", "1"])
    names = sorted(p.relative_to(tmp_path / "a").as_posix() for p in (tmp_path / "a").rglob("*.jsonl"))
    assert names == ["count-chat/eval.jsonl", "count-chat/train.jsonl", "math/eval.jsonl", "math/train.jsonl"]
    for n in names:
        assert (tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes()     # same seed, same rows
    assert (tmp_path / "a" / names[1]).read_bytes() != (tmp_path / "c" / names[1]).read_bytes()

    chat = DatasetTask(str(tmp_path / "a" / "count-chat" / "train.jsonl"))
    assert len(chat) == 40
    for row in chat._rows:
        system, user = row["prompt"]
        assert (system["role"], user["role"]) == ("system", "user") and user["content"].isdigit()
        last = int(user["content"][-1])
        assert row["answer"] == f"{(last + 1) % 10}{(last + 2) % 10}"      # counting on, 9 wraps to 0



def test_the_chat_template_writes_only_characters_the_config_built_tokenizer_has(tmp_path):
    from colomem.grpo.dataset_task import DatasetTask
    from colomem.grpo.tiny_model import build_tokenizer

    _script().main([str(tmp_path), "--train", "30", "--eval", "4"])
    task = DatasetTask(str(tmp_path / "count-chat" / "train.jsonl"), max_new_tokens=3)
    tok = build_tokenizer(task.alphabet)            # as the config-built model's tokenizer is made
    task.bind(tok, chat_template=str(EXAMPLES / "chat" / "template.jinja"), log=lambda *_: None)
    for s in task.samples(len(task), seed=0, step=0):
        ids = tok(s.prompt, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids, s.prompt
        assert tok.convert_ids_to_tokens(ids)[-12:] == ["<eos>", *"assistant: "]

def test_the_math_dataset_is_scored_by_math_answer(tmp_path):
    pytest.importorskip("math_verify")
    import datasets

    from colomem.grpo.rewards import resolve

    _script().main([str(tmp_path), "--train", "8", "--eval", "30"])
    rows = datasets.load_dataset("json", data_files=str(tmp_path / "math" / "eval.jsonl"), split="train")
    assert all(isinstance(p, str) and "\\boxed{}" in p for p in rows["prompt"])
    fn = resolve("math_answer")
    right = [f"The answer is \\boxed{{{a}}}." for a in rows["answer"]]
    assert fn(rows["prompt"], right, answer=rows["answer"]) == [1.0] * len(rows)        # every gold parses
    wrong = [f"\\boxed{{{a}1}}" for a in rows["answer"]]
    assert fn(rows["prompt"], wrong, answer=rows["answer"]) == [0.0] * len(rows)


def test_the_chat_example_runs_as_its_readme_says(job_env, tmp_path, monkeypatch):
    from colomem.runner import run_job
    from colomem.runner.config import load_run_config

    data = tmp_path / "data"
    _script().main([str(data), "--train", "64", "--eval", "8"])
    args = [a.replace(DATA_OUT, str(data)) for a in _readme_command()]
    assert any(str(data) in a for a in args), "the README's command reads the script's default folder"
    monkeypatch.chdir(ROOT)                       # the command's other paths are relative to the checkout
    steps = 3
    cfg = load_run_config(args + ["--steps", str(steps), "--prompts-per-step", "8", "--out", str(tmp_path / "run"),
                                  "--progress", "false", "--report-to", "none", "--plots", "false"])
    assert cfg.chat_template.endswith("template.jinja") and cfg.backend == "cpu"
    res = run_job(cfg, print_fn=lambda *_: None)
    assert res.summary["status"] == "ok" and res.summary["steps_done"] == steps

    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step_rows = [r for r in lines if "step" in r and "reward_mean" in r]
    assert [r["step"] for r in step_rows] == list(range(steps))
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in step_rows)
    samples = [s for r in step_rows for s in r["samples"]]
    assert samples and all(0.0 <= s["reward"] <= 1.0 for s in samples)
    for s in samples:                            # rendered through the template: its markers are in the prompt
        assert s["prompt"].startswith("system: ") and s["prompt"].endswith("<eos>assistant: ")
        assert "<eos>user: " in s["prompt"]

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(res.summary["model"])
    ids = tok(samples[0]["prompt"], add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids           # every character the template writes has its own token
    assert ids.count(tok.eos_token_id) == 2      # the EOS closes each turn as one token


def test_the_chat_example_from_python_runs_and_evaluates(job_env, tmp_path):
    spec = importlib.util.spec_from_file_location("chat_train", EXAMPLES / "chat" / "train.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.run(steps=2, backend="cpu", prompts_per_step=4, eval_prompts=8, out=str(tmp_path / "run"),
                  progress=False, report_to=["none"], plots=False, print_fn=lambda *_: None)
    s = res.summary
    assert s["status"] == "ok" and s["steps_done"] == 2
    assert 0.0 <= s["eval_first"]["eval/reward_mean"] <= 1.0 and s["eval_last"] is not s["eval_first"]
    assert s["config"]["rewards"] == ["rewards:digits_in_place"]
