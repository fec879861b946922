"""Gradient checkpointing of a Hugging Face model, on every decoder layer or on every K-th one only.

Checkpointing every layer keeps one tensor per layer through the forward and runs each layer's forward again
in the backward: about a third more matmul work for the least activation memory. When the memory beside the
trainer allows more, checkpointing every K-th layer only (the others keep their activations) recomputes 1/K
of the layers. transformers checkpoints each `GradientCheckpointingLayer` whose `gradient_checkpointing` flag
is set: the model's own call enables all of them, and the layers between every K-th one are then turned off.
"""
from __future__ import annotations

from typing import Any, Optional

from colomem.errors import InvalidArgumentError


def decoder_layers(model: Any) -> list:
    """The model's decoder layers transformers can checkpoint one by one (none on an older transformers)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:          # a transformers without per-layer checkpointing
        return []
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def enable_recompute(model: Any, every: int = 1) -> int:
    """Non-reentrant gradient checkpointing of every `every`-th decoder layer (1: all of them); returns how
    many layers it checkpoints (-1: the model has no per-layer switch). InvalidArgumentError when every > 1
    and the model has no per-layer switch."""
    _check_every(every)
    enable = getattr(model, "activation_checkpointing_enable", None)  # the newer name; the older one warns
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return checkpoint_only_every(model, every)


def checkpoint_only_every(model: Any, every: int) -> int:
    """Of the layers checkpointing now, keeps it on every `every`-th decoder layer only; returns how many
    layers checkpoint (-1: no per-layer switch, which only every == 1 accepts)."""
    _check_every(every)
    layers = decoder_layers(model)
    if every > 1:
        if not layers:
            raise InvalidArgumentError(
                f"checkpoint_every={every}: {type(model).__name__} has no decoder layers transformers can "
                "checkpoint one by one; use checkpoint_every 1 (every layer) or no gradient checkpointing")
        for i, m in enumerate(layers):
            if i % every:
                m.gradient_checkpointing = False
    return checkpointed_layers(model) if layers else -1


def keep_checkpointing_every(model: Any, every: int) -> None:
    """For a model someone else's trainer enables checkpointing on (when it starts training, again after it
    generated with the model): every such call on this model object ends with checkpoint_only_every."""
    _check_every(every)
    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        original = getattr(model, name, None)
        if original is None or getattr(original, "_colomem_every", None) == every:
            continue

        def enable(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            out = _original(*args, **kwargs)
            checkpoint_only_every(model, every)
            return out

        enable._colomem_every = every  # type: ignore[attr-defined]
        setattr(model, name, enable)
    if checkpointed_layers(model) > 0:
        checkpoint_only_every(model, every)


def saved_bytes_per_layer(model: Any, input_ids: Any) -> Optional[float]:
    """What one decoder layer that is not checkpointed keeps for the backward beyond what a checkpointed one
    keeps, in bytes, for a forward of `input_ids`: measured from the tensors autograd saves (parameters left
    out) in two forwards, with no layer checkpointed and with every one; nothing runs backward and the
    layers' checkpointing is restored after. A checkpointed layer keeps its input: torch's non-reentrant
    checkpoint saves it through autograd, outside its own hooks, so the second count holds it. None when the
    model has no per-layer switch or checkpointing was never enabled on it."""
    import torch

    layers = decoder_layers(model)
    if not layers or any(getattr(m, "_gradient_checkpointing_func", None) is None for m in layers):
        return None
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    before = [m.gradient_checkpointing for m in layers]
    was_training = model.training

    def saved(checkpoint_all: bool) -> int:
        for m in layers:
            m.gradient_checkpointing = checkpoint_all
        seen: dict[int, int] = {}

        def pack(t: Any) -> Any:
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
            return t

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(input_ids=input_ids, use_cache=False)
        del out
        return sum(seen.values())

    try:
        model.train()
        full, checkpointed = saved(False), saved(True)
    finally:
        for m, flag in zip(layers, before):
            m.gradient_checkpointing = flag
        model.train(was_training)
    return max(0.0, (full - checkpointed) / len(layers))


EVERY_CHOICES = (4, 3, 2)  # --checkpoint-every values weighed, besides none and one layer in all


def fewer_checkpointed(layers: int, checkpointed: int) -> list[tuple[str, int, int]]:
    """The runner's settings that checkpoint fewer of `layers` decoder layers than `checkpointed`, as
    (flag, layers it checkpoints, every: set_checkpointed's argument), fewest first: none, then
    --checkpoint-every K."""
    out = [("--gradient-checkpointing false", 0, 0)]
    out += [(f"--checkpoint-every {k}", -(-layers // k), k) for k in (layers, *EVERY_CHOICES) if k >= 2]
    seen: set[int] = set()
    best = []
    for flag, n, every in out:
        if n < checkpointed and n not in seen:
            seen.add(n)
            best.append((flag, n, every))
    return best


def set_checkpointed(model: Any, every: int) -> int:
    """Of the decoder layers checkpointing now, keeps it on every `every`-th one only (0: on none), for the
    steps from here on; returns how many checkpoint. The gradients stay the same: a layer that is not
    checkpointed keeps its activations instead of computing them again."""
    if every == 0:
        for m in decoder_layers(model):
            m.gradient_checkpointing = False
        return checkpointed_layers(model)
    return checkpoint_only_every(model, every)


def _check_every(every: Any) -> None:
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise InvalidArgumentError(f"checkpoint_every must be an integer >= 1, got {every!r}")


def disable_recompute(model: Any) -> None:
    disable = getattr(model, "activation_checkpointing_disable", None)
    (disable if disable is not None else model.gradient_checkpointing_disable)()


def checkpointed_layers(model: Any) -> int:
    """Decoder layers with checkpointing switched on (-1: the model has no per-layer switch). They run their
    forward again in the backward only in training mode (recomputed_layers)."""
    layers = decoder_layers(model)
    return sum(bool(m.gradient_checkpointing) for m in layers) if layers else -1


def recomputed_layers(model: Any) -> int:
    """Decoder layers a training forward of `model` in its present mode recomputes in the backward: checkpointing
    on and the layer in training mode, the two things transformers checks (-1: no per-layer switch). A model
    left in eval mode, as from_pretrained returns it, recomputes none whatever its flags say."""
    layers = decoder_layers(model)
    return sum(bool(m.gradient_checkpointing) and m.training for m in layers) if layers else -1


__all__ = ["EVERY_CHOICES", "checkpoint_only_every", "checkpointed_layers", "decoder_layers", "disable_recompute",
           "enable_recompute", "fewer_checkpointed", "keep_checkpointing_every", "recomputed_layers",
           "saved_bytes_per_layer", "set_checkpointed"]
