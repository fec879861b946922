"""What the GPU tests of a SwapSet's small-storage paths (staging chunks, slabs) share: a tensor's bytes read
back on the host, the driver's free memory once the queued work is done, and one pinned pool per module."""
import pytest
import torch

import colomem


def as_bytes(t):
    return t.detach().contiguous().view(-1).view(torch.uint8).cpu()  # on the host: no GPU memory held


def driver_free():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


@pytest.fixture(scope="module")
def pool():
    p = colomem.PinnedPool("3GiB")
    yield p
    p.close(force=True)
