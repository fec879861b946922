"""What the memory left free while training would buy in recompute: the planner's checkpointing hint.

Gradient checkpointing trades work for memory: every checkpointed decoder layer runs its forward again in
the backward. When the placement leaves memory free while training, fewer checkpointed layers would fit and
each step would do less work, with the same gradients. How much more a layer that is not checkpointed keeps
is measured on the trainer's own model after the measuring step (colomem.engines.recompute's probe: two rows
of the step's width, two forwards, no backward), and scaled to a micro-batch: the layers' kept activations
are linear in the rows. The hint names the setting with the fewest checkpointed layers that fits; the user
chooses (it shares the free memory with the micro-batch and KV cache hints).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from colomem.engines.recompute import fewer_checkpointed
from colomem.units import format_bytes


PROBE_ROWS = 2


@dataclass(frozen=True)
class RecomputeProbe:
    """per_layer_row: bytes a decoder layer that is not checkpointed keeps beyond a checkpointed one, for one
    row of `width` tokens; layers: the model's decoder layers; checkpointed: how many checkpoint now."""
    per_layer_row: float
    layers: int
    checkpointed: int
    width: int

    def to_dict(self) -> dict:
        return asdict(self)


def probe(trainer: Any, width: int) -> Optional[RecomputeProbe]:
    """The probe of `trainer`'s model for rows of `width` tokens: None when it cannot run here (ZeRO-3 gathers
    its parameters only inside its own forward, no per-layer switch, no checkpointing, the GPU short of the
    memory for two rows)."""
    import torch

    from colomem.engines.recompute import checkpointed_layers, decoder_layers, saved_bytes_per_layer
    from colomem.errors import is_oom

    model = getattr(trainer, "model", None)
    if model is None or width < 1 or getattr(trainer, "zero_stage", 2) == 3:
        return None
    checkpointed = checkpointed_layers(model)
    if checkpointed <= 0:
        return None
    device = getattr(trainer, "device", torch.device("cpu"))
    # two rows, each layer's figure then halved: torch.compile specializes a batch of one row, so compiled
    # layers would compile once more for a single row
    ids = torch.zeros(PROBE_ROWS, int(width), dtype=torch.long, device=device)
    try:
        per = saved_bytes_per_layer(model, ids)
    except Exception as e:  # noqa: BLE001  (a hint is not worth a failed run: no memory for two rows, no hint)
        if is_oom(e):
            return None
        raise
    finally:
        del ids
        if device.type == "cuda":
            torch.cuda.empty_cache()
    layers = len(decoder_layers(model))
    return RecomputeProbe(per / PROBE_ROWS, layers, checkpointed, int(width)) if per else None


@dataclass(frozen=True)
class RecomputeFit:
    """A setting with fewer checkpointed layers that fits: its flag, the layers it checkpoints, `every`
    (colomem.engines.recompute.set_checkpointed's argument), the extra activations of a layer that keeps
    them and of all of them, for a micro-batch."""
    flag: str
    checkpointed: int
    every: int
    per_layer: int
    extra: int


def micro_batch_rows(cfg: Any, width: int) -> int:
    """Rows of one micro-batch of the run config `cfg` at `width` tokens a row (a token budget holds that many
    rows of it): what the probe's per-row figure is scaled by."""
    tokens = cfg.micro_batch_tokens
    return cfg.micro_batch if tokens is None else max(1, tokens // width)


def recompute_fit(spare: int, pr: RecomputeProbe, micro_batch: int) -> Optional[RecomputeFit]:
    """The setting with the fewest checkpointed layers whose extra activations fit in `spare` bytes (the
    head room while training, every GPU's smallest); None when none does or nothing would change."""
    per_layer = pr.per_layer_row * micro_batch
    if per_layer <= 0 or spare <= 0:
        return None
    for flag, n, every in fewer_checkpointed(pr.layers, pr.checkpointed):
        extra = (pr.checkpointed - n) * per_layer
        if extra <= spare:
            return RecomputeFit(flag, n, every, int(per_layer), int(extra))
    return None


def no_fit_reason(spare: int, pr: Optional[RecomputeProbe], micro_batch: int, others_short: bool = False) -> str:
    """Why no setting with fewer checkpointed layers was taken (the runner says it, so a default that kept every
    layer recomputed is not silent): nothing measured, nothing to take out, or the free memory too small for
    the cheapest setting (the one that keeps the fewest layers' activations). others_short: this GPU has room,
    another does not (every rank takes the same setting)."""
    if pr is None:
        return ("the layers' activations could not be measured on this trainer (ZeRO-3 gathers its parameters "
                "inside its own forward, or the GPU had no memory for the probe's two rows)")
    options = fewer_checkpointed(pr.layers, pr.checkpointed)
    if not options:
        return f"{pr.checkpointed} of the {pr.layers} layers checkpoint: no setting takes fewer"
    if others_short:
        return "another GPU's free memory holds none of the settings that checkpoint fewer layers"
    if spare <= 0:
        return "nothing is left free while training beyond the placement's margin"
    flag, n, _ = options[-1]
    need = (pr.checkpointed - n) * pr.per_layer_row * micro_batch
    return (f"the {format_bytes(spare)} left free while training holds none: the cheapest, {flag}, keeps "
            f"{pr.checkpointed - n} more layers' activations, {format_bytes(int(need))} at a micro-batch of "
            f"{micro_batch} rows of {pr.width} tokens")


def recomputed_with(spare: int, pr: RecomputeProbe, rows: int) -> int:
    """Layers the backward recomputes after --trim-recompute with `spare` bytes free while training."""
    fit = recompute_fit(spare, pr, rows)
    return fit.checkpointed if fit is not None else pr.checkpointed


def asleep_trade(spare_awake: int, spare_asleep: int, pr: RecomputeProbe, micro_batch: int,
                 wake_sleep_s: float) -> str:
    """With nothing moving, vLLM stays awake through training and holds memory the activations could keep:
    what letting it sleep (--rollout-sleep always) would take out of the recompute, against what its sleep
    and wake took in the measuring step. Empty when it would take nothing out."""
    now, asleep = recomputed_with(spare_awake, pr, micro_batch), recompute_fit(spare_asleep, pr, micro_batch)
    if asleep is None or asleep.checkpointed >= now:
        return ""
    return (f"with vLLM asleep while training (--rollout-sleep always) the backward would recompute "
            f"{asleep.checkpointed} of the {pr.layers} layers instead of {now} ({asleep.flag}), for the "
            f"{wake_sleep_s:.3f} s its sleep and wake took in the measuring step: the faster of the two depends on "
            f"what recomputing {now - asleep.checkpointed} layers costs a step")


def recompute_hint(spare: int, pr: RecomputeProbe, micro_batch: int) -> str:
    """recompute_fit's setting as the planner's hint; empty when there is none."""
    fit = recompute_fit(spare, pr, micro_batch)
    if fit is None:
        return ""
    return (f"{format_bytes(spare)} stays free while training with this placement: {fit.flag} would fit "
            f"({pr.checkpointed - fit.checkpointed} more of the {pr.layers} layers keep their activations, "
            f"measured at {format_bytes(fit.per_layer)} each for a micro-batch of {micro_batch} rows of "
            f"{pr.width} tokens: {format_bytes(fit.extra)} in all). The backward then recomputes "
            f"{fit.checkpointed} layers instead of {pr.checkpointed}: less work, the same gradients "
            "(--trim-recompute takes it). The micro-batch and KV cache hints count the same free memory")


__all__ = ["RecomputeFit", "RecomputeProbe", "asleep_trade", "micro_batch_rows", "no_fit_reason", "probe", "recompute_fit", "recompute_hint",
           "recomputed_with"]
