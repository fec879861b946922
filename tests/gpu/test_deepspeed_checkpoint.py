"""DeepSpeedTrainer checkpoints on a real GPU: saved while offloaded (from the pool, no GPU memory taken) and
written in a thread while the trainer trains on, a fresh trainer loaded from it continues bit for bit like
the trainer that never stopped, and the saved model (or adapter) holds exactly the trainer's weights.

Run: python -m pytest -m "gpu and deepspeed" -s tests/gpu/test_deepspeed_checkpoint.py
"""
import threading

import pytest
import torch

from deepspeed_cases import final_state, make_batch, make_trainer, model_dir, ready, settle  # noqa: F401

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


def test_the_lr_schedule_steps_with_the_engine_and_a_resume_goes_on_with_its_rates(model_dir, ready, tmp_path):  # noqa: F811
    from colomem.engines.lr_schedule import LrSchedule

    schedule = LrSchedule("cosine_with_min_lr", 1, 4, 0.1)
    want = []
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = schedule.started(opt, 1e-5)
    for _ in range(4):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    a = make_trainer(model_dir, 2, False, lr_schedule=schedule)
    try:
        got = [a.train_step(make_batch(s))["lr"] for s in range(2)]
        a.save_state(tmp_path)
        got += [a.train_step(make_batch(s))["lr"] for s in range(2, 4)]
        final = final_state(a)
    finally:
        a.close()
    assert got == pytest.approx(want) and got[0] == 0.0            # warmup from 0, the decay to the floor
    b = make_trainer(model_dir, 2, False, lr_schedule=schedule)
    try:
        b.load_state(tmp_path)
        resumed = [b.train_step(make_batch(s))["lr"] for s in range(2, 4)]
        again = final_state(b)
    finally:
        b.close()
    assert resumed == got[2:]
    assert [k for k in final if again[k] != final[k]] == []
