"""A job from the user's dataset: JSONL with chat prompts, a chat template, extra columns to the rewards."""
import json
import random

import pytest

from colomem.errors import ConfigError
from colomem.grpo.dataset_task import DatasetTask
from colomem.runner import run_job
from colomem.runner.config import config_from_dict

TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}>{% endif %}")   # the successor task's prompt format: "345" + ">"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def successor_rows(n, chat=True, seed=0):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a = rng.randrange(10)
        digits = "".join(str((a + i) % 10) for i in range(3))
        answer = "".join(str((a + 3 + i) % 10) for i in range(2))
        prompt = [{"role": "user", "content": digits}] if chat else digits + ">"
        rows.append({"prompt": prompt, "answer": answer, "source": "synthetic"})
    return rows


def test_a_chat_dataset_job_runs_and_its_columns_reach_the_rewards(job_env, tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", successor_rows(24))
    tpl = tmp_path / "chat.jinja"
    tpl.write_text(TEMPLATE)
    seen = []

    def with_columns(prompt, completion, *, answer, source, **meta):
        seen.append((prompt, source))
        return 1.0 if completion.strip() == answer else 0.0

    cfg = config_from_dict({"backend": "cpu", "steps": 2, "prompts_per_step": 4, "micro_batch": 8,
                            "progress": False, "out": str(tmp_path / "run"), "dataset": str(data),
                            "chat_template": str(tpl), "rewards": ["exact_match"],
                            "grpo": {"group_size": 4, "max_new_tokens": 3}})
    res = run_job(cfg, reward_fns=[with_columns], print_fn=lambda *_: None)
    assert res.summary["status"] == "ok" and res.summary["steps_done"] == 2
    assert len(seen) == 2 * 4 * 4 and all(s == "synthetic" for _, s in seen)
    assert all(len(p) == 4 and p.endswith(">") for p, _ in seen)        # rendered through the template


def test_steps_walk_shuffled_epochs_with_the_seed(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", successor_rows(5, chat=False))

    class Tok:
        chat_template = None

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": list(text)}

    t = DatasetTask(str(data), max_new_tokens=3)
    t.bind(Tok(), log=lambda *_: None)
    epoch0 = [s.prompt for k in range(5) for s in t.samples(1, seed=0, step=k)]
    assert sorted(epoch0) == sorted(r["prompt"] for r in successor_rows(5, chat=False))   # each row once
    again = DatasetTask(str(data), max_new_tokens=3)
    again.bind(Tok(), log=lambda *_: None)
    assert [s.prompt for s in again.samples(5, seed=0, step=0)] == epoch0                 # same seed, same order
    assert len(t.samples(3, seed=0, step=3)) == 3                                          # across the epoch end
    with pytest.raises(ConfigError, match="every prompt.*longer than 3 tokens"):
        DatasetTask(str(data), max_new_tokens=3).bind(Tok(), max_prompt_tokens=3, log=lambda *_: None)
    mixed = write_jsonl(tmp_path / "m.jsonl", successor_rows(4, chat=False) + [{"prompt": "9" * 50, "answer": "0"}])
    said = []
    t = DatasetTask(str(mixed), max_new_tokens=3)
    t.bind(Tok(), max_prompt_tokens=8, log=said.append)
    assert t.dropped == 1 and len(t) == 4 and "1 of 5 prompts" in said[0]


def test_bad_datasets_are_clear_errors_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        DatasetTask(str(tmp_path / "nope.jsonl"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="empty|cannot be read"):
        DatasetTask(str(empty))
    data = write_jsonl(tmp_path / "d.jsonl", successor_rows(3))
    with pytest.raises(ConfigError, match="no column 'question'.*--prompt-key"):
        DatasetTask(str(data), prompt_key="question")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": [{"role": "user"}], "answer": "1"}])
    with pytest.raises(ConfigError, match="not chat messages"):
        DatasetTask(str(bad))
    with pytest.raises(ConfigError, match="needs --rewards"):
        config_from_dict({"dataset": str(data), "grpo": {"max_new_tokens": 3}})
    with pytest.raises(ConfigError, match="needs --max-new-tokens"):
        config_from_dict({"dataset": str(data), "rewards": ["exact_match"]})

    class NoTemplate:
        chat_template = None

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": list(text)}

    with pytest.raises(ConfigError, match="no chat template"):
        DatasetTask(str(data), max_new_tokens=3).bind(NoTemplate(), log=lambda *_: None)


def test_a_trl_reward_file_with_unscorable_samples_runs(job_env, tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", successor_rows(16, chat=False))
    rewards = tmp_path / "trl_rewards.py"
    rewards.write_text("def accuracy(prompts, completions, answer, **kwargs):\n"
                       "    return [None if i % 4 == 3 else float(c.strip() == a)\n"
                       "            for i, (c, a) in enumerate(zip(completions, answer))]\n")
    cfg = config_from_dict({"backend": "cpu", "steps": 2, "prompts_per_step": 4, "micro_batch": 8,
                            "progress": False, "out": str(tmp_path / "run"), "dataset": str(data),
                            "rewards": [f"{rewards}:accuracy"], "grpo": {"group_size": 4, "max_new_tokens": 3}})
    res = run_job(cfg, print_fn=lambda *_: None)
    assert res.summary["status"] == "ok"
    assert all(r.metrics["unscorable_frac"] == 0.25 for r in res.records)


def test_a_template_of_your_own_gets_a_token_for_every_character_it_writes(tmp_path):
    """With the config-built model, the characters of a --chat-template file's text and strings join the
    tokenizer's alphabet, so a template's own markers never read as <unk>."""
    from colomem.errors import ConfigError
    from colomem.grpo.tiny_model import build_tokenizer
    from colomem.grpo.dataset_task import template_characters

    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}[[{{ m['role'] }}|{{ m['content'] }}]]{% endfor %}"
                   "{% if add_generation_prompt %}{{ '@bot>' }}{% endif %}\n")
    chars = template_characters(str(tpl))
    assert set("[]|@bot>") <= set(chars) and "\n" not in chars
    tok = build_tokenizer("12user" + chars)            # the messages' own characters come from the dataset
    tok.chat_template = tpl.read_text()
    text = tok.apply_chat_template([{"role": "user", "content": "12"}], tokenize=False, add_generation_prompt=True)
    assert tok.unk_token_id not in tok(text, add_special_tokens=False)["input_ids"]
    assert template_characters("auto") == ""
    tpl.write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match="t.jinja"):
        template_characters(str(tpl))
