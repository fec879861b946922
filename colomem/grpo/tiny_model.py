"""Config-built Qwen2 models with random weights and a character-level tokenizer trained here.

Nothing is downloaded. `model_dir(shape, alphabet)` writes config.json, safetensors weights and a
tokenizer (tokenizer.json + tokenizer_config.json) with save_pretrained, so vLLM, transformers and
DeepSpeed all load the same directory. Directories are cached by a hash of everything that defines them
(shape, alphabet, seed, dtype, format version) under $COLOMEM_CACHE (default ~/.cache/colomem/models).

The tokenizer has one token per alphabet character plus <pad>, <eos>, <unk>; ids above that up to the
model's vocab_size are reserved tokens (`<r123>`), so every id the model can sample decodes.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from colomem.bench.shapes import QWEN2_0P5B, QWEN2_1P5B, QWEN2_7B, ModelShape
from colomem.errors import InvalidArgumentError

FORMAT_VERSION = 1
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")


def _config_of(shape: ModelShape) -> dict:
    """Qwen2Config fields of a real model's shape (colomem.bench.shapes)."""
    return dict(hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, max_position_embeddings=4096,
                rope_theta=1000000.0, tie_word_embeddings=shape.tied, vocab_size=shape.vocab)


# Config-built Qwen2 models. "tiny" is the embedded default job (about 3 M params, its vocabulary the
# tokenizer's); "qwen2-1.5b" and "qwen2-7b" are the benchmark shapes. The real shapes' dimensions come from the one table of
# them; a spec's values are part of the cache key (model_key), so a change here builds a new model.
SHAPES: dict[str, dict] = {
    "tiny": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0,
                 tie_word_embeddings=False, vocab_size=None),
    "qwen2-0.5b": _config_of(QWEN2_0P5B),
    "qwen2-1.5b": _config_of(QWEN2_1P5B),
    "qwen2-7b": _config_of(QWEN2_7B),          # 7.6 B params: ~15 GB of bf16 weights, built once per cache
}


def cache_home() -> Path:
    """colomem's cache: $COLOMEM_CACHE, default ~/.cache/colomem (models here, datasets given in memory)."""
    return Path(os.environ.get("COLOMEM_CACHE", Path.home() / ".cache" / "colomem"))


def cache_root() -> Path:
    return cache_home() / "models"


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def build_tokenizer(alphabet: str, vocab_size: Optional[int] = None):
    """Train a character-level WordLevel tokenizer on `alphabet`; pad the vocabulary with reserved tokens.

    Returns a transformers PreTrainedTokenizerFast (eos <eos>, pad <pad>, no BOS: Qwen2 uses none)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(alphabet))
    if not chars:
        raise InvalidArgumentError("the tokenizer alphabet is empty")
    bad = [c for c in chars if c in "\n\r" or len(c.encode()) == 0]
    if bad:
        raise InvalidArgumentError(f"alphabet holds characters a char-level tokenizer cannot split on: {bad!r}")
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    trainer = trainers.WordLevelTrainer(special_tokens=list(SPECIAL_TOKENS), min_frequency=0, show_progress=False)
    tok.train_from_iterator(chars, trainer)
    # ids in a fixed order (specials, then sorted characters) whatever the trainer's tie-breaking
    vocab = {t: i for i, t in enumerate(list(SPECIAL_TOKENS) + [c for c in chars])}
    missing = set(tok.get_vocab()) - set(vocab)
    if missing:
        raise InvalidArgumentError(f"tokenizer training produced unexpected tokens {sorted(missing)!r}")
    size = len(vocab) if vocab_size is None else vocab_size
    if size < len(vocab):
        raise InvalidArgumentError(f"vocab_size {size} is smaller than the alphabet + specials ({len(vocab)})")
    for i in range(len(vocab), size):
        vocab[f"<r{i}>"] = i
    final = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    final.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    final.decoder = decoders.Fuse()
    final.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=final, eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)


def model_config(shape: str, vocab_size: int, tokenizer=None, dtype: str = "bfloat16"):
    from transformers import Qwen2Config

    if shape not in SHAPES:
        raise InvalidArgumentError(f"unknown model_shape {shape!r}; choose one of {sorted(SHAPES)}")
    spec = dict(SHAPES[shape])
    spec["vocab_size"] = spec["vocab_size"] or vocab_size
    ids = {}
    if tokenizer is not None:
        ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                   bos_token_id=tokenizer.eos_token_id)
    cfg = Qwen2Config(use_sliding_window=False, rms_norm_eps=1e-6, **spec, **ids)
    cfg.dtype = dtype
    cfg.architectures = ["Qwen2ForCausalLM"]
    return cfg


def model_key(shape: str, alphabet: str, seed: int, dtype: str) -> str:
    spec = {"shape": shape, "spec": SHAPES.get(shape), "alphabet": "".join(sorted(set(alphabet))),
            "seed": seed, "dtype": dtype, "format": FORMAT_VERSION}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def model_dir(shape: str = "tiny", alphabet: str = "0123456789>", *, seed: int = 0, dtype: str = "bfloat16",
              cache_dir: Optional[os.PathLike] = None, log=print) -> Path:
    """Directory of a random-weight Qwen2 of `shape` with a tokenizer for `alphabet`; built once, then cached.

    Safe when several processes (ranks) call it at once: each builds in a private temporary directory and
    renames it into place; the loser of the race drops its copy."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    final = root / f"{shape}-{model_key(shape, alphabet, seed, dtype)}"
    if (final / "done").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        _build(tmp, shape, alphabet, seed, dtype, log)
        (tmp / "done").write_text("ok\n")
        try:
            os.replace(tmp, final)
        except OSError:               # another process finished first (final exists and is not empty)
            if not (final / "done").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _build(d: Path, shape: str, alphabet: str, seed: int, dtype: str, log) -> None:
    import torch
    from transformers import Qwen2ForCausalLM

    base = build_tokenizer(alphabet)
    vocab = SHAPES[shape]["vocab_size"] if shape in SHAPES and SHAPES[shape]["vocab_size"] else \
        _round_up(len(base), 8)
    tok = build_tokenizer(alphabet, vocab)
    cfg = model_config(shape, vocab, tok, dtype)
    torch_dtype = getattr(torch, dtype)
    device = "cuda" if torch.cuda.is_available() and shape != "tiny" else "cpu"   # big shapes init faster on GPU
    log(f"[colomem] building a random {shape} Qwen2 ({device}, seed {seed}) in {d.parent}")
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg)
        model.to(torch_dtype)
        model.save_pretrained(d, safe_serialization=True)
    finally:
        torch.random.set_rng_state(gen_state)
    tok.save_pretrained(d)
    n = sum(p.numel() for p in model.parameters())
    (d / "colomem_model.json").write_text(json.dumps(
        {"shape": shape, "params": n, "vocab_size": vocab, "alphabet": "".join(sorted(set(alphabet))),
         "seed": seed, "dtype": dtype, "format": FORMAT_VERSION}, indent=1) + "\n")
    del model
    if device == "cuda":            # give the memory back before vLLM measures what is free
        import gc
        gc.collect()
        torch.cuda.empty_cache()
