"""The second process of the two-process bridge tests: a bridge consumer or producer on the same GPU
(tests/gpu/test_bridge_ipc.py) or on the same machine with a host bridge (tests/test_bridge_socket_cpu.py).

Prints one JSON object per line (events) on stdout; the test reads them. Also holds the named tensors both
sides regenerate from a seed, so the consumer checks bytes without receiving them any other way, and the
parent's helpers that start this process and read its events.
"""

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: shared test helpers
from child_env import child_pythonpath  # noqa: E402
from random_bytes import random_tensor  # noqa: E402

BUCKET_BYTES = 1 << 20  # small buckets: many messages, several split tensors
PEER = Path(__file__).resolve()


def named_tensors(version: int, device) -> list:
    """Random bytes of every common dtype, odd shapes, zero-size, a scalar, non-contiguous views, and
    tensors larger than a bucket (split). Content depends on the version."""
    g = torch.Generator().manual_seed(1000 + version)
    specs = [
        ("emb", torch.bfloat16, (700, 1000)),        # 1.4 MB: split
        ("w.f32", torch.float32, (129, 33)),
        ("w.f16", torch.float16, (3, 5, 7)),
        ("w.f64", torch.float64, (17,)),
        ("i8", torch.int8, (1023,)),
        ("u8", torch.uint8, (4101,)),
        ("i16", torch.int16, (9, 9)),
        ("i32.big", torch.int32, (600_000,)),       # 2.4 MB: split over three buckets
        ("i32.empty", torch.int32, (0,)),
        ("i64", torch.int64, (3,)),
        ("mask", torch.bool, (77,)),
        ("c64", torch.complex64, (5, 5)),
        ("scalar", torch.float32, ()),
    ]
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            specs.append((name, getattr(torch, name), (300,)))
    out = []
    for name, dtype, shape in specs:
        out.append((name, random_tensor(shape, dtype, g, device)))
    base = torch.randint(0, 1 << 15, (40, 30), dtype=torch.int16, generator=g).view(torch.bfloat16).to(device)
    out.append(("transposed", base.t()))            # non-contiguous
    out.append(("strided", base[::3, 1::2]))
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def emit(**event) -> None:
    print(json.dumps(event), flush=True)


def consumer(address: str, versions: int, hold_s: float) -> None:
    """Receives `versions` versions over the socket; checks bytes; holds every other buffer for hold_s
    before its ACK and re-verifies it, which fails if the producer refilled it early."""
    from colomem.bridge import BridgeImporter

    imp = BridgeImporter.connect(address, timeout=60)
    emit(event="attached", device=str(imp.device), buffers=len(imp._buffers), uuid=imp.uuid)
    for v in range(versions):
        want = dict(named_tensors(v, imp.device))
        got, held, nmsg = {}, 0, 0
        messages = imp.messages(timeout=60)
        msg = next(messages)
        while True:
            nmsg += 1
            # A comprehension, not a for-loop: a loop variable would keep the last view of the buffer alive
            # after the loop (and count in live_views at close).
            got.update({name: t.clone() for name, t in imp.tensors(msg, verify="full")})
            if msg["seq"] % 2 == 0:
                if imp.device.type == "cuda":
                    torch.cuda.synchronize()
                time.sleep(hold_s)  # the producer packs the next buckets meanwhile
                imp.verify(msg, "full")
                held += 1
            try:  # the last ACK carries a report to the producer (WeightBridge.last_reports)
                msg = messages.send({"version": v, "messages": nmsg} if msg["last"] else None)
            except StopIteration:
                break
        bad = sorted(n for n in want if n not in got or not same_bytes(got[n], want[n].contiguous()))
        emit(event="version", version=v, ok=not bad and set(got) == set(want), bad=bad, ntensors=len(got),
             messages=nmsg, held=held, applied=imp.version)
    imp.close()
    emit(event="closed", live_views=imp.live_views)


def producer(nversions: int, device: str = "0") -> None:
    """Publishes versions over the socket, then waits to be killed (or for the consumer to leave).
    device: a CUDA ordinal, or "cpu" for a host bridge."""
    from colomem.bridge import WeightBridge

    bridge = WeightBridge(bucket_bytes=BUCKET_BYTES, buffers=2, device=device if device == "cpu" else int(device),
                          checksum="full", timeout=60)
    emit(event="address", address=bridge.address)
    bridge.wait_for_importers(1, 60)
    for v in range(nversions):
        stats = bridge.sync(named_tensors(v, bridge.device), version=v)
        emit(event="synced", version=v, messages=stats.messages)
    time.sleep(600)


# -- the parent's side -------------------------------------------------------------------------------------
def spawn(*args, env=None) -> subprocess.Popen:
    """Starts this file as the peer process with these arguments (role first)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = child_pythonpath(env)
    err = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a chatty child never blocks on stderr
    p = subprocess.Popen([sys.executable, str(PEER), *map(str, args)], stdout=subprocess.PIPE, stderr=err,
                         text=True, env=env)
    p.errfile = err
    return p


def stderr_of(p: subprocess.Popen) -> str:
    p.errfile.seek(0)
    return p.errfile.read()[-4000:]


def next_event(p: subprocess.Popen, timeout: float = 120.0) -> dict:
    """The peer's next JSON line; fails (never hangs) if it dies or stays silent."""
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("line", p.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    line = box.get("line")
    if not line:
        p.kill()
        p.wait(30)
        raise AssertionError(f"peer sent nothing (rc={p.returncode}):\n{stderr_of(p)}")
    return json.loads(line)


def finish(p: subprocess.Popen, timeout: float = 60.0) -> None:
    rc = p.wait(timeout)
    assert rc == 0, f"peer exited with {rc}:\n{stderr_of(p)}"


def receive_until_whole(imp, want: dict) -> dict:
    """Receives (and ACKs) buckets until one completes whole tensors, checks their bytes against `want` and
    returns that bucket's message, not ACKed: its producer waits for that ACK."""
    msg = imp.receive(timeout=60)
    first = [(n, t.clone()) for n, t in imp.tensors(msg, verify="full")]
    while not first and not msg["last"]:  # bucket 0 holds only a part of the split "emb": nothing whole yet
        imp.ack(msg, timeout=60)
        msg = imp.receive(timeout=60)
        first = [(n, t.clone()) for n, t in imp.tensors(msg, verify="full")]
    assert first and not msg["last"]
    assert all(same_bytes(t, want[n].contiguous()) for n, t in first)
    return msg


def ack_until_peer_error(imp, msg: dict, pid: int) -> dict:
    """With the producer gone: ACKs and receives until the PeerError naming its pid (whatever was still in
    flight, the end is a PeerError, never a timeout); returns the last message received."""
    import pytest

    from colomem.errors import PeerError

    with pytest.raises(PeerError, match=f"process {pid}"):
        for _ in range(1000):
            imp.ack(msg, timeout=30)
            msg = imp.receive(timeout=30)
    return msg


def reap(p: subprocess.Popen) -> None:
    """Kills the peer if it still runs and closes what the parent holds of it."""
    if p.poll() is None:
        p.kill()
        p.wait(30)
    p.stdout.close()
    p.errfile.close()


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "consumer":
        consumer(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    elif role == "producer":
        producer(int(sys.argv[2]), *sys.argv[3:4])
    else:
        raise SystemExit(f"unknown role {role!r}")
