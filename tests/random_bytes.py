"""Random test tensors: random bytes reinterpreted as a dtype, so round trips are checked on every bit
pattern (NaN payloads too). Shared by the CPU tests and the GPU bridge peer process."""

import torch


def random_tensor(shape, dtype, gen, device="cpu"):
    nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2  # only 0 and 1 are valid bools
    return raw.view(dtype).reshape(shape).to(device)
