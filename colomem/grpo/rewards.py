"""Reward functions: plain Python callables, checked on every call.

A reward function scores one completion:

    def my_reward(prompt: str, completion: str, **meta) -> float      # meta: the task's fields, e.g. answer=

or, decorated with @batched, a whole step at once:

    @batched
    def my_rewards(prompts: list[str], completions: list[str], **meta: list) -> list[float]

Name them in the config as built-ins (exact_match, char_match, format, math_answer) or as
"package.module:function".
A function that raises, returns something that is not a real number, returns NaN/inf, or (batched) returns
the wrong number of values stops the run with a RewardFunctionError naming the function and the sample.
"""
from __future__ import annotations

import atexit
import importlib
import importlib.util
import inspect
import math
import multiprocessing
import numbers
import os
import re
import sys
import threading
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


# ------------------------------------------------------------------------------------------------ math_answer
GOLD_COLUMNS = ("answer", "solution", "ground_truth")     # the names math datasets (and TRL's) give the gold


def _verify_answers(pairs: list[tuple[Optional[str], str]], parsing_timeout: int,
                    verify_timeout: int) -> list[Optional[float]]:
    """math-verify on (gold, completion) pairs: 1.0 / 0.0, None where the gold does not parse. Runs in the
    worker process (module level, so it pickles by name)."""
    from math_verify import parse, verify

    golds: dict[str, list] = {}             # a prompt's group shares its gold: parse it once
    out: list[Optional[float]] = []
    for gold, completion in pairs:
        if gold and gold not in golds:
            golds[gold] = parse(gold, parsing_timeout=parsing_timeout)
        parsed_gold = golds[gold] if gold else []
        if not parsed_gold:
            out.append(None)            # not scorable: no reward can be right or wrong against it
            continue
        pred = parse(completion, parsing_timeout=parsing_timeout)
        out.append(1.0 if pred and verify(parsed_gold, pred, timeout_seconds=verify_timeout) else 0.0)
    return out


class _VerifierProcess:
    """One spawned worker process for math-verify, kept for the run.

    math-verify bounds its parsing and comparisons with signal.alarm, which only works in a main thread, and
    the runner scores on a helper thread. In the worker's main thread its own timeouts apply; a batch that
    still runs past the wall-clock bound (a regex stuck in C code) gets the worker killed."""

    def __init__(self) -> None:
        self._pool: Any = None
        self._lock = threading.Lock()

    def run(self, pairs: list[tuple[Optional[str], str]], parsing_timeout: int, verify_timeout: int,
            bound_s: float) -> list[Optional[float]]:
        with self._lock:
            if self._pool is None:
                # spawn, not fork: the trainer's process has threads (torch, the score thread) a fork would
                # copy in whatever state their locks are
                self._pool = multiprocessing.get_context("spawn").Pool(1)
            job = self._pool.apply_async(_verify_answers, (pairs, parsing_timeout, verify_timeout))
            try:
                return job.get(bound_s)
            except multiprocessing.TimeoutError:
                self.close()
                raise RewardFunctionError(f"math_answer: math-verify took longer than {bound_s:g} s on {len(pairs)} "
                                          "samples despite its own timeouts; the worker was stopped") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None


_VERIFIER = _VerifierProcess()
atexit.register(_VERIFIER.close)


def _gold_of(i: int, columns: dict[str, Optional[list]]) -> Optional[str]:
    for name in GOLD_COLUMNS:
        col = columns.get(name)
        if col is not None and col[i] is not None and str(col[i]).strip():
            return str(col[i])
    return None


def math_answer_reward(parsing_timeout: int = 2, verify_timeout: int = 2, name: str = "math_answer") -> RewardFn:
    """A batched reward fn: 1.0 when the completion's final answer (a \\boxed{} one first, else the last
    expression) equals the gold in value (math-verify: 1/2 == 0.5 == \\frac{1}{2}), 0.0 when it does not,
    None when the row's gold (`answer`, else `solution`, else `ground_truth`) does not parse.

    parsing_timeout and verify_timeout are math-verify's own per-expression bounds (whole seconds, it uses
    signal.alarm); the batch as a whole is bounded too. Raises InvalidArgumentError at once when math-verify
    is not installed, so a job finds out before it starts."""
    if importlib.util.find_spec("math_verify") is None:
        raise InvalidArgumentError("the math_answer reward needs the math-verify package: pip install "
                                   "'colomem[grpo]'")
    if parsing_timeout < 1 or verify_timeout < 1:
        raise InvalidArgumentError("math_answer: parsing_timeout and verify_timeout are whole seconds >= 1")

    def fn(prompts: list[str], completions: list[str], **columns: Any) -> list[Optional[float]]:
        if not any(columns.get(c) is not None for c in GOLD_COLUMNS):
            raise InvalidArgumentError(f"math_answer needs the gold answer in a column called one of "
                                       f"{list(GOLD_COLUMNS)}; the dataset has {sorted(columns)}")
        pairs = [(_gold_of(i, columns), str(c)) for i, c in enumerate(completions)]
        # each sample: at most two parses and a few comparisons, each under its own timeout
        bound = 30.0 + len(pairs) * (2 * parsing_timeout + 2 * verify_timeout)
        return _VERIFIER.run(pairs, parsing_timeout, verify_timeout, bound)

    fn.__name__ = name
    return batched(fn)


BUILTINS: dict[str, Callable[[], RewardFn]] = {
    "exact_match": lambda: exact_match,
    "char_match": lambda: char_match,
    "format": lambda: format_reward(),
    "math_answer": lambda: math_answer_reward(),
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
