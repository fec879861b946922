"""What the DeepSpeedTrainer GPU tests share (test_deepspeed_adapter.py, test_deepspeed_optimizer_step.py): the
model they train (a Qwen2 of about 124 M params built from a config and saved locally), the process group, the
trainer and the batches, bit checksums of every state tensor, and the reference run that is never offloaded.

    COLOMEM_TEST_TORCH_ADAM=1   torch AdamW instead of FusedAdam (skips its ~30 s JIT build once per host)
"""
import gc
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")      # deterministic cuBLAS: exact loss trajectories

import pytest
import torch


MiB = 1 << 20
STEPS = 4                    # optimizer steps per run; every gap between two steps is an offload + reload
CYCLES = 20
ALLOC_MARGIN = 64 * MiB      # torch allocations that may stay after offload (small DeepSpeed scalars etc.)
PEAK_SLACK = 4 * MiB         # one small tensor live at a training peak or not, by the timing of a copy
DRIVER_MARGIN = 320 * MiB    # driver memory that may stay: kernel modules loaded by the engine, handles
TORCH_ADAM = os.environ.get("COLOMEM_TEST_TORCH_ADAM", "0") == "1"
TORCH_LINEAR = torch.nn.functional.linear    # ZeRO-3's set-up replaces it process-wide until its trainer closes
CONFIGS = [pytest.param(2, False, id="zero2-full"), pytest.param(2, True, id="zero2-lora"),
           pytest.param(3, False, id="zero3-full"), pytest.param(3, True, id="zero3-lora")]


def save_qwen2(d, **shape):
    """A bf16 Qwen2 of `shape` (Qwen2Config's fields) with seeded random weights, saved in `d`; returns d."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(tie_word_embeddings=False, use_sliding_window=False, **shape)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
    return d


# ------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_qwen2(tmp_path_factory.mktemp("qwen2-124m"), vocab_size=16384, hidden_size=1024,
                      intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                      max_position_embeddings=512)


@pytest.fixture(scope="module")
def ready():
    """Process group + NCCL communicator + cuBLAS handles exist before any baseline is measured."""
    import deepspeed
    from colomem.engines.deepspeed import init_distributed

    init_distributed()
    torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl")
    torch.distributed.all_reduce(torch.ones(1, device="cuda"))
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    (a @ a).float().sum().backward()
    torch.use_deterministic_algorithms(True, warn_only=True)
    del a
    settle()
    yield
    torch.use_deterministic_algorithms(False)        # do not leak the mode into other test modules
    # the group is this fixture's own (the trainers leave a group they did not start alone): destroyed here,
    # through DeepSpeed so its cached groups go too, else torch warns at exit that nothing destroyed it
    from colomem.engines.deepspeed.config import forget_distributed_env

    deepspeed.comm.destroy_process_group()
    forget_distributed_env()


def settle():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def baseline():
    settle()
    return torch.cuda.mem_get_info()[0], torch.cuda.memory_allocated()


def make_trainer(model_dir, stage, lora, pool=None, lr=None, micro_batch=2, **kw):
    from colomem.engines.deepspeed import DeepSpeedTrainer
    from colomem.grpo.config import GRPOConfig, LoraSpec

    spec = LoraSpec(r=8, alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]) if lora else None
    grpo = GRPOConfig(kl_coef=0.05 if lora else 0.0, log_entropy=False)
    lr = lr or (1e-4 if lora else 1e-5)
    return DeepSpeedTrainer(model_dir, zero_stage=stage, lora=spec, lr=lr, micro_batch=micro_batch,
                            grad_accum=2, pool=pool, gradient_checkpointing=True, grpo=grpo,
                            torch_adam=TORCH_ADAM, attn_implementation="eager", seed=0, **kw)


def make_batch(step, vocab=16384, rows=4, prompt=16, width=64):
    """A GRPO batch whose loss depends on the weights (old logprobs near a uniform policy's)."""
    from colomem.grpo.batch import GRPOBatch

    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (rows, width), generator=g)
    lengths = torch.tensor([width, width - 7, width - 20, width])[:rows]
    attn = (torch.arange(width)[None, :] < lengths[:, None]).long()
    comp = ((torch.arange(width)[None, :] >= prompt) & (attn == 1)).float()
    old = torch.full((rows, width), -float(torch.log(torch.tensor(float(vocab))))) * comp
    adv = torch.randn(rows, generator=g)
    return GRPOBatch(input_ids=ids, attention_mask=attn, completion_mask=comp, advantages=adv, old_logprobs=old)


def checksum(t):
    """Two int64 sums over the raw bits (plain and position-weighted): any flipped bit changes them."""
    t = t.detach().contiguous().view(-1)
    if t.numel() == 0:
        return (0, 0)
    bits = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).to(torch.int64)
    w = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
    return (int(bits.sum()), int((bits * w).sum()))


def independent_state(trainer):
    """The state that must survive, found from DeepSpeed's attributes directly (not the adapter's collector)."""
    eng = trainer.engine
    opt = eng.optimizer
    out = {}
    for n, p in eng.module.named_parameters():
        out["param:" + n] = p.ds_tensor if hasattr(p, "ds_tensor") else p
    flats = opt.bit16_groups_flat if trainer.zero_stage == 2 else [opt.lp_param_buffer]
    masters = opt.single_partition_of_fp32_groups if trainer.zero_stage == 2 else opt.fp32_partitioned_groups_flat
    for i, t in enumerate(flats):
        out[f"flat:{i}"] = t
    for i, t in enumerate(masters):
        out[f"master:{i}"] = t
    for i, st in enumerate(opt.optimizer.state.values()):
        for k, v in st.items():
            if torch.is_tensor(v) and v.is_cuda:
                out[f"optim:{i}.{k}"] = v
    if trainer.zero_stage == 3:
        out["grad_partitions"] = opt.grad_partitions_flat_buffer
    return out


def checksums(trainer):
    state = {k: checksum(v) for k, v in independent_state(trainer).items()}
    state.update({"collected:" + n: checksum(t) for n, t in trainer.state().swap_items()})
    return state


def final_state(trainer):
    return {k: v for k, v in checksums(trainer).items() if not k.startswith("collected:")}


_reference: dict = {}


def reference_run(model_dir, stage, lora):
    """Losses and final state of an identical engine that is never offloaded (cached per config)."""
    key = (stage, lora)
    if key not in _reference:
        _, alloc0 = baseline()
        t = make_trainer(model_dir, stage, lora)
        try:
            losses = [t.train_step(make_batch(s))["loss"] for s in range(STEPS)]
            _reference[key] = (losses, final_state(t))
        finally:
            t.close()
        # the tests' baselines are taken after this: a closed engine must leave nothing behind
        assert baseline()[1] - alloc0 <= ALLOC_MARGIN, "the closed reference engine still holds GPU memory"
    return _reference[key]
