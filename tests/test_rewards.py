"""Reward functions: built-ins, and clear errors for reward functions that misbehave."""
import math
import sys
import types

import pytest
import torch

from colomem.errors import ColomemError, InvalidArgumentError
from colomem.grpo.rewards import (RewardFunctionError, RewardSpec, batched, char_match, compute_rewards,
                                  exact_match, format_reward, regex_match, resolve, score)


def test_exact_match():
    assert exact_match("p", " 42 ", answer="42") == 1.0
    assert exact_match("p", "421", answer="42") == 0.0


@pytest.mark.parametrize("completion,want", [("67", 1.0), ("6", 0.5), ("68", 0.5), ("678", 2 / 3), ("", 0.0),
                                             ("76", 0.0)])
def test_char_match_partial_credit(completion, want):
    assert char_match(">345", completion, answer="67") == pytest.approx(want)


def test_regex_and_format():
    r = regex_match(r"\d+")
    assert r("p", "abc 12") == 1.0 and r("p", "abc") == 0.0
    f = format_reward(r"<a>\d+</a>")
    assert f("p", " <a>12</a> ") == 1.0 and f("p", "<a>12</a> tail") == 0.0
    g = format_reward()                                  # pattern from the sample's `format` field
    assert g("p", "123", format=r"[0-9]+") == 1.0 and g("p", "12a", format=r"[0-9]+") == 0.0


def test_compute_rewards_weights_and_parts():
    specs = [RewardSpec(char_match), RewardSpec(exact_match, weight=2.0)]
    total, parts = compute_rewards(specs, ["a", "b"], ["67", "6"], [{"answer": "67"}, {"answer": "67"}])
    assert total == pytest.approx([1.0 + 2.0, 0.5])
    assert parts == {"char_match": [1.0, 0.5], "exact_match": [1.0, 0.0]}


def test_batched_reward_fn():
    @batched
    def lengths(prompts, completions, answer):
        assert answer == ["x", "y"]
        return [float(len(c)) for c in completions]
    assert score(RewardSpec(lengths), ["p", "q"], ["ab", "c"], [{"answer": "x"}, {"answer": "y"}]) == [2.0, 1.0]


def _run(fn, completions=("67", "boom")):
    metas = [{"answer": "67"}] * len(completions)
    return compute_rewards([RewardSpec(fn)], ["p"] * len(completions), list(completions), metas)


def test_raising_reward_fn_names_function_and_sample():
    def picky(prompt, completion, **meta):
        if completion == "boom":
            raise KeyError("no such thing")
        return 1.0
    with pytest.raises(RewardFunctionError) as ei:
        _run(picky)
    msg = str(ei.value)
    assert "picky" in msg and "sample 1" in msg and "'boom'" in msg and "KeyError" in msg
    assert isinstance(ei.value, ColomemError) and isinstance(ei.value.__cause__, KeyError)


@pytest.mark.parametrize("value,what", [("1.0", "str"), ({"r": 1.0}, "dict"), ([1.0], "list")])  # None: not scorable
def test_non_float_return_is_refused(value, what):
    def bad(prompt, completion, **meta):
        return value
    with pytest.raises(RewardFunctionError, match=rf"'bad' returned {what}.*sample 0"):
        _run(bad)


def test_tensor_and_nan_returns_are_refused():
    with pytest.raises(RewardFunctionError, match=r"tensor.*\.item\(\)"):
        _run(lambda p, c, **m: torch.tensor(1.0))
    with pytest.raises(RewardFunctionError, match="finite"):
        _run(lambda p, c, **m: math.nan)


def test_ints_bools_and_numpy_floats_are_accepted():
    np = pytest.importorskip("numpy")
    assert _run(lambda p, c, **m: 1)[0] == [1.0, 1.0]
    assert _run(lambda p, c, **m: c == "67")[0] == [1.0, 0.0]
    assert _run(lambda p, c, **m: np.float32(0.5))[0] == [0.5, 0.5]


def test_batched_wrong_count_and_raise():
    @batched
    def short(prompts, completions, **meta):
        return [1.0]
    with pytest.raises(RewardFunctionError, match=r"'short' returned 1 values for 2 samples"):
        _run(short)

    @batched
    def broken(prompts, completions, **meta):
        raise ValueError("bad input")
    with pytest.raises(RewardFunctionError, match=r"'broken' raised ValueError: bad input"):
        _run(broken)

    @batched
    def scalar(prompts, completions, **meta):
        return 1.0
    with pytest.raises(RewardFunctionError, match="list of 2 floats"):
        _run(scalar)


def test_resolve_builtins_and_module_function(monkeypatch):
    assert resolve("exact_match") is exact_match
    mod = types.ModuleType("my_rewards_mod")
    mod.shout = lambda prompt, completion, **m: float(completion.isupper())
    monkeypatch.setitem(sys.modules, "my_rewards_mod", mod)
    assert resolve("my_rewards_mod:shout")("p", "AB") == 1.0
    with pytest.raises(InvalidArgumentError, match="unknown reward"):
        resolve("nope")
    with pytest.raises(InvalidArgumentError, match="cannot import"):
        resolve("no_such_module_xyz:fn")
    with pytest.raises(InvalidArgumentError, match="no reward functions"):
        compute_rewards([], [], [], [])


def test_user_rewards_from_the_working_directory_and_from_a_file(tmp_path, monkeypatch):
    import sys

    from colomem.grpo.rewards import resolve

    (tmp_path / "my_rewards_cwd.py").write_text("def short_and_right(prompt, completion, **meta):\n"
                                                "    return 1.0 if len(completion) < 5 else 0.0\n")
    sub = tmp_path / "elsewhere"
    sub.mkdir()
    (sub / "file_rewards.py").write_text("def longer(prompt, completion, **meta):\n    return float(len(completion))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert resolve("my_rewards_cwd:short_and_right")("p", "abc") == 1.0          # the guide's example
    assert resolve(str(sub / "file_rewards.py") + ":longer")("p", "abc") == 3.0   # an absolute file path
    assert resolve("./elsewhere/file_rewards.py:longer")("p", "ab") == 2.0        # a relative one
    with pytest.raises(InvalidArgumentError, match="has no 'nope'"):
        resolve("./elsewhere/file_rewards.py:nope")
    with pytest.raises(InvalidArgumentError, match="cannot import"):
        resolve("./missing.py:fn")


def test_a_trl_reward_function_works_unchanged_and_none_means_not_scorable():
    from colomem.grpo.rewards import compute_rewards, is_batched

    calls = []

    def trl_style(prompts, completions, **kwargs):        # TRL's signature, no marker
        calls.append(sorted(kwargs))
        return [None if c == "?" else float(len(c)) for c in completions]

    def per_sample(prompt, completion, **meta):
        return None if completion in ("?", "x") else 1.0

    assert is_batched(trl_style) and not is_batched(per_sample)
    metas = [{"answer": "1", "solution": "a"}] * 3
    total, parts = compute_rewards([RewardSpec(trl_style), RewardSpec(per_sample, weight=2.0)],
                                   ["p"] * 3, ["ab", "?", "x"], metas)
    assert calls == [["answer", "solution"]]            # the dataset's columns arrive as keywords
    assert total == [2.0 + 2.0, None, 1.0]              # a None leaves its function out; all None: not scorable
    assert parts["trl_style"] == [2.0, None, 1.0]


def test_unscorable_samples_get_zero_advantage_and_leave_the_group_statistics():
    import torch

    from colomem.grpo.advantages import group_advantages

    full = group_advantages([0.0, 1.0, 1.0], 3)
    masked = group_advantages([0.0, 1.0, 1.0, 123.0], 4, scorable=[True, True, True, False])
    assert torch.allclose(masked[:3], full) and masked[3] == 0
    assert torch.equal(group_advantages([1.0, 1.0, 5.0, 2.0], 4, scorable=[True, True, False, False]),
                       torch.zeros(4))                   # the scorable ones agree: no signal
    assert torch.equal(group_advantages([0.0, 1.0], 2, scorable=[True, True]), group_advantages([0.0, 1.0], 2))


# ------------------------------------------------------------------------------------------------ math_answer
@pytest.fixture(scope="module")
def math_answer():
    pytest.importorskip("math_verify")
    return resolve("math_answer")


@pytest.mark.parametrize("completion,gold,want", [
    (r"so the sum is \boxed{12}.", "12", 1.0),                      # boxed
    (r"\boxed{7} and then 9", "7", 1.0),                             # a boxed answer wins over a later number
    ("3 + 4 = 7", "7", 1.0),                                         # plain final number
    ("first 7, then 9", "7", 0.0),                                   # the last one is the answer
    ("0.5", "1/2", 1.0), (r"\frac{1}{2}", "0.5", 1.0), ("3/4", r"\frac{3}{4}", 1.0),   # equal in value
    ("8", "7", 0.0), ("", "7", 0.0), ("seven", "7", 0.0),            # wrong or no answer
    ("7", "no number here", None), ("7", "", None),                  # gold unparsable: not scorable
])
def test_math_answer_compares_final_answers_by_value(math_answer, completion, gold, want):
    assert math_answer(["p"], [completion], answer=[gold]) == [want]


def test_math_answer_batched_with_trl_column_names_in_the_score_thread(math_answer):
    import threading

    from colomem.grpo.rewards import is_batched

    assert is_batched(math_answer)
    metas = [{"solution": r"It is \boxed{3}."}, {"ground_truth": "-2"}, {"answer": 5}, {"answer": "x y z"}]
    got = {}
    # the runner scores on a helper thread, where math-verify's signal-based timeouts cannot work alone
    t = threading.Thread(target=lambda: got.setdefault("v", score(RewardSpec(math_answer), ["p"] * 4,
                                                                  ["3", "-2", "6", "1"], metas)))
    t.start()
    t.join(60)
    assert got["v"] == [1.0, 1.0, 0.0, None]
    with pytest.raises(RewardFunctionError, match="needs the gold answer in a column"):
        score(RewardSpec(math_answer), ["p"], ["1"], [{"question": "?"}])


def test_math_answer_is_bounded(math_answer):
    from colomem.grpo.rewards import _VerifierProcess

    assert math_answer(["p"], [r"\boxed{9^{9^{9^{9}}}}"], answer=["1"]) == [0.0]   # math-verify's own timeout
    slow = _VerifierProcess()
    with pytest.raises(RewardFunctionError, match="longer than 0.001 s"):       # past the batch bound: stopped
        slow.run([("1", "1")], 2, 2, bound_s=0.001)
    assert slow._pool is None


def test_math_answer_without_math_verify_fails_when_resolved(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    with pytest.raises(InvalidArgumentError, match=r"pip install 'colomem\[grpo\]'"):
        resolve("math_answer")
