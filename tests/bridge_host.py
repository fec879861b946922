"""What the host bridge's CPU tests share: the real host bridge recording its packs, a fixture that makes
bridges with importers attached (closed at the end), named random tensors and byte comparison."""
import pytest
import torch

from colomem.bridge import BridgeImporter, WeightBridge
from random_bytes import random_tensor


def same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


class RecordingBridge(WeightBridge):
    """The real host bridge, recording which buffer each pack fills; a pack into a buffer whose message the
    test still holds (not ACKed) fails the test."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.held: set = set()
        self.packs: list = []

    def _pack(self, i, plan, stride):
        assert i not in self.held, f"buffer {i} refilled before the ACK of the message that used it"
        super()._pack(i, plan, stride)
        self.packs.append(i)


@pytest.fixture
def make():
    """make(nbuffers, bucket_bytes, checksum) -> (a host bridge, an importer attached to it); importer=False
    -> (bridge, None). Everything made is closed at the end."""
    opened = []

    def make_(nbuffers=2, bucket_bytes=1024, checksum="full", importer=True):
        b = RecordingBridge(bucket_bytes=bucket_bytes, buffers=nbuffers, device="cpu", checksum=checksum, timeout=5.0)
        opened.append(b)
        if not importer:
            return b, None
        imp = BridgeImporter.connect(b.address, timeout=10)
        opened.append(imp)
        b.wait_for_importers(1, 10)
        return b, imp

    yield make_
    for x in reversed(opened):
        x.close()


def named(seed, n=10, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [(f"t{i}", random_tensor((60 + 97 * i,), dtype, gen)) for i in range(n)]  # several are split


def memfd_mapped(ptr):
    """Whether a bridge memfd is mapped at ptr in this process."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return "colomem-bridge" in line
    return False
