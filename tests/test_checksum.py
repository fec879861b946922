"""The bridge checksum on the host: pins the algorithm (the GPU kernel must give the same values; see
tests/gpu/test_bridge_ipc.py) against a pure-Python reference and frozen values."""

import ctypes
import math
import os
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colomem import _C
from colomem.errors import InvalidArgumentError

M64 = (1 << 64) - 1


def _fmix64(k):
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & M64
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & M64
    k ^= k >> 33
    return k


def _term(i, w):
    return _fmix64(w ^ _fmix64((i * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & M64))


def reference(data: bytes, stride: int = 1) -> int:
    """The algorithm as documented in csrc/core/checksum.h, written out independently."""
    n_words = len(data) // 8
    idx = set(range(0, n_words, stride))
    if n_words:
        idx.add(n_words - 1)
    total = sum(_term(i, int.from_bytes(data[8 * i:8 * i + 8], "little")) for i in idx)
    if len(data) % 8:
        total += _term(n_words, int.from_bytes(data[8 * n_words:], "little"))
    total &= M64
    return _fmix64((total + _fmix64(len(data) ^ 0xC2B2AE3D27D4EB4F) + stride * 0x165667B19E3779F9) & M64)


def test_frozen_values():
    # Changing the algorithm breaks producers and consumers of different builds: these must not move.
    assert _C.checksum_buffer(b"") == reference(b"") == 0xA010D5C948D59909
    assert _C.checksum_buffer(b"hello world") == reference(b"hello world") == 0xC6FC42DE2D82B96E
    data = bytes(range(256)) * 4
    assert _C.checksum_buffer(data) == reference(data)
    assert _C.checksum_buffer(data, 7) == reference(data, 7)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 255, 256, 257, 4095, 4096, 4097])
@pytest.mark.parametrize("stride", [1, 2, 3, 64, 1000])
def test_matches_reference(n, stride):
    data = os.urandom(n)
    assert _C.checksum_buffer(data, stride) == reference(data, stride)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=600), stride=st.integers(1, 80))
def test_matches_reference_property(data, stride):
    assert _C.checksum_buffer(data, stride) == reference(data, stride)


def test_pointer_entry_equals_buffer_entry_at_any_alignment():
    raw = os.urandom(1000)
    buf = ctypes.create_string_buffer(raw, len(raw))
    base = ctypes.addressof(buf)
    for off in range(9):  # the host path reads unaligned words
        n = len(raw) - off
        assert _C.checksum(base + off, n, 3, 0, -1) == _C.checksum_buffer(raw[off:], 3) == reference(raw[off:], 3)


def test_order_dependent():
    a, b = os.urandom(8), os.urandom(8)
    assert a != b
    assert _C.checksum_buffer(a + b) != _C.checksum_buffer(b + a)


def test_every_single_byte_flip_detected_when_full():
    data = bytearray(os.urandom(203))
    ref = _C.checksum_buffer(bytes(data))
    for i in range(len(data)):
        data[i] ^= 0x01
        assert _C.checksum_buffer(bytes(data)) != ref, i
        data[i] ^= 0x01


def test_sampling_reads_exactly_the_grid_the_last_word_and_the_tail():
    stride = 5
    data = bytearray(os.urandom(8 * 23 + 3))  # 23 full words + 3 tail bytes
    ref = _C.checksum_buffer(bytes(data), stride)
    n_words = 23
    sampled = set(range(0, n_words, stride)) | {n_words - 1}
    for w in range(n_words):
        data[8 * w] ^= 0xFF
        changed = _C.checksum_buffer(bytes(data), stride) != ref
        data[8 * w] ^= 0xFF
        assert changed == (w in sampled), w
    data[-1] ^= 0x80  # the tail is always read
    assert _C.checksum_buffer(bytes(data), stride) != ref


def test_length_and_stride_are_part_of_the_value():
    assert _C.checksum_buffer(b"a") != _C.checksum_buffer(b"a\0")  # zero padding does not alias
    assert _C.checksum_buffer(b"") != _C.checksum_buffer(b"\0" * 8)
    data = os.urandom(64)
    assert _C.checksum_buffer(data, 1) != _C.checksum_buffer(data, 2)
    # a stride larger than the data still reads the first and last word
    assert _C.checksum_buffer(data, 10**12) == reference(data, 10**12)


def test_values_are_uint64_and_picklable():
    v = _C.checksum_buffer(os.urandom(100))
    assert 0 <= v < 1 << 64
    assert pickle.loads(pickle.dumps(v)) == v


def test_bad_arguments():
    with pytest.raises(InvalidArgumentError):
        _C.checksum_buffer(b"abc", 0)
    with pytest.raises(InvalidArgumentError):
        _C.checksum(0, 16, 1, 0, -1)  # null pointer with bytes to read


def test_checksum_timeout_is_optional_and_checked():
    data = bytes(range(256)) * 4
    buf = ctypes.create_string_buffer(data, len(data))
    ptr = ctypes.addressof(buf)
    want = _C.checksum_buffer(data, 1)
    assert _C.checksum(ptr, len(data), 1, 0, -1) == want  # the signature without the timeout still works
    assert _C.checksum(ptr, len(data), 1, 0, -1, timeout_s=math.inf) == want
    for bad in (math.nan, -1.0):
        with pytest.raises(InvalidArgumentError, match="timeout"):
            _C.checksum(ptr, len(data), 1, 0, -1, timeout_s=bad)


def _descs(windows):
    """(ctypes buffer of the windows' (address, nbytes, stride) words, its address) for checksum_many_into."""
    words = (ctypes.c_uint64 * (3 * max(1, len(windows))))(*[v for w in windows for v in w])
    return words, ctypes.addressof(words)


def test_a_batch_of_windows_gives_each_windows_own_checksum():
    data = os.urandom(10_000)
    buf = ctypes.create_string_buffer(data, len(data))
    base = ctypes.addressof(buf)
    spans = [(0, 0, 1), (0, 10_000, 1), (3, 17, 1), (8, 4096, 7), (1000, 8001, 64), (9999, 1, 1), (16, 800, 1000)]
    words, addr = _descs([(base + off, n, stride) for off, n, stride in spans])
    out = (ctypes.c_uint64 * len(spans))()
    _C.checksum_many_into(addr, len(spans), 0, 0, -1, ctypes.addressof(out))
    assert list(out) == [reference(data[off:off + n], stride) for off, n, stride in spans]
    _C.checksum_many_into(addr, 0, 0, 0, -1, ctypes.addressof(out))      # an empty batch writes nothing
    assert list(out) == [reference(data[off:off + n], stride) for off, n, stride in spans]


def test_a_batch_refuses_a_bad_window_and_a_missing_output():
    data = ctypes.create_string_buffer(64)
    words, addr = _descs([(ctypes.addressof(data), 64, 0)])
    out = (ctypes.c_uint64 * 1)()
    with pytest.raises(InvalidArgumentError, match="stride"):
        _C.checksum_many_into(addr, 1, 0, 0, -1, ctypes.addressof(out))
    words, addr = _descs([(ctypes.addressof(data), 64, 1)])
    with pytest.raises(InvalidArgumentError, match="host_out"):
        _C.checksum_many_into(addr, 1, 0, 0, -1, 0)


def test_host_only_build_refuses_device_checksum():
    if _C.build_info()["cuda"] and _C.device_count() > 0:
        pytest.skip("CUDA build with a device: covered by tests/gpu/test_bridge_ipc.py")
    from colomem.errors import NotAvailableError

    with pytest.raises(NotAvailableError):
        _C.checksum(4096, 64, 1, 0, 0)
    words, addr = _descs([(4096, 64, 1)])
    with pytest.raises(NotAvailableError):
        _C.checksum_many_into(addr, 1, 4096, 0, 0)
