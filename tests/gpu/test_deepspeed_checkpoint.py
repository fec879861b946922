"""DeepSpeedTrainer checkpoints on a real GPU: saved while offloaded (from the pool, no GPU memory taken) and
written in a thread while the trainer trains on, a fresh trainer loaded from it continues bit for bit like
the trainer that never stopped, and the saved model (or adapter) holds exactly the trainer's weights.

Run: python -m pytest -m "gpu and deepspeed" -s tests/gpu/test_deepspeed_checkpoint.py
"""
import threading

import pytest
import torch

from test_deepspeed_adapter import final_state, make_batch, make_trainer, model_dir, ready, settle  # noqa: F401

pytestmark = [pytest.mark.gpu, pytest.mark.deepspeed, pytest.mark.slow]

MiB = 1 << 20
CONFIGS = [pytest.param(2, False, id="zero2-full"), pytest.param(2, True, id="zero2-lora"),
           pytest.param(3, False, id="zero3-full")]


@pytest.mark.parametrize("stage, lora", CONFIGS)
def test_resume_from_a_pool_checkpoint_continues_bit_for_bit(model_dir, ready, stage, lora, tmp_path):  # noqa: F811
    import colomem

    pool = colomem.PinnedPool("3GiB")
    a = make_trainer(model_dir, stage, lora, pool=pool)
    try:
        for s in range(2):
            a.train_step(make_batch(s))
        a.offload()
        settle()
        alloc, free = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]
        pending = a.prepare_save(tmp_path, merged=lora)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == alloc                  # read from the pool's host copies
        assert free - torch.cuda.mem_get_info()[0] < 64 * MiB
        assert pending.reads_pool
        a.reload()
        weights = {n: t.detach().cpu().clone() for n, t in a.named_weights(merged=True)}
        writer = threading.Thread(target=pending.write)
        writer.start()                                 # the files are written while the trainer trains on
        for s in range(2, 4):
            a.train_step(make_batch(s))
        a.offload()                                    # rewrites the pool copies: waits for the write first
        assert pending.done and pending.error is None
        writer.join(60)
        a.reload()
        want = final_state(a)
    finally:
        a.close()
    b = make_trainer(model_dir, stage, lora, pool=pool)
    try:
        b.load_state(tmp_path)
        assert b.steps == 2
        for s in range(2, 4):
            b.train_step(make_batch(s))
        got = final_state(b)
    finally:
        b.close()
        pool.close(force=True)
    assert got.keys() == want.keys()
    assert [k for k in want if got[k] != want[k]] == []

    from safetensors.torch import load_file
    if lora:
        assert (tmp_path / "model" / "adapter_config.json").is_file()
        saved = load_file(tmp_path / "model-merged" / "model.safetensors")
    else:
        saved = load_file(tmp_path / "model" / "model.safetensors")
    assert saved.keys() <= weights.keys() and len(saved) >= len(weights) - 1      # a tied head may be left out
    assert all(torch.equal(saved[n], weights[n]) for n in saved)
