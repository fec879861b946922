"""torch.compile for the trainer's model, one decoder layer's parts at a time.

A micro-batch of a few rows runs thousands of small kernels through Python module code: the GPU waits for
the host (the forward of each layer is run again in the backward under gradient checkpointing, so the host
pays it twice). Compiling each part of a decoder layer (its attention, its MLP, its norms) fuses their
elementwise kernels and replaces their Python with one call each.

Why the parts and not the layer or the whole model:
- transformers checkpoints a layer by wrapping its call (or its forward) in torch.utils.checkpoint; inside a
  compiled region that becomes a higher-order op that does not trace through transformers' side effects. The
  parts run inside the checkpoint, so the recompute in the backward calls the same compiled code.
- Every layer's parts are the same code: with parameters as graph inputs (torch's default) one compiled graph
  serves all layers, so the compile cost does not grow with the depth.
- `Module.compile()` keeps the module and its parameter names: checkpoints, the weight sync and the LoRA
  merge see the model they always saw.
Shapes are compiled dynamic from the start (sequence lengths change with every micro-batch), so a run compiles
each part once for training (and once more where it also runs without gradients).
"""
from __future__ import annotations

import importlib.util
from typing import Any

from colomem.errors import InvalidArgumentError


def compile_problem(device_type: str) -> str:
    """Why torch.compile cannot run on `device_type` here, or "" when it can: on the CPU Inductor builds its
    kernels with a C++ compiler; on a GPU it needs Triton (which comes with torch's CUDA wheels)."""
    if device_type == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()                 # the search Inductor itself makes (CXX, then its own list)
        except ImportError:                    # a torch without that module: its first compile will tell
            return ""
        except Exception as e:                 # noqa: BLE001 - Inductor's InvalidCxxCompiler and the like
            return (f"torch_compile on the CPU needs a C++ compiler, and none was found ({type(e).__name__}); "
                    "install g++ (or name one in the CXX environment variable) or turn torch_compile off")
        return ""
    if importlib.util.find_spec("triton") is None:
        return "torch_compile on the GPU needs Triton (part of torch's CUDA wheels); install it or turn it off"
    return ""


def compile_decoder_layers(model: Any, device_type: str) -> int:
    """Compiles every part (direct child module) of each of the model's decoder layers in place; returns how
    many parts. InvalidArgumentError when the model has no decoder layers transformers marks as such, or when
    the device cannot compile (compile_problem)."""
    from .recompute import decoder_layers

    problem = compile_problem(device_type)
    if problem:
        raise InvalidArgumentError(problem)
    layers = decoder_layers(model)
    if not layers:
        raise InvalidArgumentError(f"torch_compile compiles a model's decoder layers one part at a time, and "
                                   f"{type(model).__name__} has none that transformers marks as decoder layers; "
                                   "turn torch_compile off for this model")
    parts = 0
    for layer in layers:
        for part in layer.children():
            if next(part.parameters(), None) is not None:     # a part with weights (not a bare activation)
                part.compile(dynamic=True)
                parts += 1
    return parts


def compiled_parts(model: Any) -> int:
    """How many of the model's modules run compiled (Module.compile() was called on them)."""
    return sum(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


__all__ = ["compile_decoder_layers", "compile_problem", "compiled_parts"]
