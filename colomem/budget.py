"""Memory budget of a colocated RL job: what must fit on each GPU in each phase, and what to offload.

    python -m colomem.budget --params 7e9 --lora --zero 2 --kv-gib 20 --gpus 1 --gpu-gib 141

Per GPU, bf16 mixed precision (DeepSpeed), AdamW:
    rollout phase  vLLM awake: weights (2 B/param / TP) + KV cache + vLLM workspace + its CUDA context,
                   next to whatever the trainer did not offload and the trainer process's CUDA context
    train phase    trainer: bf16 params (2 B/param), bf16 grads (2), fp32 master (4), Adam m and v (8);
                   ZeRO-1 shards master + Adam over the data-parallel GPUs, ZeRO-2 also the grads, ZeRO-3
                   also the params; LoRA trains only the adapter (the base is frozen bf16);
                   activations (with or without gradient checkpointing) and the logits of a micro-batch;
                   next to what vLLM keeps while asleep
The figures are estimates (within about 10-20 % for dense decoder-only models); measure with the runner's
memory table. Model shapes come from the nearest Qwen2.5 size (colomem.bench.shapes, the one table of
real model shapes) unless --hidden/--layers/--vocab are given.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Optional

from colomem.bench.shapes import QWEN2_5_FAMILY, ModelShape

GiB = float(1 << 30)

# parameter count -> shape, the candidates when only --params is given
BY_PARAMS: dict[float, ModelShape] = {float(s.params()): s for s in QWEN2_5_FAMILY}


@dataclass
class Shape:
    hidden: int
    layers: int
    vocab: int
    intermediate: int
    heads: int
    kv_heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.head_dim * self.kv_heads


def shape_for(params: float, hidden: Optional[int] = None, layers: Optional[int] = None,
              vocab: Optional[int] = None) -> Shape:
    """The nearest size of the family (by log of the parameter count), with the given dimensions replaced."""
    m = BY_PARAMS[min(BY_PARAMS, key=lambda p: abs(math.log(p / params)))]
    h, L, V, I, a, kv = m.hidden, m.layers, m.vocab, m.intermediate, m.heads, m.kv_heads
    if hidden and hidden != h:       # a custom width: scale the MLP and heads with it
        I, a = int(I * hidden / h), max(1, hidden // 128)
        kv = max(1, min(kv, a))
        h = hidden
    return Shape(h, layers or L, vocab or V, I, a, kv)


@dataclass
class Item:
    name: str
    bytes: float
    offloadable: bool = True


@dataclass
class Budget:
    inputs: dict
    rollout: list = field(default_factory=list)       # Items on the GPU while vLLM generates
    train: list = field(default_factory=list)         # Items on the GPU while the trainer trains
    trainer_state: list = field(default_factory=list)  # what the trainer holds between steps (offload set)
    gpu_bytes: float = 0.0
    advice: list = field(default_factory=list)
    offload: list = field(default_factory=list)       # minimal set to offload for the rollout to fit
    suggested_gpu_memory_utilization: Optional[float] = None
    placement: Optional[dict] = None                 # what the runner's planner would pick (--offload auto)
    optimizer_reload: str = "overlap"                # "step": the moments come back inside the optimizer step
    first_step_peak: float = 0.0                     # the trainer's peak on a step whose moments are born late

    @staticmethod
    def total(items) -> float:
        return sum(i.bytes for i in items)

    @property
    def rollout_fits(self) -> bool:
        return self.total(self.rollout) <= self.gpu_bytes

    @property
    def train_fits(self) -> bool:
        return self.total(self.train) <= self.gpu_bytes

    @property
    def fits(self) -> bool:
        return self.rollout_fits and self.train_fits

    def to_dict(self) -> dict:
        gib = lambda items: {i.name: round(i.bytes / GiB, 3) for i in items}  # noqa: E731
        return {"inputs": self.inputs, "gpu_gib": round(self.gpu_bytes / GiB, 3),
                "rollout_gib": gib(self.rollout), "rollout_total_gib": round(self.total(self.rollout) / GiB, 3),
                "train_gib": gib(self.train), "train_total_gib": round(self.total(self.train) / GiB, 3),
                "trainer_state_gib": gib(self.trainer_state),
                "pinned_host_per_gpu_gib": round(self.total(self.trainer_state) / GiB, 3),
                "rollout_fits": self.rollout_fits, "train_fits": self.train_fits, "fits": self.fits,
                "offload_at_least": self.offload,
                "suggested_gpu_memory_utilization": self.suggested_gpu_memory_utilization,
                "placement": self.placement, "optimizer_reload": self.optimizer_reload, "advice": self.advice}


def lora_params(shape: Shape, r: int) -> float:
    """Adapter parameters for rank r on every linear layer (q, k, v, o, gate, up, down)."""
    h, kv, I = shape.hidden, shape.kv_dim, shape.intermediate
    per_layer = (h + h) + (h + kv) * 2 + (h + h) + (h + I) * 2 + (I + h)
    return float(r * per_layer * shape.layers)


def checkpointed_layers(layers: int, grad_ckpt: bool, every: int = 1) -> int:
    """Decoder layers gradient checkpointing recomputes: every `every`-th one, none without it."""
    return math.ceil(layers / every) if grad_ckpt else 0


def activation_bytes(shape: Shape, micro_batch: int, seq_len: int, checkpointed: int) -> float:
    """Activations of one micro-batch, ~34 * b*s*h bytes per layer (flash attention, no s^2 term): a
    checkpointed layer keeps only its input (2 * b*s*h) and one of them at a time is recomputed whole."""
    bsh = micro_batch * seq_len * shape.hidden
    kept = 2.0 * bsh * checkpointed + 34.0 * bsh * (shape.layers - checkpointed)
    return kept + (34.0 * bsh if checkpointed else 0.0)


def estimate(params: float, *, lora: bool = False, lora_r: int = 16, zero: int = 2, gpus: int = 1, tp: int = 1,
             kv_gib: Optional[float] = None, kv_tokens: Optional[int] = None, gpu_gib: float = 141.0,
             micro_batch: int = 4, seq_len: int = 1024, grad_ckpt: bool = True, checkpoint_every: int = 1,
             hidden: Optional[int] = None,
             layers: Optional[int] = None, vocab: Optional[int] = None, vllm_overhead_gib: float = 2.0,
             vllm_asleep_gib: float = 1.5, context_gib: float = 0.6, host_gib: Optional[float] = None,
             reduce_bucket: float = 5e8, bridge_gib: float = 1.0, shared_base: bool = False,
             micro_batch_tokens: Optional[int] = None) -> Budget:
    """The budget of one GPU. gpus: data-parallel ranks (ZeRO shards over them); tp: vLLM tensor parallel.
    bridge_gib: the weight bridge's buffers (bucket size x buffers; 512 MiB x 2 by default), which stay
    allocated in the trainer process through both phases (0 with sync_transport='direct'). shared_base: a
    LoRA job whose trainer reads vLLM's weights (--shared-base): the base is counted once, as vLLM's, and it
    stays on the GPU while the trainer trains (vLLM sleeps its KV cache only); the sync is in process.
    checkpoint_every: with grad_ckpt, every K-th decoder layer is checkpointed (the runner's --checkpoint-every).
    micro_batch_tokens: micro-batches by a token budget (the runner's --micro-batch-tokens) instead of
    micro_batch rows: a micro-batch then holds at most that many positions, or one row of seq_len."""
    if params <= 0 or gpus < 1 or tp < 1 or zero not in (0, 1, 2, 3) or gpu_gib <= 0 or bridge_gib < 0:
        raise ValueError("need params > 0, gpus >= 1, tp >= 1, zero in 0..3, gpu_gib > 0, bridge_gib >= 0")
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
    if micro_batch_tokens is not None and micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
    if tp > gpus:
        raise ValueError(f"tp ({tp}) cannot exceed the number of GPUs ({gpus})")
    if shared_base and (not lora or zero == 3 or tp > 1):
        raise ValueError("a shared base needs --lora, ZeRO 0-2 and tp 1 (the runner refuses the others too)")
    if shared_base:
        bridge_gib = 0.0                     # the in-rank engine reads the trainer's tensors in process
    shape = shape_for(params, hidden, layers, vocab)
    P, N = float(params), float(gpus)
    b = Budget(inputs={"params": P, "lora": lora, "lora_r": lora_r if lora else None, "zero": zero,
                       "gpus": gpus, "tp": tp, "gpu_gib": gpu_gib, "micro_batch": micro_batch,
                       "seq_len": seq_len, "grad_ckpt": grad_ckpt,
                       "checkpoint_every": checkpoint_every if grad_ckpt else None, "shape": asdict(shape),
                       "micro_batch_tokens": micro_batch_tokens,
                       "shared_base": shared_base},
               gpu_bytes=gpu_gib * GiB)

    # ---- trainer state between steps (what an offload moves), per GPU
    shard = lambda stage: N if zero >= stage else 1.0  # noqa: E731
    if lora:
        A = lora_params(shape, lora_r)
        b.inputs["lora_params"] = A
        b.trainer_state = ([] if shared_base else [Item("frozen base (bf16)", 2 * P / shard(3))]) + [
                           Item("adapter (bf16)", 2 * A / shard(3)),
                           Item("adapter fp32 master", 4 * A / shard(1)),
                           Item("adapter Adam m+v", 8 * A / shard(1))]
        trainable = A
    else:
        b.trainer_state = [Item("params (bf16)", 2 * P / shard(3)), Item("fp32 master", 4 * P / shard(1)),
                           Item("Adam m+v (fp32)", 8 * P / shard(1))]
        trainable = P
    grads = Item("grads (bf16)", 2 * trainable / shard(2))
    buckets = Item("ZeRO reduce buckets", min(reduce_bucket * 2.0, 2 * trainable) if zero >= 1 else 0.0)

    # ---- activations of one micro-batch (bytes): ~34 * b*s*h per layer (flash attention, no s^2 term)
    # a micro-batch's rows and width: a token budget holds its tokens (or one longer row) as one wide row
    rows, width = (1, max(micro_batch_tokens, seq_len)) if micro_batch_tokens else (micro_batch, seq_len)
    act = activation_bytes(shape, rows, width, checkpointed_layers(shape.layers, grad_ckpt, checkpoint_every))
    # bf16 logits (kept for the backward) and fp32 work in chunks of at most 4096 positions
    # (grpo/selected_logprobs.py): the forward holds a chunk and its exp, the backward the logits' bf16 gradient
    # and one fp32 chunk; no fp32 copy of every logit is kept
    n, c = rows * width, min(rows * width, 4096)
    logits = shape.vocab * max(2 * n + 8 * c, 4 * n + 4 * c)
    gathered = 2 * P / N * (N - 1) / max(shape.layers, 1) * 2 if zero == 3 and N > 1 else 0.0

    bridge = Item("weight bridge buffers", bridge_gib * GiB, False)
    beside = [Item("trainer CUDA context", context_gib * GiB, False), bridge,
              Item("vLLM asleep (context + leftovers)", vllm_asleep_gib * GiB, False)]
    if shared_base:                          # vLLM's weights stay mapped: they are the trainer's base
        beside.append(Item(SHARED_BASE_ITEM, 2 * P, False))
    fwd = [grads, buckets, Item("activations", act), Item("logits", logits)]
    if gathered:
        fwd.append(Item("ZeRO-3 gathered layers", gathered))
    # The optimizer step has a peak of its own (activations are gone by then): ZeRO-1/2 flatten the gradient
    # partition in the model dtype and cast it to fp32 beside the gradients, then free them; ZeRO-3 holds one
    # sub-group's fp32 gradients at a time (DeepSpeed's sub_group_size, 1e9 elements).
    if zero <= 2:
        cast = [Item("optimizer step: grads flattened (bf16)", 2 * trainable / shard(2)),
                Item("optimizer step: grads cast to fp32", 4 * trainable / shard(2))]
    else:
        cast = [Item("optimizer step: a sub-group's grads in fp32", 4 * min(trainable / N, 1e9))]
    b.train, b.optimizer_reload = train_phase(b.trainer_state, fwd, cast, grads, beside, b.gpu_bytes)

    # ---- rollout
    if kv_gib is None:
        tokens = kv_tokens if kv_tokens is not None else 64 * 2048
        kv_bytes = 2.0 * shape.layers * shape.kv_dim * 2 * tokens / tp       # K and V, bf16
    else:
        kv_bytes = kv_gib * GiB
    weights = 2 * P / tp
    vllm = [Item("vLLM weights (bf16)", weights, False), Item("KV cache", kv_bytes, False),
            Item("vLLM workspace + context", vllm_overhead_gib * GiB, False)]
    b.suggested_gpu_memory_utilization = round(min(1.0, (weights + kv_bytes + vllm_overhead_gib * GiB) /
                                                   b.gpu_bytes + 0.01), 3)
    # the smallest set of trainer state to offload so the rollout fits (largest first)
    base = vllm + [Item("trainer CUDA context", context_gib * GiB, False), bridge]
    room = b.gpu_bytes - Budget.total(base)
    resident = sorted(b.trainer_state, key=lambda i: -i.bytes)
    kept = Budget.total(resident)
    for item in resident:
        if kept <= room:
            break
        b.offload.append(item.name)
        kept -= item.bytes
    left = [i for i in b.trainer_state if i.name not in b.offload]
    b.rollout = base + [Item(f"trainer {i.name} (not offloaded)", i.bytes) for i in left]

    b.placement = predicted_placement(b, base, vllm_asleep_gib * GiB)

    # ---- advice
    total_state = Budget.total(b.trainer_state)
    if not b.rollout_fits:
        over = Budget.total(b.rollout) - b.gpu_bytes
        b.advice.append(f"the rollout does not fit even with the whole trainer offloaded: {over / GiB:.1f} GiB "
                        f"over. Lower the KV cache (now {kv_bytes / GiB:.1f} GiB: --gpu-memory-utilization / "
                        f"--max-model-len) or raise vLLM tensor parallel (weights {weights / GiB:.1f} GiB per GPU)")
    elif b.offload:
        b.advice.append(f"offload at least: {', '.join(b.offload)} ({(total_state - kept) / GiB:.1f} GiB) before "
                        f"vLLM wakes")
    else:
        b.advice.append(f"the trainer state ({total_state / GiB:.1f} GiB) fits next to the awake rollout; offloading "
                        "it still frees room for a larger KV cache")
    if b.placement is not None:
        b.advice.append(f"the runner's planner (--offload auto) would pick: {b.placement['label']} "
                        f"({b.placement['why']}); it measures the real figures on the first step")
    if b.optimizer_reload == "step":
        b.advice.append("the optimizer step fits only with Adam's moments brought back inside it, once the "
                        "gradients are cast to fp32 and freed (resident through the step they would not fit): "
                        "the runner's --optimizer-reload auto does so; that copy is then not hidden")
    if not b.train_fits:
        over = Budget.total(b.train) - b.gpu_bytes
        tips = []
        if not grad_ckpt:
            tips.append("turn on gradient checkpointing")
        if micro_batch_tokens:
            tips.append("lower --micro-batch-tokens")
        elif micro_batch > 1:
            tips.append("lower --micro-batch")
        if not lora:
            tips.append("use LoRA")
        if zero < 3 and gpus > 1:
            tips.append("use ZeRO-3")
        if gpus == 1:
            tips.append("shard over more GPUs (ZeRO)")
        b.advice.append(f"training does not fit: {over / GiB:.1f} GiB over. Try: {', '.join(tips) or 'a larger GPU'}")
    if grad_ckpt and b.train_fits:
        _recompute_advice(b, shape, rows, width, checkpoint_every, (fwd, cast, grads, beside))
    moved = total_state
    if b.placement is not None:
        keep = set(b.placement["keep"])
        moved = sum(i.bytes for i in b.trainer_state if _CATEGORY.get(i.name, "other") not in keep)
    b.advice.append(f"pinned host memory for the offload: {moved / GiB:.1f} GiB per GPU with that placement "
                    f"({moved * gpus / GiB:.1f} GiB for {gpus} GPU(s) on one host; everything: "
                    f"{total_state / GiB:.1f} GiB per GPU)")
    if host_gib is not None and total_state * gpus > host_gib * GiB:
        b.advice.append(f"host RAM ({host_gib:.0f} GiB) is smaller than the offload ({total_state * gpus / GiB:.1f} "
                        "GiB): use LoRA, ZeRO-3 across more hosts, or keep part of the state on the GPU")
    return b


def _recompute_advice(b: Budget, shape: Shape, micro_batch: int, seq_len: int, every: int, parts: tuple) -> None:
    """With gradient checkpointing and room while training: the setting with the fewest checkpointed layers
    whose activations still fit (vLLM asleep), named in the advice."""
    from colomem.engines.recompute import fewer_checkpointed

    fwd, cast, grads, beside = parts
    now = checkpointed_layers(shape.layers, True, every)
    for flag, n, _ in fewer_checkpointed(shape.layers, now):
        act = Item("activations", activation_bytes(shape, micro_batch, seq_len, n))
        train, _ = train_phase(b.trainer_state, [act if i.name == "activations" else i for i in fwd], cast, grads,
                               beside, b.gpu_bytes)
        if Budget.total(train) <= b.gpu_bytes:
            b.advice.append(f"training has room to recompute fewer layers: {flag} checkpoints {n} of "
                            f"{shape.layers} (now {now}), an estimated training peak of "
                            f"{Budget.total(train) / GiB:.1f} GiB "
                            f"(vLLM asleep); less work in the backward, the same gradients. The runner measures "
                            "it after its first step and takes it where it measures the placement "
                            "(--trim-recompute auto; [colomem] training:)")
            return


MOMENTS = ("Adam m+v (fp32)", "adapter Adam m+v")


def train_phase(state: list, fwd: list, cast: list, grads: "Item", beside: list, gpu: float) -> tuple[list, str]:
    """The train phase's items at its peak, and when the optimizer state comes back ("overlap": with the rest,
    before the optimizer step; "step": inside it, after the gradients are cast and freed, as the runner's
    --optimizer-reload auto does when only that fits). The peak is the forward/backward's or the step's."""
    total = Budget.total
    resident = max([state + fwd + beside, state + [grads] + cast + beside], key=total)
    if total(resident) <= gpu or not any(i.name in MOMENTS for i in state) or len(cast) < 2:
        return resident, "overlap"
    rest = [i for i in state if i.name not in MOMENTS]
    back = [Item(f"{i.name}, back inside the optimizer step", i.bytes) for i in state if i.name in MOMENTS]
    at_step = max([rest + fwd + beside, rest + [grads] + cast + beside, rest + back + cast[1:] + beside], key=total)
    if total(at_step) >= total(resident):
        return resident, "overlap"
    return at_step, "step"


SHARED_BASE_ITEM = "vLLM weights = the shared base (bf16)"
# the estimate's state items -> the trainer's state categories the planner keeps or moves
_CATEGORY = {"params (bf16)": "params", "frozen base (bf16)": "params", "adapter (bf16)": "params",
             "fp32 master": "master", "adapter fp32 master": "master", "Adam m+v (fp32)": "optim",
             "adapter Adam m+v": "optim"}


def predicted_placement(b: Budget, rollout_base: list, vllm_asleep: float) -> Optional[dict]:
    """The placement colomem.runner.placement would choose from these estimates instead of measurements."""
    from colomem.runner.placement import MemoryFigures, choose

    state: dict[str, int] = {}
    for i in b.trainer_state:
        cat = _CATEGORY.get(i.name, "other")
        state[cat] = state.get(cat, 0) + int(i.bytes)
    shared = sum(i.bytes for i in rollout_base if i.name in ("trainer CUDA context", "weight bridge buffers"))
    # a shared base is vLLM's weights, already in the rollout's figure: the trainer's peak is the rest
    base = sum(i.bytes for i in b.train if i.name == SHARED_BASE_ITEM)
    # as the runner measures it: a first step, whose optimizer creates the moments once the gradients are gone
    created = state.get("optim", 0) if b.optimizer_reload == "step" else 0
    fig = MemoryFigures(total=int(b.gpu_bytes), rollout_used=int(Budget.total(rollout_base)),
                        trainer_left=int(shared), train_peak=int(Budget.total(b.train) - vllm_asleep - base),
                        state=state, train_other=int(vllm_asleep + base), optim_created=int(created))
    return choose("auto", "auto", [fig]).to_dict()


def format_budget(b: Budget) -> str:
    def table(title, items):
        rows = [f"  {i.name:<46} {i.bytes / GiB:9.2f} GiB" for i in items]
        tot = Budget.total(items)
        verdict = "fits" if tot <= b.gpu_bytes else "DOES NOT FIT"
        return "\n".join([f"{title}:"] + rows + [f"  {'total':<46} {tot / GiB:9.2f} GiB of {b.gpu_bytes / GiB:.0f} GiB"
                                                  f"  -> {verdict}"])
    inp = b.inputs
    micro = (f"micro-batches of at most {inp['micro_batch_tokens']} tokens (rows of up to {inp['seq_len']})"
             if inp.get("micro_batch_tokens") else f"micro-batch {inp['micro_batch']} x {inp['seq_len']} tokens")
    head = (f"{inp['params'] / 1e9:.2f} B params ({'LoRA r=%d' % inp['lora_r'] if inp['lora'] else 'full fine-tune'}),"
            f" ZeRO-{inp['zero']}, {inp['gpus']} GPU(s), vLLM TP {inp['tp']}, {micro}, gradient checkpointing "
            f"{'on' if inp['grad_ckpt'] else 'off'}")
    parts = [head, "", table("rollout phase (per GPU)", b.rollout), "", table("train phase (per GPU)", b.train), "",
             f"answer: {'fits' if b.fits else 'does NOT fit'}; suggested --gpu-memory-utilization "
             f"{b.suggested_gpu_memory_utilization}, or the KV cache itself: --kv-cache-bytes "
             f"{_kv_row(b) / GiB:.2f}GiB"]
    parts += [f"  - {a}" for a in b.advice]
    return "\n".join(parts)


def _kv_row(b: "Budget") -> float:
    """The KV cache the rollout table counts (bytes)."""
    return next((i.bytes for i in b.rollout if i.name == "KV cache"), 0.0)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m colomem.budget",
                                description="Does a colocated RL job fit on the GPU, and what should be offloaded?")
    p.add_argument("--params", type=float, required=True, help="model parameters, e.g. 7e9")
    p.add_argument("--lora", action="store_true", help="LoRA fine-tune (default: full)")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--zero", type=int, default=2, choices=(0, 1, 2, 3))
    p.add_argument("--gpus", type=int, default=1, help="data-parallel GPUs (ZeRO shards over them)")
    p.add_argument("--tp", type=int, default=1, help="vLLM tensor parallel size")
    p.add_argument("--kv-gib", type=float, help="KV cache per GPU in GiB (default: from --kv-tokens)")
    p.add_argument("--kv-tokens", type=int, help="tokens the KV cache must hold (default 64 x 2048)")
    p.add_argument("--gpu-gib", type=float, default=141.0, help="memory of one GPU (H200: 141)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch-tokens", type=int,
                   help="micro-batches by a token budget instead of --micro-batch rows (the runner's flag)")
    p.add_argument("--no-grad-ckpt", dest="grad_ckpt", action="store_false")
    p.add_argument("--checkpoint-every", type=int, default=1,
                   help="with gradient checkpointing: every K-th decoder layer only (the runner's flag)")
    p.add_argument("--hidden", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--vllm-overhead-gib", type=float, default=2.0)
    p.add_argument("--vllm-asleep-gib", type=float, default=1.5)
    p.add_argument("--host-gib", type=float, help="host RAM for the pinned pool (checked when given)")
    p.add_argument("--bridge-gib", type=float, default=1.0,
                   help="weight-bridge buffers on the GPU: bucket size x buffers (runner default 512 MiB x 2)")
    p.add_argument("--shared-base", action="store_true",
                   help="LoRA with the trainer's base as vLLM's weights (one copy; the runner's --shared-base)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the tables")
    a = p.parse_args(argv)
    try:
        b = estimate(a.params, lora=a.lora, lora_r=a.lora_r, zero=a.zero, gpus=a.gpus, tp=a.tp, kv_gib=a.kv_gib,
                     kv_tokens=a.kv_tokens, gpu_gib=a.gpu_gib, micro_batch=a.micro_batch, seq_len=a.seq_len,
                     grad_ckpt=a.grad_ckpt, checkpoint_every=a.checkpoint_every, hidden=a.hidden,
                     layers=a.layers, vocab=a.vocab,
                     vllm_overhead_gib=a.vllm_overhead_gib, vllm_asleep_gib=a.vllm_asleep_gib, host_gib=a.host_gib,
                     bridge_gib=a.bridge_gib, shared_base=a.shared_base, micro_batch_tokens=a.micro_batch_tokens)
    except ValueError as e:
        p.error(str(e))
    print(json.dumps(b.to_dict(), indent=1) if a.json else format_budget(b))
    return 0 if b.fits else 1


if __name__ == "__main__":
    sys.exit(main())
