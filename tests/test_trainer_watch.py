"""vLLM's engine process ends itself when the trainer that started it is killed (worker/trainer_watch.py):
real processes, a trainer SIGKILLed, the engine stand-in gone within the watch's bound."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from colomem.engines.vllm.engine_calls import describe_exit
from colomem.engines.vllm.worker.trainer_watch import TrainerWatch, alive, identity
from child_env import child_env

ROOT = Path(__file__).resolve().parents[1]

# the "trainer": starts the "engine" (which watches it), prints the engine's pid, then waits to be killed
TRAINER = textwrap.dedent("""
    import os, subprocess, sys, time
    engine = subprocess.Popen([sys.executable, "-c", '''
    import os, signal, sys, time
    from colomem.engines.vllm.worker.trainer_watch import TrainerWatch
    if sys.argv[1] == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)    # an engine whose shutdown hangs
    TrainerWatch(os.getppid(), interval_s=0.1, grace_s=1.0).start()
    print("watching", flush=True)
    time.sleep(120)
    ''', sys.argv[1]], stdout=subprocess.PIPE, text=True)
    assert engine.stdout.readline().strip() == "watching"
    print(engine.pid, flush=True)
    time.sleep(120)
""")


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc (Linux)")
@pytest.mark.parametrize("engine_mode", ["plain", "ignore-term"])
def test_engine_ends_when_its_trainer_is_killed(engine_mode):
    env = child_env()
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, engine_mode], stdout=subprocess.PIPE, text=True,
                               env=env, start_new_session=True)
    try:
        engine = int(trainer.stdout.readline())
        assert not gone(engine)
        trainer.send_signal(signal.SIGKILL)
        # not reaped yet: the trainer is a zombie, which counts as gone; SIGTERM ends the plain engine, the
        # one ignoring it is SIGKILLed after the 1 s grace
        deadline = time.monotonic() + 15
        while not gone(engine) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(engine), "the engine outlived its trainer"
    finally:
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait(10)


def test_alive_tells_the_process_from_a_later_one():
    me = identity(os.getpid())
    assert alive(os.getpid(), me)
    assert not alive(os.getpid(), "0")            # same pid, another start time: another process
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    ident = identity(p.pid)
    p.wait(30)
    assert not alive(p.pid, ident)


def test_watch_stops_without_acting_while_the_trainer_lives():
    fired = []
    w = TrainerWatch(os.getpid(), interval_s=0.02, on_gone=lambda: fired.append(1)).start()
    time.sleep(0.2)
    w.stop()
    assert not fired


def test_exit_codes_read_as_words():
    assert describe_exit(-signal.SIGKILL).startswith("killed by SIGKILL (by another process, or by the kernel's")
    assert describe_exit(-signal.SIGTERM) == "killed by SIGTERM"
    assert describe_exit(1) == "exit code 1; its log above says why"
