"""Two gloo ranks train exactly like one rank on the whole batch: the loss weights use the completion tokens
(or rows) of every rank, so the gradients averaged over the ranks are the whole batch's, even when one rank
holds far fewer tokens than the other. Both trainers' averaging is covered: TorchTrainer (all-reduce over its
process group, then / world size) and DeepSpeedTrainer's train_step around an engine that averages over the
data-parallel ranks at the accumulation boundary, as DeepSpeed does."""
import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from child_env import child_env
from ports import free_port


# The worker module: run as a script it is one rank; imported, it gives the test the same model, batches
# and recording trainer for the one-rank reference.
WORKER = textwrap.dedent(r'''
    import json, os, sys
    from types import SimpleNamespace

    import torch

    from colomem.engines.background import BackgroundSlot
    from colomem.grpo.batch import Completion, build_batch
    from colomem.grpo.config import GRPOConfig

    V = 11


    class TinyLM(torch.nn.Module):
        def __init__(self, H=8):
            super().__init__()
            torch.manual_seed(0)
            self.emb = torch.nn.Embedding(V, H)
            self.mix = torch.nn.Linear(H, H)
            self.out = torch.nn.Linear(H, V)
            self.forwards = 0

        def forward(self, input_ids, attention_mask=None, use_cache=False):
            self.forwards += 1
            h = torch.tanh(self.mix(self.emb(input_ids)))
            h = torch.cumsum(h, dim=1) / torch.arange(1, input_ids.shape[1] + 1)[None, :, None]   # causal
            return SimpleNamespace(logits=self.out(h))


    def full_batch(lengths, seed=0):
        """One row per completion length; random prompts, tokens, rollout logprobs and advantages."""
        g = torch.Generator().manual_seed(seed)
        prompts, groups = [], []
        for n in lengths:
            prompts.append(torch.randint(1, V, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist())
            toks = torch.randint(1, V, (n,), generator=g).tolist()
            groups.append([Completion(toks, (-2.4 + 0.3 * torch.randn(n, generator=g)).tolist(), "stop")])
        return build_batch(prompts, groups, torch.randn(len(lengths), generator=g), pad_id=0)


    def record_grads(optimizer, into):
        """Wraps optimizer.step: the gradients it steps with, in parameter order, go into `into`."""
        inner = optimizer.step

        def step(*a, **k):
            into.append([p.grad.detach().clone() for g in optimizer.param_groups for p in g["params"]])
            return inner(*a, **k)
        optimizer.step = step


    def torch_trainer(grpo, world_size=1, group=None, tokens=None):
        from colomem.engines.stand_ins import TorchTrainer

        t = TorchTrainer(TinyLM(), lr=1e-2, micro_batch=2, grpo=grpo, max_grad_norm=None, world_size=world_size,
                         process_group=group, micro_batch_tokens=tokens)
        grads = []
        record_grads(t.optimizer, grads)
        return t, grads


    class AveragingEngine(torch.nn.Module):
        """The engine methods DeepSpeedTrainer.train_step calls; at the accumulation boundary the gradients
        are averaged over the data-parallel ranks (DeepSpeed's reduction), then AdamW steps."""

        def __init__(self, model, world_size):
            super().__init__()
            self.module, self.world_size, self.boundary = model, world_size, False
            self.opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)

        def forward(self, **kw):
            return self.module(**kw)

        def set_gradient_accumulation_boundary(self, flag):
            self.boundary = bool(flag)

        def backward(self, loss, scale_wrt_gas=True):
            assert scale_wrt_gas is False          # the loss carries its weight
            loss.backward()

        def step(self):
            assert self.boundary
            if self.world_size > 1:
                import torch.distributed as dist
                for p in self.module.parameters():
                    dist.all_reduce(p.grad)
                    p.grad.div_(self.world_size)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

        def get_global_grad_norm(self):
            return None

        def get_lr(self):
            return [1e-2]


    def deepspeed_trainer(grpo, world_size=1, tokens=None):
        from colomem.engines.deepspeed import DeepSpeedTrainer
        from colomem.swap import PendingReloads

        eng = AveragingEngine(TinyLM(), world_size)
        t = DeepSpeedTrainer.__new__(DeepSpeedTrainer)        # a shell around the engine: no DeepSpeed, no GPU
        t.__dict__.update(engine=eng, model=eng.module, grpo=grpo, micro_batch=2, world_size=world_size,
                          micro_batch_tokens=tokens,
                          device=torch.device("cpu"), steps=0, _closed=False, _offloaded=False, _ref_fn=None,
                          _fwd_stack=None, _pending=PendingReloads(), timeout_s=30.0, _step_reload=None, _strategies={},
                          _finishing=BackgroundSlot())
        grads = []
        record_grads(eng.opt, grads)
        return t, grads


    def train(kind, case, batch, world_size=1, group=None):
        grpo = GRPOConfig(group_size=2, **case["grpo"])
        tokens = case.get("micro_batch_tokens")
        if kind == "torch":
            t, grads = torch_trainer(grpo, world_size, group, tokens)
        else:
            t, grads = deepspeed_trainer(grpo, world_size, tokens)
        metrics = [t.train_step(batch) for _ in range(case.get("train_steps", 2))]
        weights = {n: p.detach().clone() for n, p in t.model.named_parameters()}
        return {"grads": grads, "weights": weights, "metrics": metrics, "forwards": t.model.forwards}


    if __name__ == "__main__":
        import torch.distributed as dist

        kind, out = sys.argv[1], sys.argv[2]
        rank = int(os.environ["RANK"])
        dist.init_process_group("gloo", rank=rank, world_size=2)
        cases = json.loads(open(os.path.join(out, "cases.json")).read())
        res = {}
        for case in cases:
            batch = full_batch(case["lengths"]).select(case["rows"][rank])
            res[case["name"]] = train(kind, case, batch, 2, dist.group.WORLD)
        torch.save(res, os.path.join(out, f"{kind}-rank{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
''')

# lengths: each row's completion length. rows: each rank's rows (an uneven token split: 7 against 24 tokens).
LENGTHS = [1, 2, 4, 6, 8, 10]
CASES = [
    {"name": "token", "lengths": LENGTHS, "rows": [[0, 1, 2], [3, 4, 5]], "grpo": {"loss_norm": "token"}},
    {"name": "token-interleaved", "lengths": LENGTHS, "rows": [[0, 5, 2], [3, 4, 1]],
     "grpo": {"loss_norm": "token"}},
    # uneven rows too: the sequence norm needs the global row count as the token norm the global token count
    {"name": "sequence", "lengths": LENGTHS, "rows": [[0, 1], [2, 3, 4, 5]], "grpo": {"loss_norm": "sequence"}},
    {"name": "token-rollout-clip", "lengths": LENGTHS, "rows": [[0, 1, 2], [3, 4, 5]],
     "grpo": {"loss_norm": "token", "old_logprobs": "rollout", "clip_eps_high": 0.28}},
    # two passes of two mini-batches: four optimizer steps per train_step, each normalised over its
    # mini-batch on both ranks; the one-rank reference holds mini-batch j of both ranks as its j-th half
    {"name": "token-reuse", "lengths": [1, 2, 3, 1, 6, 8, 9, 5], "rows": [[0, 1, 2, 3], [4, 5, 6, 7]],
     "reference": [0, 1, 4, 5, 2, 3, 6, 7],
     "grpo": {"loss_norm": "token", "num_iterations": 2, "mini_batches": 2}},
    {"name": "sequence-reuse-variants", "lengths": [1, 2, 3, 1, 6, 8, 9, 5], "rows": [[0, 1, 2, 3], [4, 5, 6, 7]],
     "reference": [0, 1, 4, 5, 2, 3, 6, 7],
     "grpo": {"num_iterations": 2, "mini_batches": 2, "importance_level": "sequence", "dual_clip": 1.1,
              "entropy_coef": 0.01, "is_correction": "token", "is_mode": "mask", "is_cap": 1.3}},
    # micro-batches by a token budget: rank 0's short rows fit in one, rank 1's long ones need three; both
    # ranks run three (each backward may reduce gradients) and train as one rank on the whole batch
    {"name": "token-budget", "lengths": [1, 2, 1, 9, 10, 8], "rows": [[0, 1, 2], [3, 4, 5]], "micro_batch_tokens": 14,
     "grpo": {"loss_norm": "token"}},
    # and with a first no-grad pass over the batch (two updates on it): as many forwards on both ranks there too
    {"name": "token-budget-reuse", "lengths": [1, 2, 1, 9, 10, 8], "rows": [[0, 1, 2], [3, 4, 5]],
     "micro_batch_tokens": 14, "grpo": {"loss_norm": "token", "num_iterations": 2}},
    {"name": "token-is-sequence", "lengths": LENGTHS, "rows": [[0, 1, 2], [3, 4, 5]],
     "grpo": {"loss_norm": "token", "is_correction": "sequence", "is_cap": 2.0, "entropy_coef": 0.05}},
]


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    d = tmp_path_factory.mktemp("grpo-ranks")
    path = d / "grpo_rank_worker.py"
    path.write_text(WORKER)
    (d / "cases.json").write_text(json.dumps(CASES))
    spec = importlib.util.spec_from_file_location("grpo_rank_worker", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return d, mod


def _two_ranks(d, kind):
    port = free_port()
    procs = []
    for rank in range(2):
        env = child_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(d / "grpo_rank_worker.py"), kind, str(d)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        try:
            out, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            pytest.fail(f"a rank hung:\n{out[-3000:]}")
        assert p.returncode == 0, out[-4000:]
    return [torch.load(d / f"{kind}-rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module", params=["torch", "deepspeed"])
def ranks(request, worker):
    d, mod = worker
    return request.param, _two_ranks(d, request.param), mod


def _close(a, b, atol=1e-6):
    return all(torch.allclose(x, y, atol=atol, rtol=0) for x, y in zip(a, b))


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_two_ranks_equal_one_rank_on_the_whole_batch(ranks, case):
    kind, results, mod = ranks
    full = mod.full_batch(case["lengths"]).select(case.get("reference", case["rows"][0] + case["rows"][1]))
    want = mod.train(kind, case, full)
    r0, r1 = results[0][case["name"]], results[1][case["name"]]
    updates = case["grpo"].get("num_iterations", 1) * case["grpo"].get("mini_batches", 1)
    assert len(r0["grads"]) == len(want["grads"]) == case.get("train_steps", 2) * updates
    assert r0["metrics"][0]["optimizer_steps"] == updates
    for step, w in enumerate(want["grads"]):
        # each rank steps with the averaged gradient (the trainer's reduction), equal on both ranks
        assert _close(r0["grads"][step], w) and _close(r1["grads"][step], w), f"step {step}"
    for name, w in want["weights"].items():
        assert torch.allclose(r0["weights"][name], w, atol=1e-6, rtol=0), name
        assert torch.equal(r0["weights"][name], r1["weights"][name]), name
    # the reported loss: each rank's part times the world size, whose mean over the ranks is the batch loss
    loss = (r0["metrics"][0]["loss"] + r1["metrics"][0]["loss"]) / 2
    assert loss == pytest.approx(want["metrics"][0]["loss"], abs=1e-6)


def test_each_rank_normalising_by_its_own_tokens_would_be_wrong(worker):
    """What the test above guards against: the mean of two one-rank gradients (each rank divides by its own
    token count) is far from the whole batch's gradient when the ranks hold 7 and 24 tokens."""
    _, mod = worker
    case = CASES[0]
    full = mod.full_batch(case["lengths"])
    assert [full.select(r).num_completion_tokens for r in case["rows"]] == [7, 24]
    want = mod.train("torch", case, full.select(case["rows"][0] + case["rows"][1]))["grads"][0]
    own = [mod.train("torch", case, full.select(r))["grads"][0] for r in case["rows"]]
    mean = [(a + b) / 2 for a, b in zip(*own)]
    rel = max(float((m - w).norm() / w.norm()) for m, w in zip(mean, want))
    assert rel > 0.05


def test_ranks_run_as_many_micro_batches_under_a_token_budget(ranks):
    kind, results, mod = ranks
    r0, r1 = results[0]["token-budget"], results[1]["token-budget"]
    assert r0["metrics"][0]["micro_batches"] == r1["metrics"][0]["micro_batches"] == 3
    # two train steps of one first pass and two updates each: (3 + 2 x 3) x 2 forwards on both ranks
    reuse0, reuse1 = results[0]["token-budget-reuse"], results[1]["token-budget-reuse"]
    assert reuse0["forwards"] == reuse1["forwards"] == 18
