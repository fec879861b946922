"""Trainer checkpoints on the host path: what is saved while offloaded (read from the pool) equals what is
saved resident, loading gives the state back bit for bit, the LoRA adapter and the merged model load in
peft / transformers, and a checkpoint of another layout or model is a clear error."""
from types import SimpleNamespace

import pytest
import torch

import colomem
from colomem.engines.deepspeed import checkpoint as ds_checkpoint
from colomem.engines.deepspeed import state as ds_state
from colomem.engines.deepspeed.strategies import ColomemOffload
from colomem.errors import ConfigError
from fakes.deepspeed import fake_zero2_engine

CPU = torch.device("cpu")
pytest.importorskip("transformers")


@pytest.fixture
def pool():
    p = colomem.PinnedPool("16MiB", pin=False, segment_bytes="16MiB")
    yield p
    p.close(force=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from colomem.grpo.tasks import make_task
    from colomem.grpo.tiny_model import model_dir

    return model_dir("tiny", make_task("successor").alphabet, dtype="float32",
                     cache_dir=tmp_path_factory.mktemp("ckpt-cache") / "models", log=lambda *_: None)


def batch_for(step: int):
    from colomem.grpo.batch import Completion, build_batch

    g = torch.Generator().manual_seed(step)
    comps = [[Completion(token_ids=torch.randint(3, 12, (3,), generator=g).tolist(), logprobs=[-1.0] * 3)
              for _ in range(4)] for _ in range(2)]
    return build_batch([[2, 4, 5, 6], [2, 7, 8, 9]], comps, torch.tensor([1.0, -1, 0.5, -0.5] * 2), pad_id=0)


# ------------------------------------------------------------------------------------- DeepSpeed trainer
def shell(engine, steps=0, **kw):
    """What checkpoint.py reads of a DeepSpeedTrainer, around a ZeRO-2-shaped engine (no DeepSpeed here)."""
    fields = dict(engine=engine, device=CPU, rank=0, zero_stage=2, world_size=1, lora=None,
                  deepspeed_version="0.19.8", steps=steps)
    return SimpleNamespace(**{**fields, **kw})


def engine_bytes(eng) -> dict:
    """Every value a resume must restore: storages by name, the Adam state, the counters."""
    st = ds_state.collect_engine_state(eng, CPU)
    out = {n: t.detach().clone() for c in ("params", "master", "other") for n, t in st.groups[c]}
    for i, s in enumerate(eng.optimizer.optimizer.state.values()):
        out.update({f"adam{i}.{k}": v.clone() for k, v in s.items()})
    out["global_steps"] = torch.tensor(eng.global_steps)
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("zero3_groups", [False, True], ids=["zero2", "zero3-groups"])
def test_deepspeed_state_from_the_pool_equals_resident_and_loads_bit_for_bit(pool, tmp_path, zero3_groups):
    eng = fake_zero2_engine(seed=0)
    if zero3_groups:     # ZeRO-3 hands a sub-group's partition to the inner optimizer only while stepping it
        eng.optimizer.optimizer.param_groups[0]["params"] = []
    eng.global_steps = 7
    want = engine_bytes(eng)
    ds_checkpoint.prepare_state(shell(eng, steps=3), tmp_path / "resident")()
    s = ColomemOffload(lambda: ds_state.collect_engine_state(eng, CPU), pool, CPU, 30.0)
    s.offload()
    assert eng.optimizer.bit16_groups_flat[0].untyped_storage().nbytes() == 0       # really offloaded
    ds_checkpoint.prepare_state(shell(eng, steps=3), tmp_path / "pool", s)()
    s.reload()
    s.close()
    a, b = (torch.load(tmp_path / d / "trainer-rank0.pt", weights_only=True) for d in ("resident", "pool"))
    assert same(a["storages"], b["storages"]) and a["storages"]
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for i in a["optimizer"]["state"]:
        assert same(a["optimizer"]["state"][i], b["optimizer"]["state"][i])

    for empty_adam in (False, True):        # in place into ZeRO's Adam state, or as new tensors
        fresh = fake_zero2_engine(seed=1)
        if zero3_groups:
            fresh.optimizer.optimizer.param_groups[0]["params"] = []
        params = list(fresh.module.parameters())
        if empty_adam:
            fresh.optimizer.optimizer.state.clear()
        fresh.global_steps = 0
        assert not same(engine_bytes(fresh), want)
        t = shell(fresh)
        ds_checkpoint.load_state(t, tmp_path / "pool")
        assert same(engine_bytes(fresh), want) and t.steps == 3
        assert list(fresh.module.parameters()) == params       # the same objects (DeepSpeed's views)
        assert torch.equal(fresh.module[0].weight, eng.module[0].weight)


def test_deepspeed_checkpoint_of_another_layout_or_model_is_a_clear_error(tmp_path):
    eng = fake_zero2_engine()
    ds_checkpoint.prepare_state(shell(eng), tmp_path)()
    with pytest.raises(ConfigError, match="world_size 1 there, 2 here"):
        ds_checkpoint.load_state(shell(fake_zero2_engine(), world_size=2), tmp_path)
    with pytest.raises(ConfigError, match="no trainer-rank1.pt"):
        ds_checkpoint.load_state(shell(fake_zero2_engine(), rank=1), tmp_path)
    other = fake_zero2_engine()
    other.optimizer.bit16_groups_flat[0].untyped_storage().resize_(8)
    with pytest.raises(ConfigError, match="another model"):
        ds_checkpoint.load_state(shell(other), tmp_path)


# ------------------------------------------------------------------------------------------- CPU trainer
def test_torch_trainer_saves_the_same_offloaded_as_resident(tiny, pool, tmp_path):
    from colomem.engines.stand_ins import TorchTrainer

    t = TorchTrainer(tiny, lr=1e-2, micro_batch=4, pool=pool)
    try:
        t.train_step(batch_for(0))
        t.save_state(tmp_path / "resident")
        t.offload()
        assert all(p.untyped_storage().nbytes() == 0 for p in t.model.parameters())
        t.save_state(tmp_path / "pool")
        t.reload()
    finally:
        t.close()
    a, b = (torch.load(tmp_path / d / "trainer.pt", weights_only=True) for d in ("resident", "pool"))
    assert same(a["model"], b["model"])
    for i in a["optimizer"]["state"]:
        assert same(a["optimizer"]["state"][i], b["optimizer"]["state"][i])
    from safetensors.torch import load_file

    assert same(load_file(tmp_path / "resident" / "model" / "model.safetensors"),
                load_file(tmp_path / "pool" / "model" / "model.safetensors"))


def test_torch_trainer_with_mapped_moments_saves_while_offloaded_and_resumes_bit_for_bit(tiny, pool, tmp_path):
    """optimizer_state_memory "mapped": a checkpoint written while the moments are in the pool, loaded into a
    fresh trainer, trains on exactly as the unbroken one (both moving their moments every step)."""
    from colomem.engines.stand_ins import TorchTrainer

    def trainer():
        return TorchTrainer(tiny, lr=1e-2, micro_batch=4, pool=pool, optimizer_state_memory="mapped")

    def step(t, k):
        t.offload()
        t.reload()
        t.train_step(batch_for(k))

    def state(t):
        return ({n: p.detach().clone() for n, p in t.model.named_parameters()},
                {f"{i}.{k}": v.clone() for i, st in enumerate(t.optimizer.state.values()) for k, v in st.items()})

    a = trainer()
    try:
        a.train_step(batch_for(0))
        step(a, 1)
        a.offload()
        moments = a._swaps[1].state
        assert moments is not None and moments.set.resident_bytes == 0     # the moments in the pool
        a.save_state(tmp_path / "ckpt")
        assert moments.set.resident_bytes == 0 and moments.active   # read there: not brought back for the save
        a.reload()
        for k in (2, 3):
            step(a, k)
        want = state(a)
    finally:
        a.close()
    b = trainer()
    try:
        b.load_state(tmp_path / "ckpt")
        for k in (2, 3):
            step(b, k)
        got = state(b)
        assert b._swaps[1].state.active                  # the loaded moments moved into mapped memory too
    finally:
        b.close()
    assert same(got[0], want[0]) and same(got[1], want[1])
    assert pool.stats()["in_use_bytes"] == 0


def test_lora_checkpoint_loads_in_peft_and_the_merged_model_in_transformers(tiny, pool, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from colomem.engines.stand_ins import TorchTrainer
    from colomem.grpo.config import LoraSpec

    t = TorchTrainer(tiny, lr=5e-2, micro_batch=4, pool=pool, lora=LoraSpec(r=4, alpha=8))
    ids = torch.tensor([[2, 4, 5, 6, 7]])
    try:
        for k in range(2):
            t.train_step(batch_for(k))
        with torch.no_grad():
            want = t.model(input_ids=ids).logits
        t.offload()
        t.save_state(tmp_path, merged=True)
        t.reload()
    finally:
        t.close()
    assert (tmp_path / "model" / "adapter_config.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    with torch.no_grad():
        before = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, tmp_path / "model")(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "model-merged", dtype=torch.float32)(
            input_ids=ids).logits
    assert not torch.allclose(before, want)                         # the adapter learned something
    torch.testing.assert_close(adapted, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged, want, rtol=1e-4, atol=1e-4)


def test_lora_all_linear_adapts_the_linear_layers_of_any_architecture():
    """The default adapter fits a model whose layers are not called q_proj..down_proj (GPT-NeoX here), and
    never the output head."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    from colomem.engines.lora import build_lora_config, check_lora_layers
    from colomem.grpo.config import LoraSpec

    model = AutoModelForCausalLM.from_config(GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                           num_attention_heads=4, intermediate_size=64))
    peft_model = get_peft_model(model, build_lora_config(LoraSpec()))
    check_lora_layers(peft_model)
    adapted = {n.split(".")[-1] for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"}


def same_trainer_files(a_dir, b_dir, steps: int) -> bool:
    """Two TorchTrainer files with the same weights, Adam state and step count (`steps`)."""
    a, b = (torch.load(d / "trainer.pt", weights_only=True) for d in (a_dir, b_dir))
    return (same(a["model"], b["model"]) and a["steps"] == b["steps"] == steps
            and all(same(a["optimizer"]["state"][i], b["optimizer"]["state"][i]) for i in a["optimizer"]["state"]))


def test_a_prepared_save_reads_the_pool_copies_of_its_step_and_the_next_offload_waits_for_its_write(
        tiny, pool, tmp_path, monkeypatch):
    """prepare_save on an offloaded trainer keeps views of the pool copies, not copies: the trainer reloads
    and trains on while the files are written, and its next offload (which rewrites those copies) waits
    until the write ended. The files hold the state of the step they were prepared at, bit for bit."""
    import threading

    from colomem.engines import torch_checkpoint
    from colomem.engines.stand_ins import TorchTrainer
    from colomem.errors import PhaseOrderError

    offloaded_again = threading.Event()
    seen = {}
    real_save = torch_checkpoint.save_torch

    def slow_save(obj, path):          # the write waits to see whether the offload got past it
        seen["offload_done_before_write"] = offloaded_again.wait(1.0)
        real_save(obj, path)
    t = TorchTrainer(tiny, lr=1e-2, micro_batch=4, pool=pool)
    try:
        t.train_step(batch_for(0))
        t.save_state(tmp_path / "resident")            # the reference: written at once, from the tensors
        t.offload()
        pending = t.prepare_save(tmp_path / "pooled")
        assert pending.reads_pool and not pending.started
        t.reload()
        t.train_step(batch_for(1))                     # changes every weight the pool copies hold
        with pytest.raises(PhaseOrderError, match="neither written nor dropped"):
            t.offload()
        monkeypatch.setattr(torch_checkpoint, "save_torch", slow_save)
        writer = threading.Thread(target=pending.write)
        writer.start()

        def offload() -> None:
            t.offload()
            offloaded_again.set()
        mover = threading.Thread(target=offload)
        mover.start()
        writer.join(60)
        mover.join(60)
        assert pending.done and pending.error is None and offloaded_again.is_set()
        assert seen["offload_done_before_write"] is False       # the offload waited for the write
        t.reload()
        dropped = t.prepare_save(tmp_path / "never")
        dropped.drop()
        t.offload()                                             # a dropped write holds nothing back
        t.reload()
    finally:
        t.close()
    assert same_trainer_files(tmp_path / "resident", tmp_path / "pooled", steps=1)
    assert not (tmp_path / "never").exists()


def test_a_resident_save_prepared_before_training_on_holds_its_own_copies(tiny, tmp_path):
    """Resident (nothing in a pool), prepare_save copies every tensor, torch's step counts included, so
    training on before the write changes nothing in the files."""
    from colomem.engines.stand_ins import TorchTrainer

    t = TorchTrainer(tiny, lr=1e-2, micro_batch=4)
    try:
        t.train_step(batch_for(0))
        t.save_state(tmp_path / "now")
        pending = t.prepare_save(tmp_path / "later")
        assert not pending.reads_pool
        t.train_step(batch_for(1))
        pending.write()
    finally:
        t.close()
    assert same_trainer_files(tmp_path / "now", tmp_path / "later", steps=1)


def test_deepspeed_state_prepared_resident_is_the_state_of_that_moment(tmp_path):
    """The DeepSpeed trainer's file prepared while resident holds copies: the engine changing every byte
    before the write (its next step) changes nothing in the file."""
    eng = fake_zero2_engine(seed=0)
    eng.global_steps = 4
    want = engine_bytes(eng)
    write = ds_checkpoint.prepare_state(shell(eng, steps=2), tmp_path)
    st = ds_state.collect_engine_state(eng, CPU)
    for c in ("params", "master", "other"):
        for _, t in st.groups[c]:
            t.detach().add_(1) if t.is_floating_point() else None
    for s in eng.optimizer.optimizer.state.values():
        for v in s.values():
            if isinstance(v, torch.Tensor):
                v.add_(1)
    eng.global_steps = 5
    write()
    fresh = fake_zero2_engine(seed=1)
    ds_checkpoint.load_state(shell(fresh), tmp_path)
    assert same(engine_bytes(fresh), want)
