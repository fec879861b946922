"""A DeepSpeed engine without DeepSpeed: ZeRO-2- and ZeRO-3-shaped stand-ins with the attribute names the
adapter reads (DeepSpeed 0.19), on real torch tensors, an engine behind the methods train_step calls, and
DeepSpeedTrainer shells around such engines (built without DeepSpeed or a GPU)."""
import contextlib
import functools
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from colomem.engines.background import BackgroundSlot
from colomem.engines.deepspeed import DeepSpeedTrainer
from colomem.engines.deepspeed.weights import Staging, WeightExport
from colomem.engines.pending_write import WriteGuard
from colomem.swap import PendingReloads

CPU = torch.device("cpu")


@dataclass
class IPGBucket:                       # the shape of DeepSpeed's stage_1_and_2.IPGBucket
    buffer: list = field(default_factory=list)
    params: list = field(default_factory=list)


def fake_zero2_engine(seed=0, hidden=4):
    """bf16 params as views into one flat buffer, fp32 master partition, AdamW state after one step, an
    ipg bucket (scratch) and one tensor only the safety-net walk can find. hidden: the width between its two
    layers (larger: state of many pages)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Linear(hidden, 2)).to(torch.bfloat16)
    module.register_buffer("inv_freq", torch.rand(5, generator=g))
    params = list(module.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params]).clone()
    off = 0
    for p in params:
        p.data = flat[off:off + p.numel()].view_as(p)
        off += p.numel()
    master = flat.float().clone().requires_grad_(True)
    inner = torch.optim.AdamW([master], lr=1e-2)
    master.grad = torch.randn(master.shape, generator=g)
    inner.step()
    master.grad = None
    opt = SimpleNamespace(optimizer=inner, bit16_groups_flat=[flat], single_partition_of_fp32_groups=[master],
                          averaged_gradients={0: None}, grads_in_partition=None,
                          ipg_buckets={torch.bfloat16: IPGBucket(buffer=[torch.empty(64, dtype=torch.bfloat16)])},
                          new_release_buffer=torch.arange(16, dtype=torch.float32))
    return SimpleNamespace(zero_optimization_stage=lambda: 2, optimizer=opt, module=module)


def nvtx_like(func):                      # DeepSpeed's instrument_w_nvtx: a wrapper without functools.wraps
    def wrapped_fn(*args, **kwargs):
        return func(*args, **kwargs)
    return wrapped_fn


class Coordinator:                        # PartitionedParameterCoordinator: one lru_cache shared by all instances
    def __init__(self, owner):
        self.owner = owner                # the real coordinator reaches the optimizer too (through the engine)

    @nvtx_like
    @functools.lru_cache(maxsize=None)
    def params_to_release(self, submodule, step_id):
        return {id(p) for p in submodule.parameters()}


class FakeZero3Optimizer:
    def __init__(self, module):
        self.fp32_partitioned_groups_flat = [torch.zeros(1024)]
        self.coordinator = Coordinator(self)
        for p in module.parameters():
            p._z3_optimizer = self        # what stage3._link_all_hp_params does


def fake_zero3_engine(stack):
    """A ZeRO-3-shaped engine registered where DeepSpeed 0.19 registers one: its root on FWD_MODULE_STACK
    (plus what an early-stopped checkpoint recompute leaves there), a submodule in the shared lru cache."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 2)))
    opt = FakeZero3Optimizer(module)
    stack += [module, module[1], module[1][0]]
    opt.coordinator.params_to_release(module[1], 0)
    return SimpleNamespace(module=module, optimizer=opt, destroy=lambda: None, zero_optimization_stage=lambda: 3)


class StackPushingEngine(torch.nn.Module):
    """A model behind the engine methods train_step calls; every forward leaves two entries on `stack`, like
    ZeRO-3 pre-forward hooks whose post-forward hooks an early-stopped checkpoint recompute skipped."""

    def __init__(self, model, stack):
        super().__init__()
        self.module, self.stack = model, stack
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def forward(self, **kw):
        self.stack += [self.module, self.module.model]
        return self.module(**kw)

    def set_gradient_accumulation_boundary(self, flag):
        pass

    def backward(self, loss, scale_wrt_gas=True):
        loss.backward()

    def step(self):
        self.opt.step()
        self.opt.zero_grad()

    def get_global_grad_norm(self):
        return None

    def get_lr(self):
        return [1e-3]


def zero2_tensors(eng):
    """(fp32 master partition, a bf16 weight, the Adam moments) of a fake_zero2_engine: one of each category
    an offload moves differently."""
    moments = [t for st in eng.optimizer.optimizer.state.values() for t in st.values()
               if isinstance(t, torch.Tensor) and t.numel() > 1]
    assert moments, "the fake engine's Adam state has moments"
    return eng.optimizer.single_partition_of_fp32_groups[0], eng.module[0].weight, moments


def zero2_offload(pool):
    """ColomemOffload (the DeepSpeed trainer's offload) over a fake_zero2_engine's state, into `pool`; with
    that engine's zero2_tensors and clones of them (master, weight, *moments) to compare after a reload."""
    from colomem.engines import deepspeed as dsa
    from colomem.engines.deepspeed.strategies import ColomemOffload

    eng = fake_zero2_engine()
    strategy = ColomemOffload(lambda: dsa.collect_engine_state(eng, CPU), pool, CPU, 30.0)
    master, weight, moments = zero2_tensors(eng)
    return strategy, (master, weight, moments), [t.clone() for t in (master, weight, *moments)]


@contextlib.contextmanager
def zero2_swap():
    """(pool, strategy, (master, weight, moments), clones) of zero2_offload in a fresh unpinned pool, which is
    closed afterwards (forced: a failed test may leave copies in it)."""
    import colomem

    pool = colomem.PinnedPool("1MiB", pin=False)
    try:
        yield (pool, *zero2_offload(pool))
    finally:
        pool.close(force=True)


def unchanged(tensors, before) -> bool:
    """Whether every tensor holds the bytes of its clone in `before`."""
    return all(torch.equal(t, b) for t, b in zip(tensors, before))


def bare_trainer(model, lora, pool=None):
    """A DeepSpeedTrainer shell around a plain (ZeRO-2-like: full tensors) model, without DeepSpeed."""
    t = DeepSpeedTrainer.__new__(DeepSpeedTrainer)
    t.__dict__.update(model=model, lora=lora, zero_stage=2, world_size=1, device=CPU, _closed=False,
                      _offloaded=False, _sync=None, _lora_cache=None, _pool=pool, _staging=Staging(), _params_kept=False,
                      _weights=WeightExport(model, zero_stage=2, world_size=1, device=CPU),
                      _pending=PendingReloads(), timeout_s=30.0, shared=None, _shared_storages=frozenset(),
                      optimizer_reload="overlap", _step_reload=None, _strategies={}, micro_batch_tokens=None,
                      _finishing=BackgroundSlot(), _writes=WriteGuard())
    return t


def closable_trainer(engine):
    t = bare_trainer(engine.module, None)
    t.__dict__.update(engine=engine, zero_stage=3, _strategies={}, _owns_pool=False, _ref_fn=None,
                      timeout_s=30.0, deepspeed_version="0.19.8", _fwd_stack=None)
    return t
