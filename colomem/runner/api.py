"""`train(...)`: the GRPO job from Python, with the model, reward functions and datasets as objects, the way
TRL's `GRPOTrainer(model, reward_funcs, train_dataset=..., eval_dataset=...).train()` takes them.

    from colomem.runner import train
    result = train("path/or/cached-hub-id", reward_funcs=[correct, concise], train_dataset=ds,
                   eval_dataset=held_out, reward_weights=[1.0, 0.2], max_new_tokens=256, lora=True,
                   out="runs/mine")

Every keyword is a flag of `colomem-grpo` spelled with underscores (`max_new_tokens` for --max-new-tokens,
`lora_r` for --lora-r), with a Python value; `config=` reads a YAML file first, as --config does. A reward
function is a callable (TRL's signature: prompts, completions and the dataset's other columns as keywords) or a
string the --rewards flag takes. A dataset is a path the --dataset flag takes, or rows in memory: a
`datasets.Dataset`, a list of dicts, a dict of columns or a pandas DataFrame.

Rows in memory are written once to a Parquet file under $COLOMEM_CACHE/datasets (default
~/.cache/colomem/datasets), named by a hash of their content, and the job reads that file like any --dataset.
So every rank of a multi-GPU run reads the same rows, a resumed run finds the checkpoint's data by its
content (other rows under the same name are refused, as another --dataset is), and each step's prompts are
drawn as the file's would be.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from colomem.errors import ConfigError

from .config import config_from_dict, load_yaml  # (config loads config_load; importing that first would cycle)
from .config_load import _set_path
from .flags import _flag_table
from .loop import RunResult

PathLike = Union[str, "os.PathLike[str]"]
# the keyword that switches LoRA on or off (--lora / --no-lora), or gives its fields as a dict
_ALIASES = {"lora": ("lora",)}


def datasets_cache() -> Path:
    """Where rows given in memory are written: $COLOMEM_CACHE/datasets (default ~/.cache/colomem/datasets)."""
    from colomem.grpo.tiny_model import cache_home

    return cache_home() / "datasets"


def _as_dataset(rows: Any, what: str) -> Any:
    """A `datasets.Dataset` of rows given in memory; ConfigError saying what is accepted otherwise."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{what} given in memory needs the `datasets` package: pip install 'colomem[grpo]'") \
            from None
    if isinstance(rows, datasets.Dataset):
        return rows
    if isinstance(rows, datasets.DatasetDict):
        raise ConfigError(f"{what} is a DatasetDict with the splits {sorted(rows)}: pass one split "
                          f"(e.g. ds['train'])")
    if isinstance(rows, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        raise ConfigError(f"{what} is an iterable (streaming) dataset: the job shuffles its rows every epoch, so it "
                          "needs them all; load it without streaming=True")
    try:
        if isinstance(rows, list):
            if not rows or not all(isinstance(r, dict) for r in rows):
                raise ConfigError(f"{what} is a list: it must be a non-empty list of dicts, one a row")
            return datasets.Dataset.from_list(rows)
        if isinstance(rows, dict):
            return datasets.Dataset.from_dict(rows)
        if type(rows).__name__ == "DataFrame" and hasattr(rows, "columns"):
            return datasets.Dataset.from_pandas(rows, preserve_index=False)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - Arrow's type inference raises many kinds; the user needs the cause
        raise ConfigError(f"{what} cannot be made a dataset: {type(e).__name__}: {e}") from None
    raise ConfigError(f"{what} must be a path (.jsonl, .json, .parquet or a save_to_disk folder), a "
                      f"datasets.Dataset, a list of dicts, a dict of columns or a pandas DataFrame; got "
                      f"{type(rows).__name__}")


def content_hash(ds: Any) -> str:
    """A hash of a dataset's column names and rows (their JSON, keys sorted): the same rows give the same hash
    whatever built them and whichever library version writes the file."""
    h = hashlib.sha256(json.dumps(list(ds.column_names)).encode())
    for row in ds:
        h.update(json.dumps(row, sort_keys=True, ensure_ascii=False, default=repr).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def materialize(rows: Any, name: str, *, root: Optional[Path] = None) -> str:
    """The path the job reads `rows` from: a path as given, rows in memory as a Parquet file under `root`
    (datasets_cache()) named `<name>-<content hash>.parquet`, written unless it is there already. Each writer
    writes its own temporary file and renames it into place, so ranks writing the same rows at once agree."""
    if isinstance(rows, (str, os.PathLike)):
        return str(rows)
    what = {"train": "train_dataset", "eval": "eval_dataset"}.get(name, name)
    ds = _as_dataset(rows, what)
    if len(ds) == 0:
        raise ConfigError(f"{what} is empty")
    root = root or datasets_cache()
    path = root / f"{name}-{content_hash(ds)}.parquet"
    if path.is_file():
        return str(path)
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=root)
    os.close(fd)
    import datasets

    quiet = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()          # a bar for a copy the user did not ask for says nothing
    try:
        ds.to_parquet(tmp)
        os.replace(tmp, path)
    finally:
        if not quiet:
            datasets.enable_progress_bars()
        if os.path.exists(tmp):
            os.unlink(tmp)
    return str(path)


def _field_paths() -> dict[str, tuple[str, ...]]:
    """keyword -> the config field it sets: each flag's name with underscores (--lora-r: lora_r)."""
    table = {flag[2:].replace("-", "_"): path for flag, path in _flag_table().items()}
    table.update(_ALIASES)
    return table


def _reward_label(fn: Any) -> str:
    """What the config records for a reward function given as a callable (its module:qualified name)."""
    if isinstance(fn, str):
        return fn
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return f"{getattr(fn, '__module__', None) or 'python'}:{name}"


def build_config(model: Optional[PathLike] = None, reward_funcs: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, *, config: Optional[PathLike] = None,
                 data_root: Optional[Path] = None, **options: Any) -> tuple[Any, Optional[list]]:
    """(the RunConfig, the reward functions to run) that train() runs; ConfigError naming the keyword at fault."""
    data: dict[str, Any] = load_yaml(config) if config is not None else {}
    sources: dict[tuple[str, ...], str] = {(k,): str(config) for k in data}
    explicit: set[str] = set()
    paths = _field_paths()
    for key in options:
        if key not in paths:
            near = difflib.get_close_matches(key, paths, n=3)
            raise ConfigError(f"train() got an unknown keyword {key!r}; "
                              + (f"did you mean {', '.join(near)}?" if near else
                                 "each flag of colomem-grpo is one, spelled with underscores"))
    lora_keys = [k for k in options if paths[k][0] == "lora" and k != "lora"]
    if options.get("lora") is False and lora_keys:
        raise ConfigError(f"train() got lora=False together with {', '.join(lora_keys)}")
    if "lora" in options:                     # True: LoRA with the defaults, as --lora; a dict: its fields
        data["lora"] = {} if options["lora"] is True else None if options["lora"] is False else options["lora"]
        sources[("lora",)] = "train(lora=...)"
        explicit.add("lora")
    if lora_keys and not isinstance(data.get("lora"), dict):
        data["lora"] = {}                     # a lora_* keyword implies LoRA, as a --lora-* flag does
    for key, value in options.items():
        if key == "lora":
            continue
        _set_path(data, paths[key], value)
        sources[paths[key]] = f"train({key}=...)"
        explicit.add(".".join(paths[key]))
    if model is not None:
        data["model"], sources[("model",)] = str(model), "train(model)"
    fns: Optional[list] = None
    if reward_funcs is not None:
        fns = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not fns or not all(callable(f) or isinstance(f, str) for f in fns):
            raise ConfigError("reward_funcs must be a callable, a --rewards name, or a non-empty list of them")
        data["rewards"], sources[("rewards",)] = [_reward_label(f) for f in fns], "train(reward_funcs)"
        explicit.add("rewards")
    for key, rows, name in (("dataset", train_dataset, "train"), ("eval_dataset", eval_dataset, "eval")):
        if rows is not None:
            data[key] = materialize(rows, name, root=data_root)
            sources[(key,)] = f"train({'train_dataset' if key == 'dataset' else key})"
            explicit.add(key)
    return config_from_dict(data, sources, explicit), fns


def train(model: Optional[PathLike] = None, reward_funcs: Union[Callable, str, Sequence, None] = None,
          train_dataset: Any = None, eval_dataset: Any = None, *, config: Optional[PathLike] = None,
          print_fn: Callable[[str], None] = print, **options: Any) -> RunResult:
    """Runs the colocated GRPO job (run_job) with the model, rewards and datasets given here; returns its
    RunResult (`summary`: what summary.json holds). See the module docstring for what each argument takes.
    A bad keyword or value is a ConfigError before anything is built."""
    from .job import run_job

    cfg, fns = build_config(model, reward_funcs, train_dataset, eval_dataset, config=config, **options)
    return run_job(cfg, reward_fns=fns, print_fn=print_fn)


__all__ = ["build_config", "content_hash", "datasets_cache", "materialize", "train"]
