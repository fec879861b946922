"""Command-line flags for every field of RunConfig and its sub-models (GRPOConfig, LoraSpec): the flag table,
the parsing of a flag's string into what pydantic validates, and the argparse parser with each field's help."""
from __future__ import annotations

import argparse
import types
import typing
from typing import Any, Literal

import yaml
from pydantic import BaseModel

from colomem.grpo.config import GRPOConfig, LoraSpec, _Strict

from .config import _SUBMODELS, RunConfig


def _flag(name: str, prefix: str = "") -> str:
    return "--" + (prefix + name).replace("_", "-")


def _flag_table() -> dict[str, tuple[str, ...]]:
    """flag -> path of the field it sets, e.g. '--clip-eps' -> ('grpo', 'clip_eps')."""
    table: dict[str, tuple[str, ...]] = {}
    for name in RunConfig.model_fields:
        if name not in _SUBMODELS:
            table[_flag(name)] = (name,)
    for name in GRPOConfig.model_fields:
        assert _flag(name) not in table, f"flag clash: {name}"
        table[_flag(name)] = ("grpo", name)
    for name in LoraSpec.model_fields:
        table[_flag(name, "lora_")] = ("lora", name)
    return table


def _annotation(path: tuple[str, ...]):
    model: type[_Strict] = RunConfig if len(path) == 1 else _SUBMODELS[path[0]]
    return model.model_fields[path[-1]].annotation


_UNION_TYPES = (typing.Union, getattr(types, "UnionType", typing.Union))


def _unwrap(ann):
    """Optional[X] -> (X, True); X -> (X, False)."""
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    if typing.get_origin(ann) in _UNION_TYPES and len(args) == 1:
        return args[0], True
    return ann, False


def _bool_or_choice(ann) -> tuple:
    """The named choices of a field that is a bool or one of them (e.g. --trim-recompute true|false|auto);
    () for any other field."""
    if typing.get_origin(ann) not in _UNION_TYPES or bool not in typing.get_args(ann):
        return ()
    return tuple(c for a in typing.get_args(ann) if typing.get_origin(a) is Literal for c in typing.get_args(a))


def _parse_bool(raw: str) -> Any:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    return raw


def _parse_flag_value(path: tuple[str, ...], raw: str) -> Any:
    """CLI strings -> Python values; pydantic does the type coercion and the checks."""
    ann, optional = _unwrap(_annotation(path))
    if optional and raw.strip().lower() in ("none", "null", ""):
        return None
    origin = typing.get_origin(ann)
    if origin is list:
        return [s.strip() for s in raw.split(",") if s.strip()]
    if origin is dict or ann is dict:
        val = yaml.safe_load(raw)
        return val if val is not None else {}
    if origin is Literal:           # the choice the string names (--zero-stage 3 is the int 3, not "3")
        for choice in typing.get_args(ann):
            if str(choice) == raw.strip():
                return choice
        return raw
    choices = _bool_or_choice(ann)
    if choices and raw.strip() in map(str, choices):
        return raw.strip()
    if ann is bool or choices:
        return _parse_bool(raw)
    return raw


def _help_text(field: Any, path: tuple[str, ...]) -> str:
    """The field's description and its default: flags default to "unset" in argparse (so a YAML value is not
    overridden by a default), which hides the real default from --help."""
    text = field.description or ""
    if path[0] == "lora" and len(path) == 1:
        return text
    default = field.get_default(call_default_factory=True)
    if isinstance(default, BaseModel):
        return text
    shown = "unset" if default is None else ",".join(map(str, default)) if isinstance(default, list) else default
    return f"{text} (default: {shown})" if text else f"(default: {shown})"


def build_arg_parser(description: str = "colocated GRPO") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file with RunConfig fields (flags override it)")
    p.add_argument("--lora", dest="lora_on", action="store_const", const=True, default=None,
                   help="train a LoRA adapter (--lora-r/--lora-alpha/... set it up)")
    p.add_argument("--no-lora", dest="lora_on", action="store_const", const=False, help="full fine-tuning")
    for flag, path in _flag_table().items():
        ann, _ = _unwrap(_annotation(path))
        model: type[_Strict] = RunConfig if len(path) == 1 else _SUBMODELS[path[0]]
        field = model.model_fields[path[-1]]
        help_ = _help_text(field, path)
        dest = "f__" + "__".join(path)
        either = _bool_or_choice(ann)
        if ann is bool or either:
            p.add_argument(flag, dest=dest, nargs="?", const="true", default=argparse.SUPPRESS, help=help_,
                           metavar="|".join(("true", "false", *map(str, either))))
            p.add_argument("--no-" + flag[2:], dest=dest, action="store_const", const="false",
                           default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        else:
            choices = typing.get_args(ann) if typing.get_origin(ann) is Literal else ()
            metavar = "{" + ",".join(str(c) for c in choices) + "}" if choices else path[-1].upper()
            p.add_argument(flag, dest=dest, default=argparse.SUPPRESS, help=help_, metavar=metavar)
    return p
