"""Memory figures and CPU job configs the placement tests share: a GPU's figures as the planner reads them,
and the small CPU job the loop runs under each placement."""
from colomem.runner.config import config_from_dict
from colomem.runner.placement import MemoryFigures

GB = 10 ** 9


def figs(total=140, rollout=60, left=1, peak=45, params=3, other=0, grads=6, master=12, optim=24):
    """One GPU's figures in GB: vLLM awake uses `rollout` (incl. the trainer's `left`), training peaks at `peak`."""
    return MemoryFigures(total=total * GB, rollout_used=rollout * GB, trainer_left=left * GB, train_peak=peak * GB,
                         state={"params": params * GB, "other": other * GB, "grads": grads * GB,
                                "master": master * GB, "optim": optim * GB})


def seven_b(**kw):
    """A 7.6B full fine-tune's figures in GiB, as measured on a 139.8 GiB GPU: the first step's training
    peaked at 128 with Adam's moments (57) created only after the gradients were freed; vLLM asleep, CUDA
    contexts and the bridge's buffers take 4 beside the trainer."""
    gib = 1 << 30
    f = dict(total=int(139.8 * gib), rollout_used=43 * gib, trainer_left=0, train_peak=128 * gib,
             state={"params": 14 * gib, "other": 0, "grads": 14 * gib, "master": 28 * gib, "optim": 57 * gib},
             train_other=4 * gib, optim_created=57 * gib)
    f.update(kw)
    return MemoryFigures(**f)


def job(out, **kw):
    data = {"backend": "cpu", "steps": 3, "prompts_per_step": 4, "micro_batch": 8, "progress": False,
            "plots": False, "report_to": ["none"], "out": str(out), "grpo": {"group_size": 4}, "save_every": 3,
            **kw}
    return config_from_dict(data)
