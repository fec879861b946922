"""Prompts from the user's dataset, read with the `datasets` library (JSONL, JSON, Parquet, or a folder
written by `Dataset.save_to_disk`).

The prompt column (`prompt_key`, default "prompt") holds a string or a list of chat messages
(`[{"role": ..., "content": ...}]`, TRL's "conversational" format). Every other column reaches the reward
functions as a keyword (TRL's convention), so `answer`, `solution` or `ground_truth` work as users have them.
Rows are shuffled with the run's seed, anew each epoch; a step takes the next `prompts_per_step` rows, so
every rank draws the same prompts.

Chat prompts are rendered with the tokenizer's chat template and the generation prompt (`chat_template`
"auto", or a Jinja file to use instead); plain strings stay raw. Prompts longer than the room the model
length leaves are dropped, and the count is logged.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable, Optional

from colomem.errors import ConfigError

from .tasks import Sample

DATA_FILES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def load_rows(path: str) -> Any:
    """The dataset at `path` as a `datasets.Dataset`; ConfigError naming the cause when it cannot be read."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"dataset {str(p)!r} does not exist; give a .jsonl, .json or .parquet file, or a folder "
                          "written by datasets' save_to_disk")
    try:
        import datasets
    except ImportError:
        raise ConfigError("--dataset needs the `datasets` package: pip install 'colomem[grpo]'") from None
    try:
        if p.is_dir():
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise ConfigError(f"dataset folder {str(p)!r} holds the splits {sorted(ds)} and none is "
                                      "called 'train'; save the split to use")
                ds = ds["train"]
        elif p.suffix in DATA_FILES:
            ds = datasets.load_dataset(DATA_FILES[p.suffix], data_files=str(p), split="train")
        else:
            raise ConfigError(f"dataset {str(p)!r}: unknown format {p.suffix!r}; use .jsonl, .json, .parquet or a "
                              "save_to_disk folder")
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; the user needs the cause
        raise ConfigError(f"dataset {str(p)!r} cannot be read: {type(e).__name__}: {e}") from None
    if len(ds) == 0:
        raise ConfigError(f"dataset {str(p)!r} is empty")
    return ds


def read_template(chat_template: str) -> Optional[str]:
    """The Jinja text of a --chat-template file; None for auto / none (the tokenizer's own, or none)."""
    if chat_template in ("auto", "none"):
        return None
    path = Path(chat_template).expanduser()
    if not path.is_file():
        raise ConfigError(f"chat template file {str(path)!r} does not exist")
    return path.read_text()


def template_characters(chat_template: str) -> str:
    """The characters a --chat-template file can write (its literal text and string constants), so that a
    config-built tokenizer has a token for each; "" for auto / none."""
    text = read_template(chat_template)
    if text is None:
        return ""
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"chat template {chat_template!r}, line {e.lineno}: {e.message}") from None
    keys = {id(n.arg) for n in tree.find_all(nodes.Getitem)}       # message['role']: read, never written
    chars: set[str] = set()
    for data in tree.find_all(nodes.TemplateData):
        chars.update(data.data)
    for const in tree.find_all(nodes.Const):
        if id(const) not in keys and isinstance(const.value, str):
            chars.update(const.value)
    return "".join(sorted(chars - {"\n", "\r"}))


def _check_messages(value: Any, row: int, key: str) -> None:
    if not value or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                            and isinstance(m.get("content"), str) for m in value):
        raise ConfigError(f"dataset row {row}: column {key!r} is a list but not chat messages "
                          "([{'role': ..., 'content': ...}, ...])")


class DatasetTask:
    """The Task interface (samples, rewards, metrics, alphabet, max_new_tokens) over a user's dataset."""

    name = "dataset"
    rewards: tuple[str, ...] = ()        # the user's --rewards
    metrics: dict[str, str] = {}

    def __init__(self, path: str, *, prompt_key: str = "prompt", max_new_tokens: Optional[int] = None,
                 label: str = "dataset"):
        ds = load_rows(path)
        if prompt_key not in ds.column_names:
            raise ConfigError(f"dataset {path!r} has no column {prompt_key!r} (columns: {ds.column_names}); set "
                              "--prompt-key")
        self.path, self.prompt_key = path, prompt_key
        self.label = label                   # how the log names it ("eval dataset" for the held-out set)
        self._rows = [dict(r) for r in ds]
        for i, r in enumerate(self._rows):
            v = r[prompt_key]
            if isinstance(v, list):
                _check_messages(v, i, prompt_key)
            elif not isinstance(v, str) or not v:
                raise ConfigError(f"dataset row {i}: column {prompt_key!r} must be a non-empty string or chat "
                                  f"messages, got {type(v).__name__}")
        self._max_new_tokens = max_new_tokens
        self._texts: Optional[list[str]] = None
        self._order: dict[int, list[int]] = {}
        self.dropped = 0
        self.longest_prompt_tokens: Optional[int] = None     # known once bind() has tokenized the prompts

    # -- what the job needs before the model exists ----------------------------------------------------------
    @property
    def alphabet(self) -> str:
        """Characters of the prompts and answers (the config-built model's tokenizer is trained on them).

        Chat prompts give their roles' characters too, "assistant" included: a chat template writes the role
        names, the assistant's in the generation prompt."""
        chars: set[str] = set()
        for r in self._rows:
            v = r[self.prompt_key]
            if isinstance(v, list):
                chars.update("assistant" + "".join(m["role"] + m["content"] for m in v))
            else:
                chars.update(v)
            chars.update(str(r.get("answer", "")))
        return "".join(sorted(chars))

    @property
    def max_new_tokens(self) -> int:
        if self._max_new_tokens is None:
            raise ConfigError("a dataset job needs --max-new-tokens (the task cannot know its answers' length)")
        return self._max_new_tokens

    def __len__(self) -> int:
        return len(self._rows)

    # -- rendering with the tokenizer --------------------------------------------------------------------
    def bind(self, tokenizer: Any, *, chat_template: str = "auto", max_prompt_tokens: Optional[int] = None,
             log: Callable[[str], None] = print) -> None:
        """Renders the prompts (chat messages through the template) and drops those longer than
        max_prompt_tokens. ConfigError when chat prompts meet a tokenizer without a template."""
        text = read_template(chat_template)
        if text is not None:
            tokenizer.chat_template = text
        texts, keep, longest = [], [], 0
        for i, r in enumerate(self._rows):
            v = r[self.prompt_key]
            if isinstance(v, list):
                if chat_template == "none" or not getattr(tokenizer, "chat_template", None):
                    raise ConfigError(f"dataset row {i} holds chat messages but the tokenizer has no chat "
                                      "template: give --chat-template PATH (a Jinja file), or plain prompts")
                text = tokenizer.apply_chat_template(v, tokenize=False, add_generation_prompt=True)
            else:
                text = v
            n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            if max_prompt_tokens is not None and n > max_prompt_tokens:
                continue
            texts.append(text)
            keep.append(r)
            longest = max(longest, n)
        self.dropped = len(self._rows) - len(keep)
        if not keep:
            raise ConfigError(f"every prompt of {self.path!r} is longer than {max_prompt_tokens} tokens (the "
                              "model length minus --max-new-tokens); raise --max-model-len")
        if self.dropped:
            log(f"[colomem] {self.label}: {self.dropped} of {len(self._rows)} prompts are longer than "
                f"{max_prompt_tokens} tokens and were left out")
        self._rows, self._texts, self._order = keep, texts, {}
        self.longest_prompt_tokens = longest

    # -- the Task interface ------------------------------------------------------------------------------
    def _epoch_order(self, epoch: int, seed: int) -> list[int]:
        if epoch not in self._order:
            order = list(range(len(self._rows)))
            random.Random(f"dataset:{seed}:{epoch}").shuffle(order)
            self._order = {epoch: order}         # one epoch at a time is all a run reads
        return self._order[epoch]

    def _sample(self, i: int) -> Sample:
        if self._texts is None:
            raise ConfigError(f"the {self.label}'s prompts were not rendered (DatasetTask.bind) before use")
        row = self._rows[i]
        meta = {k: v for k, v in row.items() if k != self.prompt_key}
        return Sample(self._texts[i], str(row.get("answer", "")), meta)

    def samples(self, n: int, *, seed: int, step: int) -> list[Sample]:
        """The rows of `step`: positions step*n .. step*n+n-1 of the shuffled epochs, in order."""
        out = []
        for pos in range(step * n, step * n + n):
            epoch, j = divmod(pos, len(self._rows))
            out.append(self._sample(self._epoch_order(epoch, seed)[j]))
        return out

    def head(self, n: Optional[int] = None) -> list[Sample]:
        """The first n rows in file order (all with None), not shuffled: a held-out set that every
        evaluation reads the same way, so evaluations are comparable."""
        return [self._sample(i) for i in range(len(self._rows) if n is None else min(n, len(self._rows)))]


__all__ = ["DatasetTask", "load_rows", "read_template", "template_characters"]
