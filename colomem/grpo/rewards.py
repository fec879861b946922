"""Reward functions: plain Python callables, checked on every call.

A reward function scores one completion:

    def my_reward(prompt: str, completion: str, **meta) -> float      # meta: the task's fields, e.g. answer=

or, decorated with @batched, a whole step at once:

    @batched
    def my_rewards(prompts: list[str], completions: list[str], **meta: list) -> list[float]

Name them in the config as built-ins (exact_match, char_match, format) or as "package.module:function".
A function that raises, returns something that is not a real number, returns NaN/inf, or (batched) returns
the wrong number of values stops the run with a RewardFunctionError naming the function and the sample.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from colomem.errors import ColomemError, InvalidArgumentError

RewardFn = Callable[..., Any]


class RewardFunctionError(ColomemError):
    """A reward function raised or returned something unusable; the message names the function and sample."""


def batched(fn: RewardFn) -> RewardFn:
    """Mark `fn` as taking lists (prompts, completions, **meta lists) and returning one value per sample."""
    setattr(fn, "colomem_batched", True)   # read by score(); a marker attribute, as functools.wraps keeps it
    return fn


# ------------------------------------------------------------------------------------------------ built-ins
def exact_match(prompt: str, completion: str, *, answer: str, **meta) -> float:
    """1 when the completion (surrounding whitespace ignored) equals the answer, else 0."""
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


def char_match(prompt: str, completion: str, *, answer: str, **meta) -> float:
    """Partial credit: characters equal at the same position / max(len(answer), len(completion)).

    Extra or missing characters count as wrong, so only the exact answer scores 1."""
    a, c = str(answer).strip(), completion.strip()
    if not a and not c:
        return 1.0
    hits = sum(x == y for x, y in zip(a, c))
    return hits / max(len(a), len(c))


def regex_match(pattern: str, flags: int = 0, name: Optional[str] = None) -> RewardFn:
    """A reward fn: 1 when `pattern` is found in the completion (re.search), else 0."""
    rx = re.compile(pattern, flags)

    def fn(prompt: str, completion: str, **meta) -> float:
        return 1.0 if rx.search(completion) else 0.0
    fn.__name__ = name or f"regex_match({pattern!r})"
    return fn


def format_reward(pattern: Optional[str] = None, flags: int = re.DOTALL, name: Optional[str] = None) -> RewardFn:
    """A reward fn: 1 when the whole stripped completion matches `pattern` (re.fullmatch), else 0.

    Without a pattern it uses the sample's `format` meta field (tasks set one)."""
    rx = re.compile(pattern, flags) if pattern is not None else None

    def fn(prompt: str, completion: str, **meta) -> float:
        r = rx
        if r is None:
            if "format" not in meta:
                raise InvalidArgumentError("format_reward without a pattern needs a `format` meta field")
            r = re.compile(meta["format"], flags)
        return 1.0 if r.fullmatch(completion.strip()) else 0.0
    fn.__name__ = name or ("format" if pattern is None else f"format({pattern!r})")
    return fn


BUILTINS: dict[str, Callable[[], RewardFn]] = {
    "exact_match": lambda: exact_match,
    "char_match": lambda: char_match,
    "format": lambda: format_reward(),
}


def resolve(spec: str | RewardFn) -> RewardFn:
    """A built-in name, "module:function" (importable, or a module in the working directory), a file path
    "path/to/file.py:function", or a callable -> the callable."""
    if callable(spec):
        return spec
    if spec in BUILTINS:
        return BUILTINS[spec]()
    if ":" in spec:
        mod, _, attr = spec.rpartition(":")
        try:
            module = _load_module(mod)
        except (ImportError, OSError, SyntaxError) as e:
            raise InvalidArgumentError(f"reward {spec!r}: cannot import {mod!r} ({type(e).__name__}: {e}); give "
                                       "'package.module:function', a module in the working directory, or "
                                       "'path/to/file.py:function'") from None
        fn = getattr(module, attr, None)
        if fn is None:
            raise InvalidArgumentError(f"reward {spec!r}: {mod!r} has no {attr!r}")
        if not callable(fn):
            raise InvalidArgumentError(f"reward {spec!r} is not callable")
        return fn
    raise InvalidArgumentError(f"unknown reward {spec!r}; built-ins: {sorted(BUILTINS)}, 'module:function' or "
                               "'file.py:function'")


def _load_module(mod: str):
    """A module by dotted name (the working directory searched too, as `python -m` would) or by file path."""
    if mod.endswith(".py") or os.sep in mod:
        path = Path(mod).expanduser().resolve()
        if not path.is_file():
            raise ImportError(f"no file {str(path)!r}")
        name = f"colomem_user_rewards_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"{str(path)!r} is not a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module          # pickling and dataclasses in the file need it registered
        spec.loader.exec_module(module)
        return module
    cwd = os.getcwd()
    if cwd not in sys.path:                 # the runner's folder is on sys.path, the working directory is not
        sys.path.append(cwd)
    return importlib.import_module(mod)


def fn_name(fn: RewardFn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


# ------------------------------------------------------------------------------------------------ scoring
@dataclass
class RewardSpec:
    fn: RewardFn
    weight: float = 1.0
    name: Optional[str] = None

    @property
    def label(self) -> str:
        return self.name or fn_name(self.fn)


def _check_value(value: Any, label: str, i: int, prompt: str, completion: str) -> Optional[float]:
    if value is None:
        return None         # not scorable by this function (TRL's convention)
    where = f"sample {i} (prompt {prompt!r}, completion {completion!r})"
    if hasattr(value, "numel") and hasattr(value, "item"):
        raise RewardFunctionError(f"reward function {label!r} returned a tensor for {where}; return a float "
                                  "(use .item())")
    if not isinstance(value, numbers.Real):
        raise RewardFunctionError(f"reward function {label!r} returned {type(value).__name__} {value!r} for "
                                  f"{where}; it must return a float")
    v = float(value)
    if not math.isfinite(v):
        raise RewardFunctionError(f"reward function {label!r} returned {v} for {where}; rewards must be finite")
    return v


def is_batched(fn: RewardFn) -> bool:
    """Batched: marked with @batched, or TRL's signature fn(prompts, completions, **columns) (so a TRL
    reward file works unchanged)."""
    if getattr(fn, "colomem_batched", False):
        return True
    try:
        names = [p.name for p in inspect.signature(fn).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return names[:2] == ["prompts", "completions"]


def score(spec: RewardSpec, prompts: Sequence[str], completions: Sequence[str],
          metas: Sequence[dict]) -> list[Optional[float]]:
    """Values of one reward function for every sample, validated; None where it could not score one."""
    n = len(completions)
    if len(prompts) != n or len(metas) != n:
        raise InvalidArgumentError(f"{len(prompts)} prompts, {n} completions, {len(metas)} metas: must be equal")
    label = spec.label
    if is_batched(spec.fn):
        keys = sorted({k for m in metas for k in m})
        cols = {k: [m.get(k) for m in metas] for k in keys}
        try:
            values = spec.fn(list(prompts), list(completions), **cols)
        except RewardFunctionError:
            raise
        except Exception as e:
            raise RewardFunctionError(f"reward function {label!r} raised {type(e).__name__}: {e} "
                                      f"(batched call on {n} samples)") from e
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
            raise RewardFunctionError(f"batched reward function {label!r} returned {type(values).__name__}; "
                                      f"it must return a list of {n} floats")
        values = list(values)
        if len(values) != n:
            raise RewardFunctionError(f"batched reward function {label!r} returned {len(values)} values for "
                                      f"{n} samples")
        return [_check_value(v, label, i, prompts[i], completions[i]) for i, v in enumerate(values)]
    out = []
    for i, (p, c, m) in enumerate(zip(prompts, completions, metas)):
        try:
            v = spec.fn(p, c, **m)
        except RewardFunctionError:
            raise
        except Exception as e:
            raise RewardFunctionError(f"reward function {label!r} raised {type(e).__name__}: {e} on sample {i} "
                                      f"(prompt {p!r}, completion {c!r})") from e
        out.append(_check_value(v, label, i, p, c))
    return out


def compute_rewards(specs: Sequence[RewardSpec], prompts: Sequence[str], completions: Sequence[str],
                    metas: Sequence[dict]) -> tuple[list[Optional[float]], dict[str, list[Optional[float]]]]:
    """Weighted sum of the reward functions per sample, and each function's own values (for the metrics).

    A function's None leaves it out of that sample's sum; a sample none of them scored is None (not
    scorable: the runner gives it advantage 0)."""
    if not specs:
        raise InvalidArgumentError("no reward functions configured")
    parts = {}
    total: list[Optional[float]] = [None] * len(completions)
    for spec in specs:
        vals = score(spec, prompts, completions, metas)
        parts[spec.label] = vals
        total = [t if v is None else (t or 0.0) + spec.weight * v for t, v in zip(total, vals)]
    return total, parts
