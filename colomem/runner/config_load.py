"""Loading a RunConfig: a YAML file, then CLI flags over it (flags win), validated with every error naming the
field and where its value came from."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import ValidationError

from colomem.errors import ConfigError

from .config import RunConfig
from .flags import _flag_table, _parse_flag_value, build_arg_parser


def _format_validation(err: ValidationError, sources: dict[tuple[str, ...], str], data: dict) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(str(x) for x in e["loc"])
        name = ".".join(loc) or "config"
        src = sources.get(loc) or sources.get(loc[:2]) or sources.get(loc[:1])
        val: Any = data
        for part in loc:
            val = val.get(part) if isinstance(val, dict) else None
        got = "" if e["type"] == "missing" else f" = {val!r}"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; `--help` lists every field)"
        lines.append(f"  {name}{got}{f' (from {src})' if src else ''}: {msg}")
    return "invalid run config:\n" + "\n".join(lines)


def _set_path(data: dict, path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        cur = data.get(part)
        if not isinstance(cur, dict):
            cur = {}
            data[part] = cur
        data = cur
    data[path[-1]] = value


def load_yaml(path: str | os.PathLike) -> dict:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of RunConfig fields, "
                          f"got {type(data).__name__}")
    return data


def config_from_dict(data: dict, sources: Optional[dict] = None, explicit: Optional[set] = None) -> RunConfig:
    data = dict(data)
    if data.get("lora") is True:            # `lora: true` in YAML = LoRA with defaults
        data["lora"] = {}
    if data.get("lora") is False:
        data["lora"] = None
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation(e, sources or {}, data)) from None
    cfg._explicit = set(explicit or ())
    return cfg


def load_run_config(argv: Optional[list[str]] = None, *, defaults_yaml: Optional[str] = None,
                    parser: Optional[argparse.ArgumentParser] = None) -> RunConfig:
    """Defaults < `defaults_yaml` < `--config FILE` < flags."""
    parser = parser or build_arg_parser()
    ns = parser.parse_args(argv)
    data: dict[str, Any] = {}
    sources: dict[tuple[str, ...], str] = {}
    for yml in (defaults_yaml, ns.config):
        if yml:
            loaded = load_yaml(yml)
            for k, v in loaded.items():
                data[k] = {**data[k], **v} if isinstance(v, dict) and isinstance(data.get(k), dict) else v
                sources[(k,)] = str(yml)
                if isinstance(v, dict):
                    for kk in v:
                        sources[(k, kk)] = str(yml)
    explicit: set[str] = set()
    if ns.lora_on is True and not isinstance(data.get("lora"), dict):
        data["lora"] = {}
        sources[("lora",)] = "--lora"
    elif ns.lora_on is False:
        data["lora"] = None
        sources[("lora",)] = "--no-lora"
    flags = {v: k for k, v in _flag_table().items()}
    for dest, raw in vars(ns).items():
        if not dest.startswith("f__"):
            continue
        path = tuple(dest[3:].split("__"))
        if path[0] == "lora" and data.get("lora") is None:
            if ns.lora_on is False:
                raise ConfigError(f"{flags[path]} given together with --no-lora")
            data["lora"] = {}                 # a --lora-* flag implies --lora
        _set_path(data, path, _parse_flag_value(path, raw))
        sources[path] = flags[path]
        explicit.add(".".join(path))
    if ns.lora_on is not None:
        explicit.add("lora")
    return config_from_dict(data, sources, explicit)


def script_config(parser: argparse.ArgumentParser, argv: Optional[list[str]],
                  default_out: str) -> tuple[argparse.Namespace, RunConfig, Path]:
    """For a script that takes every runner flag plus its own (added to build_arg_parser()'s parser): its
    flags, the run config, and the output folder (--out, else `default_out`), made."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = parser.parse_args(argv)
    cfg = load_run_config(argv, parser=parser)
    out = Path(cfg.out or default_out)
    out.mkdir(parents=True, exist_ok=True)
    return ns, cfg, out


__all__ = ["config_from_dict", "load_run_config", "load_yaml", "script_config"]
