"""What the bridge reliability tests share: child interpreters that import the build under test, a host
bridge with one importer attached, and a hand-driven importer."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from child_env import child_env
from colomem import _C
from colomem.bridge import BridgeImporter, WeightBridge, wire
from random_bytes import random_tensor

TIMEOUT = 30.0  # generous bound for waits that should succeed
SOON = 4.0      # a 0.5 s deadline must be honoured within this (generous: loaded CI machines)


def run_child(code: str, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    env = child_env()
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def spawn(code: str, *args: str) -> subprocess.Popen:
    env = child_env()
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def named(seed, n=4):
    gen = torch.Generator().manual_seed(seed)
    return [(f"t{i}", random_tensor((60 + 97 * i,), torch.float32, gen)) for i in range(n)]


@pytest.fixture
def pair():
    """(a host bridge, an importer attached to it), both closed at the end."""
    bridge = WeightBridge(bucket_bytes=4096, buffers=2, device="cpu", checksum="full", timeout=10.0)
    imp = BridgeImporter.connect(bridge.address, timeout=10)
    bridge.wait_for_importers(1, 10)
    yield bridge, imp
    imp.close()
    bridge.close()


def first_message(bridge) -> dict:
    gen = bridge.publish(named(0), version=1)
    d = next(gen).to_dict()
    gen.close()
    return d


def raw_importer(address: str) -> "_C.UnixConnection":
    """A hand-driven importer: the handshake done, its descriptors closed; the test writes its answers."""
    conn = _C.UnixConnection.connect(address, TIMEOUT)
    data, fds = conn.recv(TIMEOUT)
    for fd in fds:
        os.close(fd)
    assert json.loads(data)["kind"] == "hello"
    conn.send(wire.encode("attached", ok=True, pid=os.getpid()), [], TIMEOUT)
    return conn
