"""The DeepSpeed adapter without DeepSpeed: the weights it syncs (full and merged LoRA), the trainer's life
(closing, ZeRO-3's hooks and caches, F.linear), its training step, and what an offload reports."""

import copy
import gc
import warnings
import weakref
from types import SimpleNamespace

import pytest
import torch

import colomem
from colomem.engines import deepspeed as dsa
from colomem.engines.deepspeed import state as ds_state
from colomem.engines.deepspeed.strategies import ColomemOffload
from colomem.engines.deepspeed.weights import SyncSource
from colomem.engines.lora import check_lora_layers
from colomem.errors import InvalidArgumentError, PhaseOrderError
from colomem.grpo.config import LoraSpec
from fakes.deepspeed import (Coordinator, StackPushingEngine, bare_trainer, closable_trainer, fake_zero2_engine,
                            fake_zero3_engine)
from fakes.models import lora_model, tiny_qwen2

CPU = torch.device("cpu")


@pytest.fixture
def pool():
    p = colomem.PinnedPool("1MiB", pin=False)
    yield p
    p.close(force=True)


# ----------------------------------------------------------------------------------- LoRA named weights
def test_named_weights_full_model_are_the_hf_names():
    model = tiny_qwen2()
    t = bare_trainer(model, None)
    got = dict(t.named_weights())
    want = dict(model.named_parameters())
    assert list(got) == list(want)            # same names, same order, tied lm_head left out like HF does
    assert all(got[k].data_ptr() == want[k].data_ptr() for k in want)     # views, no copies


def test_named_weights_merged_lora_equals_peft_merge_without_touching_the_adapter():
    model, _ = lora_model()
    t = bare_trainer(model, LoraSpec())
    adapter_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    got = dict(t.named_weights(merged=True))
    reference = copy.deepcopy(model).merge_and_unload()
    want = dict(reference.named_parameters())
    assert list(got) == list(want)
    for k in want:
        # fp32 merge then one rounding to bf16; peft merges in bf16: within a bf16 ulp or two
        torch.testing.assert_close(got[k].float(), want[k].float(), atol=2e-2, rtol=1e-2)
    for n, p in model.named_parameters():
        if "lora_" in n:
            assert torch.equal(p, adapter_before[n])
    base = dict(t.named_weights(merged=False))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(base[q], model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight)
    assert not torch.equal(base[q], got[q])


def test_lora_state_names_match_peft_save_format():
    peft = pytest.importorskip("peft")
    model, _ = lora_model()
    t = bare_trainer(model, LoraSpec())
    got = t.lora_state()
    want = peft.get_peft_model_state_dict(model)
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]) and got[k].device.type == "cpu"


def test_sync_staging_while_offloaded_and_phase_errors(pool):
    """prepare_sync's staging path (what offload() does for merged LoRA or without host views)."""
    model, _ = lora_model()
    t = bare_trainer(model, LoraSpec(), pool=pool)
    want = {k: v.clone() for k, v in t.named_weights(merged=True)}
    plan, staged = t._weights.plan_sync(True, False, t._staging, pool)
    assert staged >= sum(v.numel() * v.element_size() for v in want.values())
    t._offloaded = True
    with pytest.raises(PhaseOrderError, match="prepare_sync"):
        t.named_weights()
    t._sync = SyncSource(True, t._weights.resolve_sync(plan, None))
    got = dict(t.named_weights(merged=True))
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k])
    with pytest.raises(PhaseOrderError, match="merged=True"):
        t.named_weights(merged=False)
    t._staging.free()
    assert pool.stats()["in_use_bytes"] == 0


def test_cpu_trainer_merge_is_the_same_merge():
    """engines.lora.merged_named_weights (TorchTrainer's) gives what the DeepSpeed trainer's named_weights does."""
    from colomem.engines.lora import merged_named_weights

    model, _ = lora_model()
    want = dict(bare_trainer(model, LoraSpec()).named_weights(merged=True))
    got = dict(merged_named_weights(model))
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_lora_on_embeddings_is_refused():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_qwen2(), dsa.build_lora_config(LoraSpec(target_modules=["embed_tokens"])))
    with pytest.raises(InvalidArgumentError, match="linear layers only"):
        check_lora_layers(model)


def test_closed_trainer_refuses_work():
    t = bare_trainer(tiny_qwen2(), None)
    t._closed = True
    with pytest.raises(PhaseOrderError, match="closed"):
        t.named_weights()


def test_unresizable_storage_is_kept_reported_and_still_readable(pool):
    """Memory colomem cannot shrink (from_blob, DLPack, mmap'd checkpoints) stays put and is reported."""
    eng = fake_zero2_engine()
    raw = bytearray(torch.arange(8, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes())
    foreign = torch.frombuffer(raw, dtype=torch.bfloat16)
    eng.module.register_buffer("foreign", foreign)
    st = dsa.collect_engine_state(eng, CPU)
    assert st.skipped == [("foreign", 16)]
    assert all(n != "foreign" for n, _ in st.swap_items())
    s = ColomemOffload(lambda: dsa.collect_engine_state(eng, CPU), pool, CPU, 30.0)
    s.offload()
    assert s.host_view(foreign) is None
    t = bare_trainer(eng.module, None)
    items = t._weights.resolve_sync([("foreign", ("view", foreign)), ("0.weight", ("view", eng.module[0].weight))], s)
    assert items[0][1] is foreign and items[1][1].untyped_storage().nbytes() > 0
    s.reload()
    s.close()


# ------------------------------------------- ZeRO-3: nothing process-wide keeps a closed engine's state alive
CACHES = ds_state.lru_caches(Coordinator.params_to_release)


def test_lru_cache_found_behind_a_decorator_without_wraps():
    assert len(CACHES) == 1 and CACHES[0].cache_info().maxsize is None
    assert ds_state.lru_caches(lambda: None) == [] and ds_state.lru_caches(None) == []


def test_zero3_release_frees_the_closed_engine_and_keeps_the_others():
    stack: list = []
    other = fake_zero3_engine(stack)
    eng = fake_zero3_engine(stack)
    opt = weakref.ref(eng.optimizer)
    # each holder alone keeps the whole optimizer alive
    ds_state.release_zero3_references(eng.module[1][0], stack, [])          # only part of the engine
    gc.collect()
    assert opt() is not None
    n = ds_state.release_zero3_references(eng.module, stack, CACHES)
    assert n >= 3
    assert [id(m) for m in stack] == [id(other.module), id(other.module[1]), id(other.module[1][0])]
    assert not hasattr(eng.module[0].weight, "_z3_optimizer")
    assert other.module[0].weight._z3_optimizer is other.optimizer      # another live engine keeps its links
    del eng
    gc.collect()
    assert opt() is None


def test_trim_module_stack_drops_only_what_the_step_left():
    a, b, c = object(), object(), object()
    stack = [a, b, c]
    assert ds_state.trim_module_stack(stack, 1) == 2 and stack == [a]
    assert ds_state.trim_module_stack(stack, 1) == 0 and stack == [a]
    assert ds_state.trim_module_stack(None, 0) == 0


def test_functional_linear_goes_back_when_the_last_trainer_that_saw_it_replaced_closes():
    """ZeRO-3's set-up replaces F.linear process-wide and never restores it; the guard puts torch's back after
    the last trainer closes, so a later job's numerics do not depend on what ran before it."""
    torch_linear, ds_linear = object(), object()
    ns = SimpleNamespace(linear=torch_linear)
    guard = ds_state.FunctionalLinearGuard(ns)

    def zero3_setup():
        if ns.linear is torch_linear:              # DeepSpeed replaces it only when it is torch's own
            ns.linear = ds_linear
        return "engine3"

    assert guard.setup(lambda: "engine2") == ("engine2", False)      # a ZeRO-2 set-up leaves it alone
    assert guard.setup(zero3_setup) == ("engine3", True)
    assert guard.setup(zero3_setup) == ("engine3", True)             # a second one sees it replaced too
    assert guard.setup(lambda: "engine2") == ("engine2", True)       # and so does a ZeRO-2 one meanwhile
    assert guard.holders == 3 and ns.linear is ds_linear
    guard.release()
    guard.release()
    assert ns.linear is ds_linear                    # a live trainer still runs with it
    guard.release()
    assert ns.linear is torch_linear and guard.holders == 0
    guard.release()                                  # one release too many changes nothing
    assert ns.linear is torch_linear

    # a set-up that fails after replacing it gives it back at once
    def failing_setup():
        zero3_setup()
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError):
        guard.setup(failing_setup)
    assert ns.linear is torch_linear and guard.holders == 0

    # someone else's replacement, made while a trainer held DeepSpeed's, is theirs: it stays
    guard.setup(zero3_setup)
    mine = object()
    ns.linear = mine
    guard.release()
    assert ns.linear is mine


def test_close_unhooks_zero3_and_warns_when_the_state_is_still_held(monkeypatch):
    stack: list = []
    monkeypatch.setattr(ds_state, "zero3_global_holders", lambda: (stack, CACHES))
    eng = fake_zero3_engine(stack)
    opt, module = weakref.ref(eng.optimizer), weakref.ref(eng.module)
    t = closable_trainer(eng)
    del eng
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        t.close()
    # nothing of the trainer (its weight export included) keeps the module's parameters alive
    assert opt() is None and module() is None and stack == [] and t.engine is None
    held = fake_zero3_engine(stack).optimizer                          # the caller keeps the optimizer
    t = closable_trainer(SimpleNamespace(module=None, optimizer=held, destroy=lambda: None))
    with pytest.warns(RuntimeWarning, match="FakeZero3Optimizer is still referenced"):
        t.close()


def _stack_engine_trainer(model, stack, micro_batch):
    """A bare trainer around a StackPushingEngine over `model`, and a batch of two rows to train on."""
    from colomem.grpo.batch import GRPOBatch
    from colomem.grpo.config import GRPOConfig

    eng = StackPushingEngine(model, [] if stack is None else stack)
    t = bare_trainer(eng.module, None)
    t.__dict__.update(engine=eng, grpo=GRPOConfig(kl_coef=0.0, log_entropy=False), micro_batch=micro_batch,
                      steps=0, _ref_fn=None, _fwd_stack=stack)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    comp = torch.ones(2, 8)
    comp[:, :3] = 0
    batch = GRPOBatch(ids, torch.ones(2, 8, dtype=torch.long), comp, torch.tensor([1.0, -1.0]),
                      old_logprobs=torch.full((2, 8), -4.0) * comp)
    return t, batch


def test_train_step_leaves_deepspeeds_module_stack_as_it_found_it():
    root = object()
    stack = [root]
    t, batch = _stack_engine_trainer(tiny_qwen2(), stack, 1)
    t.train_step(batch)
    assert stack == [root]


def test_train_step_trains_in_training_mode_so_checkpointed_layers_recompute():
    """from_pretrained leaves a model in eval mode, where transformers checkpoints no layer: train_step trains
    in training mode, so each checkpointed decoder layer runs its forward again in the backward."""
    from colomem.engines.recompute import checkpointed_layers, decoder_layers, enable_recompute, recomputed_layers

    model = tiny_qwen2().eval()                               # as from_pretrained returns it
    enable_recompute(model, 1)
    layers = decoder_layers(model)
    calls = [0]
    handles = [m.self_attn.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for m in layers]
    t, batch = _stack_engine_trainer(model, None, 2)
    assert recomputed_layers(model) == 0 and checkpointed_layers(model) == len(layers)   # flags alone do nothing
    out = t.train_step(batch)
    for h in handles:
        h.remove()
    assert model.training and all(m.training for m in layers)
    assert out["recomputed_layers"] == len(layers)            # the step's metrics say what it recomputed
    assert calls[0] == 2 * len(layers)            # one micro-batch: each attention's forward, then its recompute


def test_the_peak_at_the_optimizer_steps_start_is_read_before_an_at_step_reload_and_its_figures_reported(pool):
    """The step-start hook, registered first, reads the peak before the at-step reload brings the state back
    (what could come back before the step must fit beside that peak); the reload's copies are timed."""
    from colomem.engines.deepspeed.step_reload import ReloadAtStep, StepStartPeak, reload_figures

    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.1)
    held = [100]
    peak = StepStartPeak(opt, lambda: held[0])
    hook = ReloadAtStep(opt, lambda: held.append(held.pop() + 50) or 7)    # the reload raises what is held
    hook.arm()
    w.grad = torch.ones(4)
    opt.step()
    assert peak.bytes == 100 and held == [150] and hook.nbytes == 7 and not hook.armed
    opt.step()                                             # every step, armed or not
    assert peak.bytes == 150
    peak.close()
    hook.close()
    opt.step()
    assert peak.bytes == 150
    assert reload_figures(None) == {}
    eng = fake_zero2_engine()
    s = ColomemOffload(lambda: dsa.collect_engine_state(eng, CPU), pool, CPU, 30.0)
    s.offload()
    s.reload(late=False)
    assert s.reload_late() > 0
    fig = reload_figures(s.late.last_stats)
    assert set(fig) == {"optimizer_reload_copy_s", "optimizer_reload_regrow_s"} and all(v >= 0 for v in fig.values())
    s.close()


def test_an_offload_names_what_it_left_only_beyond_what_it_meant_to_keep():
    """The (slow) scan of live tensors runs when an offload left more allocated than its kept categories and
    its deferred part, not whenever a placement keeps most of the trainer on the GPU."""
    mib = 1 << 20
    sizes = {"params": 900 * mib, "master": 1800 * mib, "optim": 3600 * mib, "grads": 0}
    kept = ("params", "master")
    assert not ds_state.worth_naming(2700 * mib, sizes, kept, 0)               # exactly what stays
    assert not ds_state.worth_naming(6300 * mib, sizes, kept, 3600 * mib)      # the moments still copying out
    assert ds_state.worth_naming(2700 * mib + 17 * mib, sizes, kept, 0)        # 17 MiB nobody meant to keep
    assert ds_state.worth_naming(2700 * mib, sizes, (), 0)                     # everything was to go
    assert not ds_state.worth_naming(8 * mib, sizes, (), 0)


def test_the_scan_of_what_an_offload_left_names_real_tensors_past_a_compiled_models_fake_ones():
    """A compiled model leaves Dynamo's fake tensors alive, their sizes symbols: the scan names the real
    tensors, largest first, and does not ask the symbolic shape engine to order the fake ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = [mode.from_tensor(torch.empty(4 + i, 8)) for i in range(3)]     # symbolic storage sizes
    assert not isinstance(fakes[0].untyped_storage().nbytes(), int)
    big, small = torch.empty(3 << 18, dtype=torch.bfloat16), torch.empty(1 << 18)   # 1.5 and 1 MiB
    names = ds_state.left_behind(CPU, top=50).split("; ")
    assert names.index(f"[{3 << 18}] bfloat16 1.5 MiB") < names.index(f"[{1 << 18}] float32 1.0 MiB")
    del fakes, big, small
