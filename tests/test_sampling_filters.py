"""top_k and min_p (TRL's and vLLM's sampling filters): vLLM's requests carry them only where they filter
something (and never for greedy decoding), the CPU rollout samples with them, and bad values are refused."""
import pytest

from colomem.engines.protocols import check_sampling
from colomem.errors import ConfigError, InvalidArgumentError
from colomem.runner.config import config_from_dict
from fakes.vllm import install_vllm_stubs
from runner_cpu_helpers import awake_cpu_rollout


def test_vllm_requests_carry_the_filters_only_where_they_filter(monkeypatch):
    from colomem.engines.vllm.sampling import requests

    install_vllm_stubs(monkeypatch)
    common = dict(n=2, max_new_tokens=4, seed=0, stop_token_ids=None, ignore_eos=False, logprobs=True)
    (p,), _ = requests([[1, 2]], temperature=1.0, top_p=0.9, top_k=20, min_p=0.05, **common)
    assert p.top_k == 20 and p.min_p == 0.05 and p.top_p == 0.9
    (p,), _ = requests([[1, 2]], temperature=1.0, top_p=1.0, **common)
    assert not hasattr(p, "top_k") and not hasattr(p, "min_p")           # vLLM's defaults: no filter
    (p,), _ = requests([[1, 2]], temperature=0.0, top_p=0.5, top_k=5, min_p=0.3, **common)
    assert p.top_p == 1.0 and not hasattr(p, "top_k") and not hasattr(p, "min_p")   # greedy


@pytest.mark.parametrize("args", [(1.0, 1.0, 0, 0.0), (1.0, 1.0, True, 0.0), (1.0, 1.0, None, 1.0),
                                  (1.0, 1.0, None, -0.1), (1.0, 0.0, None, 0.0), (-1.0, 1.0, None, 0.0)])
def test_out_of_range_knobs_are_refused(args):
    with pytest.raises(InvalidArgumentError):
        check_sampling(*args)


def test_the_flags_are_checked_with_the_config():
    assert config_from_dict({"grpo": {"top_k": 50, "min_p": 0.05}}).grpo.top_k == 50
    with pytest.raises(ConfigError, match="top_k"):
        config_from_dict({"grpo": {"top_k": 0}})
    with pytest.raises(ConfigError, match="min_p"):
        config_from_dict({"grpo": {"min_p": 1.0}})


def test_the_cpu_rollout_samples_within_the_filters(job_env, tmp_path):
    c = config_from_dict({"backend": "cpu", "out": str(tmp_path), "progress": False, "report_to": ["none"]})
    with awake_cpu_rollout(c) as (eng, tok, _):
        r = eng.rollout
        prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in (">345", ">78")]
        greedy = r.generate(prompts, n=1, max_new_tokens=4, temperature=0.0, top_p=1.0, seed=0)
        top1 = r.generate(prompts, n=3, max_new_tokens=4, temperature=1.5, top_p=1.0, seed=7, top_k=1)
        assert all(c.token_ids == g[0].token_ids for g, group in zip(greedy, top1) for c in group)
        # min_p close to 1 keeps the most likely token alone too
        near = r.generate(prompts, n=3, max_new_tokens=4, temperature=1.5, top_p=1.0, seed=7, min_p=0.999)
        assert all(c.token_ids == g[0].token_ids for g, group in zip(greedy, near) for c in group)
        free = r.generate(prompts, n=8, max_new_tokens=4, temperature=3.0, top_p=1.0, seed=7)
        assert any(c.token_ids != g[0].token_ids for g, group in zip(greedy, free) for c in group)
        assert len(top1[0][0].logprobs) == len(top1[0][0].token_ids)


def test_vllm_requests_carry_a_repetition_penalty_greedy_ones_too(monkeypatch):
    from colomem.engines.vllm.sampling import requests

    install_vllm_stubs(monkeypatch)
    common = dict(n=2, max_new_tokens=4, seed=0, stop_token_ids=None, ignore_eos=False, logprobs=True, top_p=1.0)
    for temperature in (1.0, 0.0):                  # greedy too: the penalty moves the argmax
        (p,), _ = requests([[1, 2]], temperature=temperature, repetition_penalty=1.3, **common)
        assert p.repetition_penalty == 1.3
    (p,), _ = requests([[1, 2]], temperature=1.0, **common)
    assert not hasattr(p, "repetition_penalty")     # vLLM's default: none


def test_a_repetition_penalty_out_of_range_is_refused():
    for bad in (0.0, -1.0):
        with pytest.raises(InvalidArgumentError, match="repetition_penalty"):
            check_sampling(1.0, 1.0, None, 0.0, bad)
    assert config_from_dict({"grpo": {"repetition_penalty": 1.1}}).grpo.repetition_penalty == 1.1
    with pytest.raises(ConfigError, match="repetition_penalty"):
        config_from_dict({"grpo": {"repetition_penalty": 0}})


def test_the_cpu_penalty_reads_each_rows_own_tokens_never_its_left_padding():
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    from colomem.engines.hf_rollout import _penalty_over_own_tokens

    pad = 0                                          # the pad token, here also a token the model could emit
    rows = [[5, 6, 5], [7], [3, 4, 6, 8]]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    scores = torch.randn(len(rows), 10)
    scores[:, pad] = 2.0                             # a positive logit: penalizing it would lower it
    got = _penalty_over_own_tokens(1.5, torch.tensor([width - len(r) for r in rows]))(ids, scores.clone())
    for i, r in enumerate(rows):                     # each row as transformers penalizes it unpadded
        want = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([r]), scores[i:i + 1].clone())
        assert torch.equal(got[i:i + 1], want)
    assert got[1, pad] == 2.0                        # a padded row's pad token is not penalized


def test_the_cpu_rollout_decodes_a_padded_batch_with_the_penalty_as_each_prompt_alone(job_env, tmp_path):
    c = config_from_dict({"backend": "cpu", "out": str(tmp_path), "progress": False, "report_to": ["none"]})
    with awake_cpu_rollout(c) as (eng, tok, _):
        r = eng.rollout
        prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in (">34599", ">7", ">12")]
        kw = dict(n=1, max_new_tokens=6, temperature=0.0, top_p=1.0, seed=0)
        batch = r.generate(prompts, repetition_penalty=4.0, **kw)
        alone = [r.generate([p], repetition_penalty=4.0, **kw)[0] for p in prompts]
        assert [g[0].token_ids for g in batch] == [g[0].token_ids for g in alone]
        plain = r.generate(prompts, **kw)
        assert [g[0].token_ids for g in batch] != [g[0].token_ids for g in plain], "the penalty changed nothing"
