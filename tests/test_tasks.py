"""Built-in tasks: seeded prompts, correct answers, a tokenizer that covers them, the tiny model directory."""
import json

import pytest

from colomem.errors import InvalidArgumentError
from colomem.grpo.rewards import char_match, exact_match
from colomem.grpo.tasks import SYMBOLS, make_task
from colomem.grpo.tiny_model import SHAPES, build_tokenizer, model_dir, model_key


def test_successor_answers_continue_the_count():
    t = make_task("successor")
    for s in t.samples(50, seed=3, step=7):
        assert s.prompt[0] == ">" and len(s.prompt) == 4 and len(s.answer) == 2
        seq = s.prompt[1:] + s.answer
        for a, b in zip(seq, seq[1:]):
            assert int(b) == (int(a) + 1) % 10
        assert s.meta["answer"] == s.answer
        assert exact_match(s.prompt, s.answer, **s.meta) == 1.0
        assert char_match(s.prompt, s.answer, **s.meta) == 1.0
    assert t.max_new_tokens == 3                      # two symbols + EOS


def test_prompts_depend_only_on_seed_and_step():
    t = make_task("successor")
    a = t.samples(16, seed=0, step=5)
    assert a == t.samples(16, seed=0, step=5)        # every rank draws the same prompts
    assert a != t.samples(16, seed=0, step=6)
    assert a != t.samples(16, seed=1, step=5)


def test_task_options_and_alphabet():
    t = make_task("successor", {"base": 16, "prompt_len": 2, "answer_len": 3})
    assert t.alphabet == SYMBOLS[:16] + ">"
    for s in t.samples(20, seed=0, step=0):
        assert set(s.prompt + s.answer) <= set(t.alphabet) and len(s.answer) == 3
    c = make_task("copy", {"length": 4})
    s = c.samples(1, seed=0, step=0)[0]
    assert s.prompt == s.answer + ">"
    with pytest.raises(InvalidArgumentError, match="unknown task"):
        make_task("sorting")
    with pytest.raises(InvalidArgumentError, match="task_options"):
        make_task("successor", {"bogus": 1})
    with pytest.raises(InvalidArgumentError, match="base"):
        make_task("successor", {"base": 99})


def test_char_tokenizer_round_trips_and_pads_the_vocabulary():
    tok = build_tokenizer("0123456789>", vocab_size=24)
    assert len(tok) == 24
    ids = tok(">3456", add_special_tokens=False)["input_ids"]
    assert len(ids) == 5 and tok.decode(ids) == ">3456"
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == ">3456"
    assert tok.decode([20]) == "<r20>"                 # reserved ids decode too
    assert tok.eos_token_id == 1 and tok.pad_token_id == 0
    # ids are fixed: specials first, then the sorted alphabet
    assert tok.convert_tokens_to_ids(["0", ">"]) == [3, 13]
    with pytest.raises(InvalidArgumentError):
        build_tokenizer("")


def test_tiny_model_directory_is_cached_by_config(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoTokenizer

    t = make_task("successor")
    d = model_dir("tiny", t.alphabet, cache_dir=tmp_path, log=lambda *_: None)
    assert (d / "config.json").is_file() and (d / "tokenizer.json").is_file() and (d / "done").is_file()
    assert any(p.suffix == ".safetensors" for p in d.iterdir())
    info = json.loads((d / "colomem_model.json").read_text())
    assert info["vocab_size"] == 16 and info["params"] > 1_000_000
    cfg = AutoConfig.from_pretrained(d)
    assert cfg.model_type == "qwen2" and cfg.hidden_size == 256 and cfg.num_hidden_layers == 4
    tok = AutoTokenizer.from_pretrained(d)
    assert cfg.eos_token_id == tok.eos_token_id and cfg.vocab_size == len(tok)
    mtime = (d / "done").stat().st_mtime_ns
    assert model_dir("tiny", t.alphabet, cache_dir=tmp_path) == d and (d / "done").stat().st_mtime_ns == mtime
    assert model_key("tiny", t.alphabet, 0, "bfloat16") != model_key("tiny", t.alphabet, 1, "bfloat16")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []     # no temp dirs left


def test_benchmark_shape_is_qwen2_1p5b():
    s = SHAPES["qwen2-1.5b"]
    h, L, V, I = s["hidden_size"], s["num_hidden_layers"], s["vocab_size"], s["intermediate_size"]
    kv = h // s["num_attention_heads"] * s["num_key_value_heads"]
    per_layer = h * h * 2 + h * kv * 2 + (h + 2 * kv) + 3 * h * I + 2 * h
    total = V * h + L * per_layer + h
    assert total == pytest.approx(1.544e9, rel=0.01)
