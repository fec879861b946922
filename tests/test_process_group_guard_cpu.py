"""The default process group a trainer's set-up starts goes with the last trainer that uses it; a group that
was there before belongs to whoever started it."""
import json
import os
import socket
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import json, os, sys
    import torch.distributed as dist
    from colomem.engines.deepspeed.process_group import DefaultGroupGuard

    def gloo_threads():
        names = [open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task")]
        return sum("gloo" in n for n in names)

    from colomem.engines.deepspeed.config import init_distributed

    def start():                                   # what the trainer and deepspeed.initialize do on one GPU
        if not dist.is_initialized():
            init_distributed()                     # rank 0 of 1 on a free port, put in the environment
            dist.init_process_group("gloo", rank=0, world_size=1)

    guard, seen = DefaultGroupGuard(), {}
    _, a = guard.setup(start)                      # the first trainer starts the group
    _, b = guard.setup(start)                      # a second one, alive beside it, uses the same
    guard.release()
    seen["two_then_one"] = [a, b, dist.is_initialized(), guard.holders]
    guard.release()
    seen["last_closed"] = [dist.is_initialized(), gloo_threads(), "MASTER_PORT" in os.environ]
    _, c = guard.setup(start)                      # a later trainer starts it again, on the same port
    guard.release()
    seen["again"] = [c, dist.is_initialized()]
    try:
        guard.setup(lambda: (start(), 1 / 0))      # a set-up that fails after starting the group
    except ZeroDivisionError:
        seen["failed_setup"] = [dist.is_initialized(), guard.holders]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)    # the user's own group
    _, d = guard.setup(start)
    guard.release()
    seen["users"] = [d, dist.is_initialized()]
    dist.destroy_process_group()
    json.dump(seen, sys.stdout)
""")


def test_the_last_trainer_destroys_the_group_its_set_up_started_and_leaves_anyone_elses():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", CHILD, str(port)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout)
    assert seen["two_then_one"] == [True, True, True, 1]      # one trainer left: the group stays
    # destroyed, gloo's threads gone with it, and the port the set-up chose taken back: the next group picks a
    # free one (the old group's store keeps its port while anything still references that group)
    assert seen["last_closed"] == [False, 0, False]
    assert seen["again"] == [True, False]
    assert seen["failed_setup"] == [False, 0]                 # a failed set-up leaves no group behind
    assert seen["users"] == [False, True]                     # the user's group: not held, not destroyed
