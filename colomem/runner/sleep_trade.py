"""Whether vLLM sleeps while the trainer trains when both would fit awake (--rollout-sleep auto): the recompute
its sleep saves against what the sleep and wake cost, both measured in the measuring step.

With nothing moving, vLLM's memory stays taken through training, and with gradient checkpointing and
--trim-recompute the layers whose activations do not fit beside it are recomputed in every backward. Asleep,
vLLM leaves that memory to the activations: fewer layers recomputed, and every step pays its sleep and wake
instead. The measuring step (everything moved) measured both: what recomputing one decoder layer costs a step
(its forwards timed through the step's training, colomem.engines.layer_timing) and its sleep, wake_weights and
wake_kv phases. The sync is paid either way (every step brings new weights, and after a level-2 sleep it writes
the weights the sleep discarded, all of which it writes anyway), so it is no part of the trade. A sleeping
placement that also moves trainer state pays that state's share of the step's offload and reload too (all of
it moved then). vLLM sleeps when the recompute saved is larger.

Every rank decides the same: each rank's figures are exchanged and the largest of each is weighed (a step
waits for its slowest rank), with the layers recomputed as the trim every rank applies (the one that keeps the
most layers checkpointed).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

from colomem.engines.layer_timing import LAYER_STEP_KEY

from .placement import ALL_CATEGORIES, MemoryFigures, Placement, choose, fits, train_spare
from .recompute_plan import RecomputeProbe, micro_batch_rows, recomputed_with
from .timeline import StepRecord

SLEEP_PHASES = ("sleep", "wake_weights", "wake_kv")
TRAINER_PHASES = ("offload", "offload_wait", "reload", "reload_wait", "reload_step")


def seconds(s: float) -> str:
    """Seconds for a line: milliseconds below a hundredth (a small model's layer costs little)."""
    return f"{s:.3f} s" if s >= 0.01 else f"{s * 1e3:.3f} ms"


def moved_share(p: Placement, figures: Sequence[MemoryFigures]) -> float:
    """The largest share, over the GPUs, of the trainer's state bytes placement p moves each step."""
    moved = [c for c in ALL_CATEGORIES if c not in p.offload_keep]
    if not moved:
        return 0.0
    return max((f.kept_bytes(moved) / f.kept_bytes(ALL_CATEGORIES) if f.kept_bytes(ALL_CATEGORIES) else 1.0)
               for f in figures)


def switch_seconds(phase_s: dict, asleep: Placement, figures: Sequence[MemoryFigures]) -> float:
    """What the sleeping placement `asleep` pays each step that nothing moving does not, from the measuring
    step's phases (`phase_s`): vLLM's sleep and wake, and the share of the trainer's moves it keeps making."""
    took = sum(phase_s.get(k, 0.0) for k in SLEEP_PHASES)
    share = moved_share(asleep, figures)
    return took + share * sum(phase_s.get(k, 0.0) for k in TRAINER_PHASES) if share else took


@dataclass(frozen=True)
class SleepTrade:
    """The two placements weighed: `asleep` (the cheapest in which vLLM sleeps while training), the decoder
    layers recomputed with vLLM awake and asleep (of `layers`), what recomputing one costs a step, and what
    the sleep and wake (and any trainer moves) cost a step."""
    asleep: Placement
    layers: int
    recomputed_awake: int
    recomputed_asleep: int
    layer_step_s: float
    switch_s: float
    trainer_moves: bool = False

    @property
    def saved_s(self) -> float:
        """Seconds a step vLLM asleep saves the backward."""
        return (self.recomputed_awake - self.recomputed_asleep) * self.layer_step_s

    @property
    def rollout_sleeps(self) -> bool:
        return self.saved_s > self.switch_s

    def placement(self, awake: Placement) -> Placement:
        """The placement later steps follow: `asleep` when the recompute saved is larger, else `awake`."""
        if not self.rollout_sleeps:
            return awake
        return replace(self.asleep, why=self.asleep.why + "; nothing moving fits too, but vLLM asleep saves more "
                       "recompute than its sleep and wake cost (the rollout sleep line)")

    def line(self, from_step: int) -> str:
        fewer = self.recomputed_awake - self.recomputed_asleep
        moves = ", and the trainer state it moves," if self.trainer_moves else ""
        saved = f"{fewer} x {seconds(self.layer_step_s)} = {seconds(self.saved_s)} a step"
        cost = f"the {seconds(self.switch_s)} its sleep and wake{moves} took in the measuring step"
        if self.rollout_sleeps:
            return (f"vLLM sleeps while training from step {from_step} on ({self.asleep.label}; --rollout-sleep "
                    f"auto): the backward then recomputes {self.recomputed_asleep} of the {self.layers} decoder "
                    f"layers instead of {self.recomputed_awake}, which saves {saved} (each layer's forwards, as "
                    f"timed in the measuring step), more than {cost}")
        return (f"vLLM stays awake while training (--rollout-sleep auto): asleep, it would let the backward "
                f"recompute {self.recomputed_asleep} of the {self.layers} decoder layers instead of "
                f"{self.recomputed_awake}, which would save {saved} (each layer's forwards, as timed in the "
                f"measuring step), no more than {cost}")

    def to_dict(self, from_step: int) -> dict:
        return {"rollout_sleeps": self.rollout_sleeps, "asleep_label": self.asleep.label, "layers": self.layers,
                "recomputed_awake": self.recomputed_awake, "recomputed_asleep": self.recomputed_asleep,
                "layer_step_s": self.layer_step_s, "saved_s": self.saved_s, "switch_s": self.switch_s,
                "line": self.line(from_step)}


def weigh_rollout_sleep(cfg: Any, ranks: Any, awake: Placement, figures: Sequence[MemoryFigures],
                        margin: Optional[int], taken: int, pr: Optional[RecomputeProbe], rec: StepRecord,
                        optim_out: bool, train_width: int) -> Optional[SleepTrade]:
    """Nothing moves (`awake`): the trade of letting vLLM sleep while training, from the measuring step `rec`
    (its layers' forward timing and its phases) and this rank's probe `pr`. Every rank calls it (it exchanges
    the figures). taken: bytes the job holds beyond the figures (a weight-bridge bucket grown for `awake`),
    which the sleeping placement must leave room for too. None when a rank lacks a figure (no timing, no
    probe), when no sleeping placement fits, or when vLLM asleep would leave as many layers recomputed."""
    asleep = choose(cfg.offload, "always", figures, margin, optim_out)
    layer_s = rec.metrics.get(LAYER_STEP_KEY)
    mine = None
    if pr is not None and layer_s and fits(asleep, figures, margin, taken):
        rows = micro_batch_rows(cfg, train_width)
        mine = (recomputed_with(train_spare(awake, figures, margin, taken), pr, rows),
                recomputed_with(train_spare(asleep, figures, margin, taken), pr, rows),
                float(layer_s), switch_seconds(rec.phase_s, asleep, figures))
    every = ranks.exchange(mine)
    if pr is None or any(f is None for f in every):
        return None
    now, then = max(f[0] for f in every), max(f[1] for f in every)
    if then >= now:
        return None
    return SleepTrade(asleep, pr.layers, now, then, max(f[2] for f in every), max(f[3] for f in every),
                      trainer_moves=moved_share(asleep, figures) > 0)


def recompute_cost(metrics: dict, recomputed: int) -> str:
    """What the layers still recomputed cost a step, from the measuring step's timing ("" without one)."""
    layer_s = metrics.get(LAYER_STEP_KEY)
    if not layer_s or recomputed <= 0:
        return ""
    return (f"recomputing {recomputed} layers costs about {recomputed} x {seconds(layer_s)} = "
            f"{seconds(recomputed * layer_s)} a step (each layer's forwards, as timed in the measuring step)")


__all__ = ["SLEEP_PHASES", "SleepTrade", "TRAINER_PHASES", "moved_share", "recompute_cost",
           "seconds", "switch_seconds", "weigh_rollout_sleep"]
