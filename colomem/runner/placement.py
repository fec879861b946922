"""Where each side's memory stays between phases: the placement planner.

A colocated step needs, on every GPU, the rollout engine awake (weights + KV cache + its workspace) while it
generates and the whole trainer (weights, gradients, fp32 masters, Adam moments, activations) while it
trains. Moving either costs time, so the planner moves only what must go:

    nothing moves        vLLM never sleeps, the trainer never offloads: a step costs the sync and its check.
                         Chosen when the rollout awake + the trainer's peak while training fit together
                         (unless vLLM asleep would save more recompute than its sleep and wake cost:
                         colomem.runner.sleep_trade).
    optimizer out for the step
                         the trainer stays whole through the rollout, but its optimizer step cannot hold
                         Adam's moments beside the gradients' fp32 copy: they start copying to the pool when
                         training starts (behind the forward and backward), leave before the step and come
                         back inside it. Chosen when the forward and backward's measured peak fits beside them.
    trainer keeps K      vLLM sleeps while the trainer trains; while vLLM generates, the trainer keeps the
                         categories K on the GPU and offloads the rest. K is the largest prefix of KEEP_ORDER
                         that fits beside the awake rollout: Adam moments go first (they are read last, by the
                         optimizer step, and reload behind the forward and backward), then fp32 masters, then
                         gradients, then the bf16 weights (the sync reads them on the GPU while they stay).

The figures are measured, not guessed: with `offload auto` the first step runs with everything moving
(the safe placement), and its memory after each phase (the driver's used bytes, the trainer's allocator
peak while training, the bytes of each state category) decides the placement of every later step, on every
rank the same (the one that fits on every GPU). `offload all|optimizer|none` and `rollout_sleep
always|never` fix it instead. The decision and the figures behind it are printed once and logged.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

from colomem.errors import ConfigError
from colomem.units import format_bytes

# The trainer state categories (colomem.engines.deepspeed.state.CATEGORIES), in the order they stay on the
# GPU: "other" (module buffers) and the bf16 "params" first, then gradients, fp32 masters, Adam moments.
KEEP_ORDER = (("params", "other"), ("grads",), ("master",), ("optim",))


def _kept_first(groups: int) -> tuple[str, ...]:
    """The categories of the first `groups` groups of KEEP_ORDER."""
    return tuple(c for group in KEEP_ORDER[:groups] for c in group)


ALL_CATEGORIES = _kept_first(len(KEEP_ORDER))
OFFLOAD_MODES = ("auto", "all", "optimizer", "none")
SLEEP_MODES = ("auto", "always", "never", "alternate")
_OPTIMIZER_KEEPS = ("params", "other", "grads")          # offload optimizer: masters and moments go


@dataclass(frozen=True)
class Placement:
    """What moves between phases. keep: trainer categories that stay on the GPU while the rollout runs
    (ALL_CATEGORIES: the trainer never offloads); rollout_sleeps: vLLM sleeps while the trainer trains;
    optim_out: the optimizer state stays in the rollout's memory while it copies to the pool (from the end of
    the rollout's wake on) behind the rollout; training starts once it is out, and it comes back inside the
    optimizer step. kv_release (with rollout_sleeps): the rollout releases only this many bytes of its KV
    cache while the trainer trains, its weights and the rest of the cache staying mapped (0: it sleeps
    whole). keep_part (category, bytes): of the first category the trainer moves, whole tensors up to that
    many bytes stay too (("", 0): none; keep_part_fit)."""
    keep: tuple[str, ...]
    rollout_sleeps: bool
    why: str = ""
    optim_out: bool = False
    kv_release: int = 0
    keep_part: tuple[str, int] = ("", 0)

    @property
    def trainer_moves(self) -> bool:
        return set(self.keep) != set(ALL_CATEGORIES)

    @property
    def offload_keep(self) -> tuple[str, ...]:
        """What the trainer's offload at the switch leaves on the GPU (optim_out: all but the optimizer state,
        which the rollout's memory holds only while it copies out)."""
        return tuple(c for c in self.keep if c != "optim") if self.optim_out else self.keep

    @property
    def label(self) -> str:
        if not self.trainer_moves and not self.rollout_sleeps:
            return "nothing moves"
        sleeps = (f"rollout releases {format_bytes(self.kv_release)} of its KV cache" if self.kv_release
                  else "rollout sleeps")
        if not self.trainer_moves and self.optim_out:
            return f"trainer resident, {sleeps}, optimizer state out behind the rollout"
        if not self.trainer_moves:
            return f"trainer resident, {sleeps}"
        part = f"up to {format_bytes(self.keep_part[1])} of {self.keep_part[0]}" if self.keep_part[1] else ""
        kept = " and ".join(x for x in ("+".join(self.keep), part) if x)
        if not kept:
            return f"trainer offloaded, {sleeps}"
        return f"trainer keeps {kept}, {sleeps}"

    def to_dict(self) -> dict:
        return {"label": self.label, "keep": list(self.keep), "rollout_sleeps": self.rollout_sleeps, "why": self.why,
                "optim_out": self.optim_out, "kv_release": self.kv_release, "keep_part": list(self.keep_part)}


EVERYTHING_MOVES = Placement((), True, "everything moves (the first step measures what fits)")


def alternate(p: Placement, step: int) -> Placement:
    """rollout_sleep alternate: step `step`'s layout of the planned (resident, awake) placement p. vLLM sleeps
    through the training of every even step, and stays awake through that of every odd one, so both layouts
    run in one process, in turn: what differs between launches (where the processes and their memory land)
    is the same for both. A step's rollout follows the previous step's layout (it woke or it stayed awake)."""
    sleeps = step % 2 == 0
    why = "alternating: vLLM " + ("sleeps through this step's training" if sleeps else "stays awake")
    return Placement(p.keep, sleeps, why)


@dataclass
class MemoryFigures:
    """One GPU's measured figures, in bytes, from a step that moved everything.

    total            the GPU's memory
    rollout_used     the driver's used bytes at the end of the rollout (vLLM awake, trainer offloaded)
    trainer_left     the trainer's allocator reserved bytes after that offload (already in rollout_used)
    train_peak       the trainer's allocator peak reserved bytes while training
    state            bytes of each trainer state category (params, other, grads, master, optim)
    train_other      the driver's used bytes at the end of training beyond the trainer's allocator (the
                     sleeping rollout, CUDA contexts, the weight bridge's buffers)
    optim_created    bytes of optimizer state that step's optimizer step created (Adam's moments on a first
                     step): absent through most of its training, so not in train_peak
    kv_cache         the rollout engine's KV cache on this GPU (0: unknown)
    rollout_weights  the rollout engine's weights on this GPU, which a sleep frees and a KV-only sleep keeps
                     (0: unknown)
    kv_need          the most of it the step's rollout can hold (colomem.runner.kv_need; 0: unknown)
    pre_step_peak    the trainer's allocator peak reserved bytes of the forward and backward, read before the
                     optimizer step (0: unknown); reported with the placement, not needed by it
    step_start_peak  the same as the optimizer step starts: ZeRO's gradient cast included (0: unknown)
    """
    total: int
    rollout_used: int
    trainer_left: int
    train_peak: int
    state: dict[str, int] = field(default_factory=dict)
    train_other: int = 0
    optim_created: int = 0
    kv_cache: int = 0
    kv_need: int = 0
    rollout_weights: int = 0
    pre_step_peak: int = 0
    step_start_peak: int = 0

    def kept_bytes(self, keep: Sequence[str]) -> int:
        return sum(int(self.state.get(c, 0)) for c in keep)

    def to_dict(self) -> dict:
        return asdict(self)


def default_margin(total: int) -> int:
    """Head room a placement must leave: allocator rounding, fragmentation, a larger batch's activations."""
    return max(2 << 30, int(0.03 * total))


def candidates(offload: str, rollout_sleep: str, optim_out: bool = True) -> list[Placement]:
    """The placements a mode allows, cheapest first (the planner takes the first that fits). optim_out: the
    trainer can send its optimizer state out for the optimizer step (and the job lets it)."""
    if offload not in OFFLOAD_MODES:
        raise ConfigError(f"offload={offload!r}: choose one of {', '.join(OFFLOAD_MODES)}")
    if rollout_sleep not in SLEEP_MODES:
        raise ConfigError(f"rollout_sleep={rollout_sleep!r}: choose one of {', '.join(SLEEP_MODES)}")
    if rollout_sleep == "alternate":
        # a measurement: the two layouts of a resident trainer, step by step in one process (alternate())
        if offload != "none":
            raise ConfigError(f"rollout_sleep alternate runs the trainer resident with vLLM awake and asleep, step "
                              f"by step; it needs offload none, not {offload}")
        rollout_sleep = "never"
    if rollout_sleep == "never" and offload in ("all", "optimizer"):
        raise ConfigError(f"rollout_sleep never keeps the rollout's memory while the trainer trains, so the "
                          f"trainer's state has nowhere to go: offload {offload} saves nothing; use offload none "
                          "or auto")
    out: list[Placement] = []
    if offload in ("auto", "none") and rollout_sleep in ("auto", "never"):
        out.append(Placement(ALL_CATEGORIES, False))
    if rollout_sleep == "never":
        return out
    if offload == "none":
        out.append(Placement(ALL_CATEGORIES, True))
    elif offload == "optimizer":
        out.append(Placement(_OPTIMIZER_KEEPS, True))
    elif offload == "all":
        out.append(Placement((), True))
    else:
        out.append(Placement(ALL_CATEGORIES, True))
        if optim_out:    # one copy each way, the way out hidden behind the rollout: cheaper than an exposed one
            out.append(Placement(ALL_CATEGORIES, True, optim_out=True))
        out += [Placement(_kept_first(i), True) for i in range(len(KEEP_ORDER) - 1, -1, -1)]
    return out


def needs_measuring(offload: str, rollout_sleep: str) -> bool:
    """Whether the placement depends on measured memory (more than one candidate)."""
    return len(candidates(offload, rollout_sleep)) > 1


def _need(p: Placement, fig: MemoryFigures) -> int:
    """The rollout phase's need (with nothing moving, the rollout stays awake through training: that too)."""
    if not p.rollout_sleeps:
        return fig.rollout_used - fig.trainer_left + fig.train_peak + fig.optim_created
    return fig.rollout_used + fig.kept_bytes(p.keep) + p.keep_part[1]


def train_need(fig: MemoryFigures, at_step: bool) -> int:
    """What training needs while the rollout sleeps. The measured step's optimizer created Adam's moments
    after it had freed the gradients; on later steps they are on the GPU from the start (kept, or reloaded
    behind the forward and backward), so they add to the measured peak, unless they come back inside the
    optimizer step (at_step), which repeats the measured step."""
    return fig.train_other + fig.train_peak + (0 if at_step else fig.optim_created)


def _train_short(p: Placement, fig: MemoryFigures, margin: Optional[int]) -> int:
    """Bytes missing while training with placement p (<= 0: fits). The measured step ran, so its own need
    fits by construction; the margin covers only what is estimated on top of it."""
    if not p.rollout_sleeps:
        return -1                       # counted in _need: the rollout stays awake through training
    if "optim" in p.keep and not p.optim_out:   # optim_out: the state is in the pool before training starts
        return train_need(fig, False) + _margin(fig, margin) - fig.total
    return train_need(fig, True) - fig.total     # the optimizer state can come back at the step


def reload_at_step(p: Placement, figures: Sequence[MemoryFigures], margin: Optional[int] = None) -> tuple[bool, str]:
    """Whether placement p's offloaded optimizer state must come back inside the optimizer step (after the
    gradients are cast to fp32 and freed) rather than behind the forward and backward, and why."""
    if figures and p.optim_out:
        worst = max(figures, key=lambda f: train_need(f, False) - f.total)
        return True, (f"kept through the rollout, Adam's moments ({format_bytes(worst.optim_created)}) would be "
                      f"on the GPU through the optimizer step's peak: {format_bytes(train_need(worst, False))} of "
                      f"{format_bytes(worst.total)}; they copy to the pool behind the rollout and come back inside "
                      "the step")
    if not figures or not p.trainer_moves or "optim" in p.keep:
        return False, ""
    worst = max(figures, key=lambda f: train_need(f, False) + _margin(f, margin) - f.total)
    early = train_need(worst, False)
    if early + _margin(worst, margin) <= worst.total:
        return False, ""
    return True, (f"reloaded behind the forward and backward, Adam's moments ({format_bytes(worst.optim_created)}) "
                  f"would be on the GPU through the optimizer step's peak: {format_bytes(early)} + "
                  f"{format_bytes(_margin(worst, margin))} margin of {format_bytes(worst.total)}; inside the step "
                  f"the measured {format_bytes(train_need(worst, True))} fits (the reload is not hidden then)")


def early_reload_room(figures: Sequence[MemoryFigures], margin: Optional[int] = None) -> int:
    """Of optimizer state that comes back inside the step, the bytes that would fit back before it, behind
    the forward and backward: what every GPU has beside the peak at the step's start (the gradients' cast,
    the step's first peak), at most the state the step brings back. Later in the step that part was counted
    already (the measured peak held all of it). 0 when the start's peak was not measured."""
    if not figures or any(not f.step_start_peak for f in figures):
        return 0
    return max(0, min(min(f.total - _margin(f, margin) - f.train_other - f.step_start_peak, f.optim_created)
                      for f in figures))


def _margin(fig: MemoryFigures, margin: Optional[int]) -> int:
    return margin if margin is not None else default_margin(fig.total)


def _short(p: Placement, fig: MemoryFigures, margin: Optional[int]) -> int:
    """Bytes missing on that GPU for placement p while the rollout runs (<= 0: it fits, with the margin)."""
    return _need(p, fig) + _margin(fig, margin) - fig.total


def _fits(p: Placement, fig: MemoryFigures, margin: Optional[int]) -> bool:
    return _short(p, fig, margin) <= 0 and _train_short(p, fig, margin) <= 0


def fits(p: Placement, figures: Sequence[MemoryFigures], margin: Optional[int] = None, taken: int = 0) -> bool:
    """Whether placement p fits on every GPU of `figures` with the margin, while the rollout runs and while
    the trainer trains (what choose() asks of the placement it takes), with `taken` bytes more held through
    both (the buffers of a weight-bridge bucket grown for another placement)."""
    if not figures or not all(_fits(p, f, margin) for f in figures):
        return False
    return not taken or min(rollout_spare(p, figures, margin, taken), train_spare(p, figures, margin, taken)) >= 0


def choose(offload: str, rollout_sleep: str, figures: Sequence[MemoryFigures],
           margin: Optional[int] = None, optim_out: bool = True) -> Placement:
    """The cheapest allowed placement that fits on every GPU (figures: one per rank), with the reason. With
    a single allowed placement, that one, fitting or not (the user asked for it; an out-of-memory then says
    which phase ran out). optim_out: as in candidates()."""
    allowed = candidates(offload, rollout_sleep, optim_out)
    if not figures:
        return allowed[-1]
    for p in allowed:
        worst = max(figures, key=lambda f: _short(p, f, margin))
        fits = all(_fits(p, f, margin) for f in figures)
        if fits or p is allowed[-1]:
            why = (f"needs {format_bytes(_need(p, worst))} + {format_bytes(_margin(worst, margin))} margin of "
                   f"{format_bytes(worst.total)}")
            if p.rollout_sleeps and p.trainer_moves:
                moved = sum(int(worst.state.get(c, 0)) for c in ALL_CATEGORIES if c not in p.keep)
                why += f"; moves {format_bytes(moved)} of trainer state a step"
            if p.optim_out:
                why += (f"; moves {format_bytes(int(worst.state.get('optim', 0)))} of optimizer state a step, "
                        "out behind the rollout")
            if not fits:
                why += " (does not fit: asked for with offload / rollout_sleep)"
            skipped = [q.label for q in allowed[:allowed.index(p)]]
            if skipped:
                why += "; did not fit: " + ", ".join(skipped)
            return Placement(p.keep, p.rollout_sleeps, why, p.optim_out)
    raise AssertionError("unreachable")


def rollout_spare(p: Placement, figures: Sequence[MemoryFigures], margin: Optional[int], taken: int) -> int:
    """The smallest head room over the GPUs with placement p while the rollout runs, less `taken`."""
    return -max(_short(p, f, margin) for f in figures) - taken


def train_spare(p: Placement, figures: Sequence[MemoryFigures], margin: Optional[int], taken: int) -> int:
    """The smallest head room over the GPUs while training with placement p, less `taken`."""
    if not p.rollout_sleeps:
        return rollout_spare(p, figures, margin, taken)
    at_step = reload_at_step(p, figures, margin)[0]
    return min(f.total - train_need(f, at_step) - _margin(f, margin) for f in figures) - taken


MIN_KEPT_PART = 1 << 30      # less than this kept of a category saves too little of a copy to plan for


def keep_part_fit(p: Placement, figures: Sequence[MemoryFigures], margin: Optional[int] = None) -> tuple[str, int]:
    """Of the first category placement p moves (the next group of KEEP_ORDER, when it is one category), the
    bytes that fit on every GPU beside the awake rollout and what p keeps: whole tensors of it up to that many
    bytes can stay through the rollout, so less crosses the link each way (Adam's moments are a few large
    tensors under ZeRO). ("", 0) when less than MIN_KEPT_PART fits, when p keeps everything or sends the
    optimizer state out behind the rollout, or when the state comes back inside the optimizer step (what
    stays would then sit through training's peak too, where the measured step had none of it)."""
    if not figures or not p.rollout_sleeps or not p.trainer_moves or p.optim_out or p.keep_part[1]:
        return ("", 0)
    groups = next((i for i in range(len(KEEP_ORDER)) if set(_kept_first(i)) == set(p.keep)), None)
    if groups is None or len(KEEP_ORDER[groups]) != 1 or reload_at_step(p, figures, margin)[0]:
        return ("", 0)
    cat = KEEP_ORDER[groups][0]
    room = min(rollout_spare(p, figures, margin, 0), min(int(f.state.get(cat, 0)) for f in figures))
    return (cat, room) if room >= MIN_KEPT_PART else ("", 0)


def kv_release_fit(p: Placement, figures: Sequence[MemoryFigures], margin: Optional[int] = None, taken: int = 0,
                   weights_stay: bool = False) -> int:
    """How much of its KV cache a rollout that sleeps with placement p must release for training to have the
    room the whole sleep gives it (less the margin and `taken` bytes held through training), on the GPU that
    needs the most; its weights and the rest of the cache then stay mapped, and the wake maps back only that
    part. Mapping memory back costs time by the byte, so a 112 GiB cache of which training needs 15 GiB
    wakes several times faster. 0 (the whole sleep) when a figure is unknown or training needs more than the
    cache holds; at least 1 (one allocation) when it needs none of it. weights_stay: the rollout keeps its
    weights through its sleep anyway (a shared base), so the measured training had them beside it."""
    if not p.rollout_sleeps or not figures:
        return 0
    at_step = reload_at_step(p, figures, margin)[0]
    most = 0
    for f in figures:
        if f.kv_cache <= 0 or (not weights_stay and f.rollout_weights <= 0):
            return 0
        spare = f.total - train_need(f, at_step) - _margin(f, margin) - taken
        short = (0 if weights_stay else f.rollout_weights) + f.kv_cache - spare
        if short > f.kv_cache:
            return 0
        most = max(most, short)
    return max(most, 1)


def kv_hint(p: Placement, figures: Sequence[MemoryFigures], utilization: float,
            margin: Optional[int] = None, taken: int = 0) -> str:
    """What the memory left free would buy the rollout: a larger --gpu-memory-utilization (more KV cache) with
    this placement, and with everything moving. Empty when less than 1 GiB would be gained. More KV cache
    makes rollouts faster only when a step's sequences do not all fit in the cache vLLM has now. taken: bytes
    the job takes from what is free after the figures were measured (a larger weight-bridge bucket)."""
    if not figures:
        return ""
    total = min(f.total for f in figures)
    parts = []
    here = rollout_spare(p, figures, margin, taken)
    if here >= 1 << 30:
        parts.append(f"{format_bytes(here)} stays free with this placement: --gpu-memory-utilization up to "
                     f"{min(0.99, utilization + here / total):.2f} (now {utilization:.2f}) would give vLLM that "
                     "much more KV cache")
    moved = rollout_spare(EVERYTHING_MOVES, figures, margin, taken)
    if p != EVERYTHING_MOVES and moved - max(here, 0) >= 1 << 30:
        parts.append(f"with --offload all --rollout-sleep always, up to "
                     f"{min(0.99, utilization + moved / total):.2f} (each step then moves the trainer's state)")
    if parts:
        parts.append("more KV cache speeds rollouts up only when a step's sequences do not fit in vLLM's now")
    return "; ".join(parts)


def _activation_share(figures: Sequence[MemoryFigures], per: int) -> float:
    """Bytes of training activations and temporaries per row (or token) of the measured micro-batch: the
    training peak less the trainer's state, taken as linear in the micro-batch."""
    return max((f.train_peak - f.kept_bytes(ALL_CATEGORIES)) / per for f in figures)


def micro_batch_fit(p: Placement, figures: Sequence[MemoryFigures], micro_batch: int, rows: int,
                    margin: Optional[int] = None, taken: int = 0, unit_extra: float = 0.0) -> int:
    """The largest micro-batch (rows) that divides `rows` (one optimizer step's rows on a rank) and fits in the
    memory placement p leaves free while training, estimated from the measured step (_activation_share, plus
    unit_extra bytes a row the measured step did not hold: layers no longer checkpointed); micro_batch itself
    when none larger would."""
    if not figures or micro_batch <= 0 or rows <= micro_batch:
        return micro_batch
    spare = train_spare(p, figures, margin, taken)
    per_row = _activation_share(figures, micro_batch) + unit_extra
    if per_row <= 0 or spare < per_row:
        return micro_batch
    most = min(rows, micro_batch + int(spare // per_row))
    return max(d for d in range(micro_batch, most + 1) if rows % d == 0)


def micro_batch_tokens_fit(p: Placement, figures: Sequence[MemoryFigures], tokens: int,
                           margin: Optional[int] = None, taken: int = 0, unit_extra: float = 0.0) -> int:
    """micro_batch_fit for micro-batches by a token budget: the largest budget (a multiple of 256) the free
    memory holds, the activations linear in the budget (unit_extra: bytes a token beyond the measured share);
    `tokens` itself when none larger would."""
    if not figures or tokens <= 0:
        return tokens
    per_token = _activation_share(figures, tokens) + unit_extra
    if per_token <= 0:
        return tokens
    best = (tokens + int(train_spare(p, figures, margin, taken) // per_token)) // 256 * 256
    return max(best, tokens)


def micro_batch_hint(p: Placement, figures: Sequence[MemoryFigures], micro_batch: int, rows: int,
                     margin: Optional[int] = None, taken: int = 0, unit_extra: float = 0.0) -> str:
    """What the memory left free with placement p would buy training: a larger --micro-batch (micro_batch_fit).
    Empty when the micro-batch would not grow."""
    best = micro_batch_fit(p, figures, micro_batch, rows, margin, taken, unit_extra)
    if best <= micro_batch:
        return ""
    return (f"{format_bytes(train_spare(p, figures, margin, taken))} stays free with this placement: --micro-batch "
            f"up to {best} (now {micro_batch}) would fit, estimated from this step's training peak "
            "(--grow-micro-batch takes it); fewer, larger micro-batches often train "
            "faster, and the update stays the same up to rounding (each micro-batch is weighted by its share of "
            "the batch). The KV cache hint above counts the same free memory")


def micro_batch_tokens_hint(p: Placement, figures: Sequence[MemoryFigures], tokens: int, margin: Optional[int] = None,
                            taken: int = 0, unit_extra: float = 0.0) -> str:
    """micro_batch_hint for micro-batches by a token budget (micro_batch_tokens_fit)."""
    best = micro_batch_tokens_fit(p, figures, tokens, margin, taken, unit_extra)
    if best <= tokens:
        return ""
    return (f"{format_bytes(train_spare(p, figures, margin, taken))} stays free with this placement: "
            f"--micro-batch-tokens up to {best} (now {tokens}) would fit, estimated from this step's training peak "
            "(--grow-micro-batch takes it); fewer, larger micro-batches often train faster, "
            "and the update stays the same up to rounding. The KV cache hint above counts the same free memory")


def state_to_plan(offloaded: dict, now: dict) -> dict:
    """The trainer's state bytes by category for the plan: the larger of what the measuring step's offload
    moved and what the trainer holds after that step's training. The offload runs before the first
    optimizer step, which is what creates Adam's moments (and may grow other buffers): planning from the
    offload alone would keep on the GPU a trainer whose state turns out several GiB larger."""
    return {c: max(int(offloaded.get(c, 0) or 0), int(now.get(c, 0) or 0)) for c in {*offloaded, *now}}


def figures_from_step(memory: dict, by_category: dict, total: int, optim_created: int = 0,
                      pre_step_peak: int = 0, step_start_peak: int = 0) -> Optional[MemoryFigures]:
    """The figures of one step's record (memory after each phase) that moved everything; None when the
    step lacks what they need (no GPU, or a phase missing). optim_created: optimizer-state bytes that step's
    optimizer step created; pre_step_peak, step_start_peak: its peaks before and as the step started
    (MemoryFigures)."""
    roll = memory.get("rollout", {}) or {}
    off = memory.get("offload", {}) or {}
    train = memory.get("train", {}) or {}
    used, left, peak = roll.get("driver_used"), off.get("reserved"), train.get("peak_reserved")
    if used is None or left is None or peak is None or not total:
        return None
    other = max(0, int(train.get("driver_used") or 0) - int(train.get("reserved") or 0))
    return MemoryFigures(total=int(total), rollout_used=int(used), trainer_left=int(left), train_peak=int(peak),
                         state={k: int(v) for k, v in (by_category or {}).items()}, train_other=other,
                         optim_created=int(optim_created), pre_step_peak=int(pre_step_peak or 0),
                         step_start_peak=int(step_start_peak or 0))


__all__ = ["ALL_CATEGORIES", "EVERYTHING_MOVES", "KEEP_ORDER", "MIN_KEPT_PART", "MemoryFigures", "OFFLOAD_MODES",
           "Placement", "SLEEP_MODES", "alternate", "candidates", "choose", "default_margin", "early_reload_room",
           "figures_from_step", "fits", "keep_part_fit", "kv_hint", "kv_release_fit", "micro_batch_fit",
           "micro_batch_hint", "micro_batch_tokens_fit", "micro_batch_tokens_hint", "needs_measuring",
           "reload_at_step", "rollout_spare", "state_to_plan", "train_need", "train_spare"]
