"""torch_compile on the CPU trainer: each decoder layer's parts run compiled (every layer through the same
graphs), the steps train like eager ones to float32 rounding, with gradient checkpointing and LoRA and
through offloads that empty the parameters' storages between steps; what cannot compile is refused early."""
import contextlib
import json
import subprocess
import sys

import pytest
import torch

import colomem
from child_env import child_env
from colomem.errors import InvalidArgumentError

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from colomem.grpo.tasks import make_task
    from colomem.grpo.tiny_model import model_dir

    return model_dir("tiny", make_task("successor").alphabet, dtype="float32",
                     cache_dir=tmp_path_factory.mktemp("compile-cache") / "models", log=lambda *_: None)


@contextlib.contextmanager
def compiled_trainer(model_path, *, gradient_checkpointing: bool):
    """A TorchTrainer with compiled layers (micro-batches of 4 rows) on a pool of its own, Dynamo's caches and
    counters reset first; closed after."""
    from torch._dynamo.utils import counters

    from colomem.engines.stand_ins import TorchTrainer

    torch._dynamo.reset()
    counters.clear()
    pool = colomem.PinnedPool("16MiB", pin=False, segment_bytes="16MiB")
    trainer = TorchTrainer(model_path, lr=1e-2, micro_batch=4, pool=pool,
                           gradient_checkpointing=gradient_checkpointing, torch_compile=True)
    try:
        yield trainer
    finally:
        trainer.close()
        pool.close(force=True)


def batch_for(step: int, rows: int = 8):
    from colomem.grpo.batch import Completion, build_batch

    g = torch.Generator().manual_seed(step)
    prompts = [[2, 4, 5, 6], [2, 7, 8, 9]]
    lengths = torch.randint(2, 7, (len(prompts), rows // 2), generator=g).tolist()
    comps = [[Completion(token_ids=torch.randint(3, 12, (n,), generator=g).tolist(), logprobs=[-1.0] * n)
              for n in row] for row in lengths]
    adv = torch.randn(rows, generator=g)
    return build_batch(prompts, comps, adv, pad_id=0)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_compiled_layers_train_like_eager_ones_through_offloads(tiny, lora):
    from torch._dynamo.utils import counters

    from colomem.engines.compile import compiled_parts
    from colomem.engines.recompute import decoder_layers
    from colomem.engines.stand_ins import TorchTrainer
    from colomem.grpo.config import LoraSpec

    torch._dynamo.reset()
    counters.clear()
    spec = LoraSpec(r=4, alpha=8) if lora else None
    pools = [colomem.PinnedPool("16MiB", pin=False, segment_bytes="16MiB") for _ in range(2)]
    eager, compiled = (TorchTrainer(tiny, lr=1e-2, micro_batch=3, pool=p, lora=spec, gradient_checkpointing=True,
                                    torch_compile=c) for p, c in zip(pools, (False, True)))
    try:
        layers = decoder_layers(compiled.model)
        parts = compiled_parts(compiled.model)
        kinds = len({type(m) for m in compiled.model.modules() if getattr(m, "_compiled_call_impl", None)})
        assert layers and parts == sum(len(list(x.children())) for x in layers)
        assert compiled_parts(eager.model) == 0
        for step in range(3):       # micro-batches of 3 rows: the last one is smaller, every width differs
            a, b = eager.train_step(batch_for(step)), compiled.train_step(batch_for(step))
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4, abs=1e-6)
            for t in (eager, compiled):      # the storages go to the pool and come back between steps
                t.offload()
                assert all(p.untyped_storage().nbytes() == 0 for p in t.model.parameters() if p.requires_grad)
                t.reload()
        # Adam divides by the gradient's own scale: where a gradient is ~0, its rounding can move a weight by
        # up to lr a step, so the weights agree to a tenth of lr (the losses and norms above to rounding)
        for (name, p), q in zip(eager.model.named_parameters(), compiled.model.parameters()):
            torch.testing.assert_close(q, p, rtol=0, atol=1e-3, msg=name)
    finally:
        for t in (eager, compiled):
            t.close()
        for p in pools:
            p.close(force=True)
    assert not counters["graph_break"], dict(counters["graph_break"])
    # the layers share their parts' graphs: a few per kind of part (with and without gradients, a shape
    # compiled again), fewer than the compiled parts (not one per layer)
    assert 0 < counters["stats"]["unique_graphs"] <= 4 * kinds and counters["stats"]["unique_graphs"] < parts


def test_a_batch_with_padding_runs_the_graphs_of_one_without(tiny):
    """A right-padded batch's forward leaves the padding mask out, so a step whose completions all end at the
    same length and one with padding run the same compiled graphs: nothing compiles again mid-run."""
    from torch._dynamo.utils import counters

    from colomem.grpo.batch import Completion, build_batch

    def batch(lengths):
        comps = [[Completion(token_ids=[3 + (i + j) % 9 for j in range(n)], logprobs=[-1.0] * n) for i, n in
                  enumerate(row)] for row in lengths]
        return build_batch([[2, 4, 5, 6], [2, 7, 8, 9]], comps, torch.linspace(-1, 1, 8), pad_id=0)

    with compiled_trainer(tiny, gradient_checkpointing=False) as trainer:
        trainer.train_step(batch([[6] * 4, [6] * 4]))          # no padding anywhere
        trainer.train_step(batch([[5] * 4, [5] * 4]))          # another width: the shapes are dynamic
        graphs = counters["stats"]["unique_graphs"]
        padded = batch([[6, 3, 5, 2], [4, 6, 2, 3]])
        assert padded.right_padded and bool((padded.attention_mask == 0).any())
        trainer.train_step(padded)
        assert graphs > 0 and counters["stats"]["unique_graphs"] == graphs


def test_the_planners_probe_runs_the_graphs_training_compiled(tiny):
    """The checkpointing probe after a compiled step (two rows at the step's width, in training mode with
    gradients) runs the graphs training compiled: the measuring step does not compile again for it."""
    from torch._dynamo.utils import counters

    from colomem.runner.recompute_plan import probe

    with compiled_trainer(tiny, gradient_checkpointing=True) as trainer:
        b = batch_for(0)
        trainer.train_step(b)
        graphs = counters["stats"]["unique_graphs"]
        pr = probe(trainer, b.input_ids.shape[1])
        assert pr is not None and pr.per_layer_row > 0
        assert graphs > 0 and counters["stats"]["unique_graphs"] == graphs


def test_a_model_without_decoder_layers_and_a_missing_compiler_are_refused():
    from colomem.engines.compile import compile_decoder_layers

    with pytest.raises(InvalidArgumentError, match="no.*decoder layers"):
        compile_decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)), "cpu")
    # Inductor looks its compiler up once a process: a process of its own, with CXX naming none
    code = ("import torch\nfrom colomem.engines.compile import compile_decoder_layers\n"
            "compile_decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)), 'cpu')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=child_env(CXX="/nonexistent/c++"))
    assert out.returncode != 0 and "InvalidArgumentError" in out.stderr, out.stderr[-2000:]
    assert "needs a C++ compiler" in out.stderr and "turn torch_compile off" in out.stderr


def test_the_option_reaches_the_trainers_and_zero3_is_refused():
    from colomem.engines.deepspeed.config import DeepSpeedConfig
    from colomem.errors import ConfigError
    from colomem.runner.config import load_run_config

    assert DeepSpeedConfig(torch_compile=True).torch_compile
    with pytest.raises(InvalidArgumentError, match="ZeRO-2"):
        DeepSpeedConfig(torch_compile=True, zero_stage=3)
    assert load_run_config(["--torch-compile"]).deepspeed_config().torch_compile
    assert not load_run_config([]).deepspeed_config().torch_compile
    with pytest.raises(ConfigError, match="ZeRO-2"):
        load_run_config(["--torch-compile", "--zero-stage", "3", "--backend", "gpu"])


def test_a_runner_job_with_compiled_layers_samples_with_what_it_trained(tmp_path, monkeypatch):
    """--torch-compile through the runner on the CPU backend: the trainer's layers run compiled, the line
    saying so is printed once, and the rollout (eager, with the synced weights) gives the sampled tokens the
    logprobs the compiled trainer computes."""
    from colomem.engines.compile import compiled_parts
    from colomem.runner.backends import build_engines
    from colomem.runner.config import config_from_dict
    from colomem.runner.job import run_job

    monkeypatch.setenv("COLOMEM_CACHE", str(tmp_path / "cache"))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    held, printed = {}, []

    def factory(cfg, backend, model_path, tok, ranks, grad_accum):
        eng = build_engines(cfg, backend, model_path, tok, ranks, grad_accum=grad_accum, log_fn=printed.append)
        held["parts"] = compiled_parts(eng.trainer.model)
        return eng

    cfg = config_from_dict({"backend": "cpu", "steps": 2, "prompts_per_step": 4, "micro_batch": 8,
                            "progress": False, "out": str(tmp_path / "run"), "grpo": {"group_size": 4},
                            "torch_compile": True})
    res = run_job(cfg, engines_factory=factory, print_fn=lambda *_: None)
    assert res.summary["status"] == "ok" and res.summary["steps_done"] == 2
    assert held["parts"] > 0
    assert [p for p in printed if "torch.compile" in p] == [
        f"[colomem] training: torch.compile on {held['parts']} parts of the decoder layers (they compile in the "
        "first steps)"]
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"step"' in x]
    assert len(steps) == 2 and all(s["train/rollout_logprob_gap"] < 1e-4 for s in steps)
