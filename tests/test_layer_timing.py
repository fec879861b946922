"""The decoder layers' forwards timed through the measuring step (colomem.engines.layer_timing): training
forwards told from the checkpoint's recomputes in the backward and from forwards without gradients, the figure
the planner reads (what recomputing one layer costs a step), the hooks gone once it ends; and the runner
timing its measuring step only."""
import json

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from colomem.engines.layer_timing import LAYER_STEP_KEY, LayerForwardTimer
from colomem.engines.recompute import checkpointed_layers, decoder_layers, enable_recompute
from colomem.errors import PhaseOrderError
from colomem.runner import run_job
from colomem.runner.backends import build_engines
from fakes.placement import job
from fakes.vllm import fake_vllm  # noqa: F401  (autouse: vLLM's modules stubbed)
from test_recompute import small_qwen2


def wrapped_call_model(layers=4, every=2):
    """Decoder layers checkpointed around their whole call, as transformers did before it checkpointed their
    forward only: the layer's hooks then run inside the checkpoint, in its recompute too."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    class Layer(GradientCheckpointingLayer):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 16)

        def forward(self, x):
            return torch.tanh(self.proj(x))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Layer() for _ in range(layers))

        def forward(self, x):
            for i, layer in enumerate(self.layers):
                x = checkpoint(layer, x, use_reentrant=False) if i % every == 0 else layer(x)
            return x

    torch.manual_seed(0)
    return Model()


def test_training_forwards_recomputes_and_forwards_without_gradients_are_told_apart():
    model = wrapped_call_model(layers=4, every=2)                     # layers 0 and 2 checkpointed
    with LayerForwardTimer(model) as timer:
        for _ in range(3):                                           # three micro-batches
            model(torch.randn(8, 16)).sum().backward()
        with torch.no_grad():                                        # a reference pass: no backward repeats it
            model(torch.randn(8, 16))
        with pytest.raises(PhaseOrderError, match="still timing"):
            timer.result()
    times = timer.result()
    assert (times.layers, times.forwards, times.recomputes, times.no_grad) == (4, 12, 6, 4)
    assert times.micro_batches == 3 and times.forward_s > 0 and times.recompute_s > 0
    # recomputing one layer costs its forward once for each micro-batch
    assert times.layer_step_s == pytest.approx(3 * times.forward_s)
    m = times.metrics()
    assert m[LAYER_STEP_KEY] == times.layer_step_s and m["train/layer_forwards"] == 12
    assert m["train/layer_recomputes"] == 6 and m["train/layer_forward_s"] == times.forward_s
    # the hooks are gone: a forward now leaves nothing behind
    assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in model.layers)


def test_a_checkpointed_hugging_face_model_is_timed_once_a_layer_and_micro_batch_and_left_unhooked():
    model = small_qwen2(layers=4)
    enable_recompute(model, 2)
    assert checkpointed_layers(model) == 2
    ids = torch.randint(0, 97, (2, 12))
    with LayerForwardTimer(model) as timer:
        for _ in range(2):
            model(input_ids=ids, use_cache=False).logits.sum().backward()
    times = timer.result()
    assert (times.layers, times.forwards, times.no_grad) == (4, 8, 0) and times.micro_batches == 2
    # transformers checkpoints the forward inside the call, or the call itself (older ones): the hooks see the
    # two checkpointed layers' recomputes in the second case only, and never count them as forwards
    assert times.recomputes in (0, 2 * 2)
    assert times.layer_step_s > 0
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in decoder_layers(model))


def test_a_failed_forward_still_leaves_the_layers_unhooked():
    model = wrapped_call_model(layers=2, every=1)
    with pytest.raises(RuntimeError, match="shape"):
        with LayerForwardTimer(model):
            model(torch.randn(8, 3))                                  # the wrong width
    assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in model.layers)


def test_a_model_without_decoder_layers_is_not_timed():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with LayerForwardTimer(model) as timer:
        model(torch.randn(2, 4)).sum().backward()
    assert timer.result() is None


def test_the_runner_times_the_measuring_steps_training_only(job_env, tmp_path):
    """With checkpointing, the measuring step's record holds its layers' figures (its 16 rows a rank in
    micro-batches of 8: two), later steps' none, and the trainer's model keeps no hook; without
    checkpointing nothing is timed."""
    held = {}

    def engines(cfg, backend, model_path, tok, ranks, grad_accum):
        eng = build_engines(cfg, backend, model_path, tok, ranks, grad_accum=grad_accum)
        held["model"] = eng.trainer.model
        return eng
    res = run_job(job(tmp_path / "ckpt", gradient_checkpointing=True), engines_factory=engines,
                  print_fn=lambda *_: None)
    assert res.summary["status"] == "ok", res.summary
    steps = [json.loads(x) for x in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in steps if "reward_mean" in x]
    layers = decoder_layers(held["model"])
    assert steps[0]["train/layer_forwards"] == 2 * len(layers) and steps[0][LAYER_STEP_KEY] > 0
    assert steps[0][LAYER_STEP_KEY] == pytest.approx(2 * steps[0]["train/layer_forward_s"])
    assert not any(LAYER_STEP_KEY in x for x in steps[1:])
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in layers)
    res = run_job(job(tmp_path / "plain"), print_fn=lambda *_: None)
    steps = [json.loads(x) for x in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()]
    assert res.summary["status"] == "ok" and not any(LAYER_STEP_KEY in x for x in steps)


def test_a_timing_that_cannot_be_read_leaves_the_step_and_the_plan_without_it(job_env, tmp_path, monkeypatch):
    """Reading the events fails (a driver error, say): the measuring step still counts, its record holds no
    layer figure, and the job runs on."""
    def broken(self):
        raise RuntimeError("events could not be read")
    monkeypatch.setattr(LayerForwardTimer, "result", broken)
    res = run_job(job(tmp_path / "ckpt", gradient_checkpointing=True), print_fn=lambda *_: None)
    assert res.summary["status"] == "ok", res.summary
    steps = [json.loads(x) for x in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in steps if "reward_mean" in x]
    assert steps and not any(LAYER_STEP_KEY in x for x in steps)
