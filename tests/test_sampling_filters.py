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
