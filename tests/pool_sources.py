"""The weight sources a sync reads in the loop after the trainer's offload: a set's pool copies (host views),
beside a pageable host tensor and a tensor that stayed on the device. Shared by the CPU and GPU tests."""

import torch

import colomem
from random_bytes import random_tensor

# odd sizes, mixed dtypes, one larger than the test buckets (split across them), one empty
SHAPES = [((7, 5), torch.bfloat16), ((1023,), torch.float32), ((33, 17, 3), torch.float16), ((4097,), torch.int8),
          ((3,), torch.int64), ((0,), torch.bfloat16), ((300, 257), torch.bfloat16), ((1,), torch.bool)]


def offloaded_sources(device: str, pool: colomem.PinnedPool, seed: int = 0):
    """(set, expected {name: CPU copy of the bytes}, [(name, source)]): the set's tensors offloaded into
    `pool`, their sources the set's host views; 'pageable' is a plain CPU tensor and 'resident' stays on
    `device` (the sources a sync mixes when part of the model is not in the set)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {f"w{i}": random_tensor(s, dt, gen, device) for i, (s, dt) in enumerate(SHAPES)}
    expected = {n: t.detach().cpu().clone() for n, t in tensors.items()}
    swap = colomem.SwapSet.from_tensors(tensors, pool, device=device)
    swap.offload()
    sources = []
    for n, t in tensors.items():
        view = swap.host_view(t)
        if view is None:  # an empty storage has no pool copy: the sync reads the tensor itself, as the loop does
            assert t.numel() == 0, n
            view = t
        assert view.device.type == "cpu" or t.numel() == 0, n
        sources.append((n, view))
    pageable = random_tensor((513,), torch.float32, gen, "cpu")
    resident = random_tensor((77, 3), torch.bfloat16, gen, device)
    expected["pageable"], expected["resident"] = pageable.clone(), resident.detach().cpu().clone()
    sources += [("pageable", pageable), ("resident", resident)]
    return swap, expected, sources


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def unpack(plans: list, buffers: list) -> dict:
    """{name: tensor} read back from packed buckets (plans[k] packed into buffers[k])."""
    from colomem.bridge.buckets import Reassembler, entry_view

    reasm, got = Reassembler(), {}
    for plan, buf in zip(plans, buffers):
        for e in plan.entries:
            out = reasm.add(e, entry_view(buf, e))
            if out is not None:
                got[out[0]] = out[1].clone()
    assert reasm.pending() == []
    return got
