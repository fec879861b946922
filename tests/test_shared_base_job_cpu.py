"""--shared-base on the CPU backend: the trainer's base is the rollout's own tensors (one copy), the rollout
serves the trainer's adapter, a write into the base is caught, the offload never moves the base, and the
combinations that cannot share are refused before anything starts."""
import json

import pytest
import torch

from colomem.errors import BaseWrittenError, InvalidArgumentError
from colomem.runner.config import ConfigError, config_from_dict

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
LORA = {"r": 4, "alpha": 8, "dropout": 0.0}


def job(out, **kw):
    data = {"backend": "cpu", "steps": 3, "prompts_per_step": 4, "micro_batch": 8, "progress": False,
            "plots": False, "report_to": ["none"], "out": str(out), "grpo": {"group_size": 4},
            "lora": dict(LORA), "shared_base": True, **kw}
    return config_from_dict(data)


@pytest.fixture
def engines(job_env, tmp_path):
    """HFRollout serving an adapter + TorchTrainer on its base, built the way the runner builds them."""
    from transformers import AutoTokenizer

    from colomem.grpo.tasks import make_task
    from colomem.grpo.tiny_model import model_dir
    from colomem.runner.backends import build_engines, close_engines
    from colomem.runner.ranks import Ranks

    cfg = job(tmp_path / "run")
    d = model_dir("tiny", make_task("successor").alphabet, log=lambda *_: None)
    tok = AutoTokenizer.from_pretrained(str(d))
    e = build_engines(cfg, "cpu", str(d), tok, Ranks(), grad_accum=1)
    yield e, d
    close_engines(e)


def _unique_bytes(*models):
    seen = {}
    for m in models:
        for p in m.parameters():
            st = p.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _base(model):
    return {n: p for n, p in model.named_parameters() if ".lora_" not in n}


def test_the_trainer_holds_no_base_of_its_own_and_the_rollout_serves_its_adapter(engines):
    e, d = engines
    rollout, trainer = e.rollout, e.trainer
    base = rollout.base_parameters()
    # every base parameter of the trainer is one of the rollout's tensors
    ptrs = {t.data_ptr() for t in base.values()}
    assert all(p.data_ptr() in ptrs and not p.requires_grad for p in _base(trainer.model).values())
    adapter = sum(p.numel() * p.element_size() for n, p in trainer.model.named_parameters() if ".lora_" in n)
    assert _unique_bytes(rollout.model, trainer.model) == _unique_bytes(rollout.model) + adapter
    assert e.shared.nbytes == sum(t.numel() * t.element_size() for t in {id(t): t for t in base.values()}.values())

    # the trainer's adapter moves (as training would), the sync carries the adapter alone
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in trainer.model.named_parameters():
            if ".lora_" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
    sent = list(trainer.named_weights())
    assert sent and all(".lora_" in n for n, _ in sent)
    rollout.load_weights(sent, version=1)
    rollout.check()
    rollout.wake_kv()
    ids = torch.tensor([[1, 4, 6, 3, 7, 2]])
    trainer.model.eval()
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits
        got = rollout.model(input_ids=ids).logits
    assert torch.equal(got, want)              # base + the trainer's adapter, the same ops on the same bytes
    out = rollout.generate([[1, 4, 6]], n=1, max_new_tokens=6, temperature=0.0)[0][0]
    with torch.no_grad():
        ref = trainer.model.generate(input_ids=torch.tensor([[1, 4, 6]]), do_sample=False, max_new_tokens=6,
                                     min_new_tokens=0, eos_token_id=rollout.eos_token_id,
                                     pad_token_id=rollout.pad_token_id)[0, 3:].tolist()
    assert out.token_ids == ref[:len(out.token_ids)]
    e.shared.check()
    e.shared.check_full()


def test_a_write_into_the_shared_base_is_caught(engines):
    e, _ = engines
    e.shared.check()
    t = next(iter(e.shared.tensors.values()))
    with torch.no_grad():
        t.view(-1)[0] += 1.0
    with pytest.raises(BaseWrittenError, match="changed"):
        e.shared.check()


def test_the_offload_never_moves_the_shared_base(engines):
    e, _ = engines
    trainer = e.trainer
    before = {n: p.detach().clone() for n, p in _base(trainer.model).items()}
    trainer.offload(keep=())                   # "everything moves" still leaves the base and the adapter
    assert all(p.untyped_storage().nbytes() > 0 for p in trainer.model.parameters())
    assert all(torch.equal(before[n], p) for n, p in _base(trainer.model).items())
    assert all(".lora_" in n for n, _ in trainer.named_weights())
    trainer.reload()
    e.shared.check_full()


def test_a_shared_base_job_learns_its_adapter_and_never_touches_its_base(job_env, tmp_path):
    from colomem.runner.job import run_job

    res = run_job(job(tmp_path / "shared", save_every=3), print_fn=lambda *_: None)
    assert res.summary["status"] == "ok", res.summary.get("error")
    sb = res.summary["shared_base"]
    assert sb["lora_base_copies_on_gpu"] == 1 and sb["checks"] == 3 and sb["bytes_shared"] > 0
    lines = [json.loads(x) for x in (tmp_path / "shared" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "reward_mean" in x]
    assert len(steps) == 3 and all(x["shared_base/bytes"] == sb["bytes_shared"] for x in steps)
    # the checkpoint holds the adapter (the base is the model's), and the adapter was trained
    state = torch.load(tmp_path / "shared" / "checkpoints" / "step-3" / "trainer.pt", weights_only=True)
    assert state["model"] and all(".lora_" in k for k in state["model"])
    assert any(float(v.abs().sum()) > 0 for k, v in state["model"].items() if "lora_B" in k)


def test_a_merged_rollout_reads_the_merged_base_and_the_base_comes_back_bit_for_bit(job_env, tmp_path):
    """--shared-base-rollout merged: while the rollout generates, the shared base holds base + scaling * B @ A
    (peft's own delta of the trainer's adapter); after every rollout it is bit for bit what it was (the run's
    full checksum at the end, and each step's sampled one, check that too); the rollout serves no adapter."""
    from colomem.engines.lora import walk_modules
    from colomem.runner.backends import build_engines
    from colomem.runner.job import run_job

    seen, held = [], {}

    def factory(cfg, backend, model_path, tok, ranks, grad_accum):
        e = build_engines(cfg, backend, model_path, tok, ranks, grad_accum=grad_accum)
        layers = [(p, m) for p, m, params in walk_modules(e.trainer.model) if params is None]
        original = {p: m.base_layer.weight.detach().clone() for p, m in layers}
        generate = e.rollout.generate

        def spy(*a, **k):
            with torch.no_grad():
                gap = max(float((m.base_layer.weight - original[p] - m.get_delta_weight("default")).abs().max())
                          for p, m in layers)
                merged = any(not torch.equal(m.base_layer.weight, original[p]) for p, m in layers)
            seen.append((gap, merged))
            return generate(*a, **k)
        e.rollout.generate = spy
        held.update(rollout_lora=e.rollout.lora, layers=layers, original=original)
        return e

    res = run_job(job(tmp_path / "merged", shared_base_rollout="merged"), engines_factory=factory,
                  print_fn=lambda *_: None)
    assert res.summary["status"] == "ok", res.summary.get("error")
    sb = res.summary["shared_base"]
    assert sb["rollout"] == "merged" and sb["restores"] == 3 and sb["checks"] == 3
    assert held["rollout_lora"] is None                # the rollout (vLLM's stand-in) decodes from plain weights
    assert len(seen) == 3 and all(gap < 1e-6 for gap, _ in seen), seen
    assert seen[0][1] is False and all(m for _, m in seen[1:]), seen   # B starts at zero, then trains
    # after the run: every adapted base weight is the one it started with, bit for bit
    assert all(torch.equal(m.base_layer.weight, held["original"][p]) for p, m in held["layers"])
    lines = [json.loads(x) for x in (tmp_path / "merged" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "reward_mean" in x]
    assert all(x["shared_base/restore_bytes"] > 0 and x["shared_base/restore_s"] >= 0 for x in steps)
    assert all(x["shared_base/merge_s"] > 0 for x in steps)           # each step's merge, timed on its own
    # the rollout sampled with the weights the trainer had: its log-probabilities are the trainer's
    assert all(x["train/rollout_logprob_gap"] < 1e-4 for x in steps), [x["train/rollout_logprob_gap"] for x in steps]


def test_a_base_left_merged_is_restored_before_it_is_merged_onto_again(engines):
    """A window failed and so did its restore: the base still holds merged weights. The next sync's merge
    reads the base, so it restores first: merging twice would add the adapter's delta twice."""
    from colomem.engines.lora import walk_modules

    e, _ = engines
    layers = [m for _, m, params in walk_modules(e.trainer.model) if params is None]
    with torch.no_grad():                      # an adapter that changes the weights (B starts at zero)
        for m in layers:
            m.lora_B["default"].weight.normal_(0, 0.02)
    original = [m.base_layer.weight.detach().clone() for m in layers]
    shared = e.shared
    shared.merged_rollout = True

    def window():                              # a sync in merged mode: the merge is written into the base
        named = shared.merge_weights(e.trainer)
        assert [t.data_ptr() for _, t in named] == [m.base_layer.weight.data_ptr() for m in layers]
        with torch.no_grad():                  # base + delta, as the merged adapter makes it
            assert all(float((m.base_layer.weight - w - m.get_delta_weight("default")).abs().max()) < 1e-6
                       for m, w in zip(layers, original))
    window()                                   # its restore never ran (it failed)
    once = [m.base_layer.weight.detach().clone() for m in layers]
    assert shared.restorer.merged and not all(torch.equal(a, b) for a, b in zip(once, original))
    window()
    assert all(torch.equal(m.base_layer.weight, w) for m, w in zip(layers, once))   # base + delta, not + 2 delta
    shared.after_rollout()
    assert all(torch.equal(m.base_layer.weight, w) for m, w in zip(layers, original))


@pytest.mark.parametrize("kw, match", [
    ({"lora": None}, "full fine-tune"),
    ({"zero_stage": 3}, "zero-stage 2"),
    ({"switch": "timesplit"}, "colomem switch"),
    ({"sleep_level": 2}, "sleep-level"),
    ({"backend": "gpu", "engine": "cross-process"}, "engine in-rank"),
    ({"backend": "gpu", "dtype": "float32"}, "bfloat16"),
    ({"shared_base": False, "shared_base_rollout": "merged"}, "without --shared-base"),
])
def test_what_cannot_share_is_refused_in_the_config(tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        job(tmp_path / "x", **kw)


def test_auto_picks_the_in_rank_engine_for_a_shared_base(tmp_path):
    cfg = job(tmp_path / "x", backend="gpu")
    assert cfg.effective_engine == "in-rank"
    v = cfg.vllm_config()
    assert v.lora_mode == "adapter" and v.engine_in_process
    # merged for the rollout: vLLM runs without its LoRA support, in the trainer's process all the same
    m = job(tmp_path / "y", backend="gpu", shared_base_rollout="merged")
    assert m.vllm_config().lora_mode == "merged" and m.effective_engine == "in-rank"


def test_the_trainer_refuses_a_shared_base_without_lora(job_env):
    from colomem.engines.stand_ins import TorchTrainer
    from colomem.grpo.tasks import make_task
    from colomem.grpo.tiny_model import model_dir

    d = model_dir("tiny", make_task("successor").alphabet, log=lambda *_: None)
    with pytest.raises(InvalidArgumentError, match="needs lora"):
        TorchTrainer(str(d), lr=1e-3, micro_batch=2, shared_base={"x": torch.zeros(1)})
