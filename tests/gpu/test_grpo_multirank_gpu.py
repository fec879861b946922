"""DeepSpeedTrainer on two GPUs (ZeRO-2, bf16, NCCL) trains like one rank on the whole batch with
loss_norm token, when one rank holds far fewer completion tokens than the other: the gradient norm DeepSpeed
computes after its data-parallel average, and the loss, match a one-rank run on both ranks' rows (bf16
tolerance). Each side runs in fresh processes. NCCL refuses two ranks on one GPU, hence two devices.

The exact check (1e-6, both trainers' averaging) is the CPU test tests/test_grpo_multirank_cpu.py.
Run: python -m pytest -m "gpu and deepspeed and multi_gpu" -s tests/gpu/test_grpo_multirank_gpu.py
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ports import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.deepspeed, pytest.mark.multi_gpu, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
LENGTHS = [1, 2, 3, 1, 12, 16, 20, 9]           # rank 0: rows 0-3 (7 tokens), rank 1: rows 4-7 (57 tokens)

WORKER = textwrap.dedent(r'''
    import json, os, sys
    import torch
    from colomem.engines.deepspeed import DeepSpeedTrainer
    from colomem.grpo.batch import Completion, build_batch
    from colomem.grpo.config import GRPOConfig

    model_dir, out, rows = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    lengths = json.loads(sys.argv[4])
    rank = int(os.environ.get("RANK", "0"))
    g = torch.Generator().manual_seed(0)
    prompts, groups = [], []
    for n in lengths:
        prompts.append(torch.randint(1, 500, (4,), generator=g).tolist())
        groups.append([Completion(torch.randint(1, 500, (n,), generator=g).tolist(), [-6.0] * n, "stop")])
    full = build_batch(prompts, groups, torch.randn(len(lengths), generator=g), pad_id=0)
    batch = full.select(rows[rank])
    grpo = GRPOConfig(group_size=2, loss_norm="token", log_entropy=False)     # on-policy: no clipping
    t = DeepSpeedTrainer(model_dir, zero_stage=2, lr=1e-4, micro_batch=2, grad_accum=len(batch) // 2,
                         max_grad_norm=1e6, grpo=grpo, torch_adam=True, attn_implementation="eager", seed=0)
    m = t.train_step(batch)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"grad_norm": m["grad_norm"], "loss": m["loss"]}, f)
    t.close()
''')


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from deepspeed_cases import save_qwen2

    return save_qwen2(tmp_path_factory.mktemp("qwen2-tiny"), vocab_size=512, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _launch(tmp_path, model_dir, name, rows):
    out = tmp_path / name
    out.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    world, port = len(rows), free_port()
    base = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    procs = []
    for rank in range(world):
        env = {**base, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
        if world > 1:
            env.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        procs.append(subprocess.Popen([sys.executable, str(script), str(model_dir), str(out), json.dumps(rows),
                                       json.dumps(LENGTHS)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    for p in procs:
        try:
            log, _ = p.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            p.kill()
            log, _ = p.communicate()
            pytest.fail(f"a rank hung:\n{log[-4000:]}")
        assert p.returncode == 0, log[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_two_ranks_with_uneven_tokens_equal_one_rank(tmp_path, model_dir):
    two = _launch(tmp_path, model_dir, "two", [[0, 1, 2, 3], [4, 5, 6, 7]])
    one = _launch(tmp_path, model_dir, "one", [[0, 1, 2, 3, 4, 5, 6, 7]])[0]
    # the norm of the gradient after DeepSpeed's average over the ranks: the same on both, and the batch's
    assert two[0]["grad_norm"] == pytest.approx(two[1]["grad_norm"], rel=1e-6)
    assert two[0]["grad_norm"] == pytest.approx(one["grad_norm"], rel=3e-2)
    # each rank reports its part of the loss times the world size: their mean is the batch loss
    assert (two[0]["loss"] + two[1]["loss"]) / 2 == pytest.approx(one["loss"], rel=3e-2, abs=1e-3)
