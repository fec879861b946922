"""HFRollout: the rollout protocol on transformers `generate` (the CPU stand-in for VLLMRollout).

sleep / wake_* change no memory (there is no KV cache pool on the CPU) but keep vLLM's state machine, so
generating while asleep or syncing before a wake raises PhaseOrderError, and they record their timings.
load_weights copies named tensors into its own model.

With `lora=` it serves a LoRA adapter the way VLLMRollout's adapter mode does: its model carries the adapter
(peft), a sync writes the adapter's tensors only and the base stays as it is. Its base tensors
(`base_parameters()`) can then be the trainer's own base: one copy for both (colomem.engines.shared_base),
and `sleep(keep_weights=True)` leaves them in place as vLLM's KV-only sleep does.
"""
from __future__ import annotations

import time
from typing import Iterable, Optional

import torch
from torch import Tensor

from colomem.engines.hf_export import adapter_key
from colomem.engines.hf_model import load_model
from colomem.engines.protocols import ASLEEP, AWAKE, CLOSED, WEIGHTS_ONLY, check_kv_bytes, check_sampling
from colomem.engines.reports import SyncStats
from colomem.errors import InvalidArgumentError, PhaseOrderError, PoolClosedError, StaleWeightsError, WeightCheckError


def _penalty_over_own_tokens(penalty: float, starts: Tensor):
    """transformers' repetition penalty over each row's own tokens (prompt and completion), as vLLM applies it.
    transformers' processor reads every position of input_ids, so a row's left padding (the pad token is the
    EOS token where a tokenizer has none) would be penalized too: each pad position is read as the row's first
    prompt token instead, which is penalized anyway. generate runs it before the temperature and the filters,
    as vLLM does."""
    from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    class OwnTokens(LogitsProcessor):
        inner = RepetitionPenaltyLogitsProcessor(float(penalty))

        def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
            at = starts.to(input_ids.device)[:, None]
            pad = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :] < at
            return self.inner(torch.where(pad, input_ids.gather(1, at), input_ids), scores)
    return LogitsProcessorList([OwnTokens()])


def _fingerprint(t: Tensor) -> tuple:
    """Cheap, order-sensitive checksum of a tensor's values (a strided sample plus the sum)."""
    flat = t.detach().reshape(-1).float()
    step = max(1, flat.numel() // 64)
    return (flat.numel(), round(float(flat.double().sum()), 6), tuple(flat[::step][:64].tolist()))


class HFRollout:
    """Rollout protocol on transformers generate (CPU, or any torch device)."""

    def __init__(self, model_path, *, eos_token_id: int, pad_token_id: int, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, trust_remote_code: bool = False, check_sample: int = 4,
                 lora=None, seed: int = 0):
        self.device = torch.device(device)
        # what unseeded generate() calls draw from, as vLLM's engine generator: seeded once, advanced by each call
        self._engine_rng = torch.Generator().manual_seed(int(seed)).get_state()
        self.model = load_model(model_path, dtype, trust_remote_code).to(self.device).eval()
        self.lora = lora
        # the base by HF name, before an adapter wraps it (peft keeps these very tensors as its base layers)
        self._base = dict(self.model.named_parameters())
        if lora is not None:
            from peft import get_peft_model

            from colomem.engines.lora import build_lora_config, check_lora_layers

            self.model = get_peft_model(self.model, build_lora_config(lora)).eval()
            check_lora_layers(self.model)
        self.eos_token_id = int(eos_token_id)
        self.pad_token_id = int(pad_token_id)
        self.weight_version = 0
        self._expected_version = 0
        self._phase = AWAKE
        # what a sync writes: every parameter, or with an adapter the adapter's, named as peft saves them
        self._params = (dict(self.model.named_parameters()) if lora is None else
                        {adapter_key(n): p for n, p in self.model.named_parameters() if ".lora_" in n})
        self._expected: dict[str, tuple] = {}
        # as vLLM's: False once a sleep would have discarded the weights (not keep_weights), until a sync
        # writes every parameter; while True a sync may write some (a merged shared base: the adapted ones)
        self._weights_valid = True
        self.check_sample = int(check_sample)
        self.timings: dict[str, float] = {}
        self.last_sync: Optional[SyncStats] = None

    # -- guards ------------------------------------------------------------------------------------------
    @property
    def phase(self) -> str:
        return self._phase

    def _require(self, phases, what: str, hint: str) -> None:
        if self._phase == CLOSED:
            raise PoolClosedError(f"HFRollout is closed; cannot {what}")
        if self._phase not in phases:
            raise PhaseOrderError(f"{what} while the rollout is {self._phase!r}: {hint}")

    def expect_version(self, version: int) -> None:
        """The trainer announces its newest weights; generate() refuses older ones from now on."""
        self._expected_version = max(self._expected_version, int(version))

    # -- phases ------------------------------------------------------------------------------------------
    def base_parameters(self) -> dict[str, Tensor]:
        """The base model's parameters by HF name (the tensors themselves: a trainer may share them)."""
        if self._phase == CLOSED:
            raise PoolClosedError("HFRollout is closed")
        return dict(self._base)

    def sleep(self, keep_weights: bool = False, kv_bytes: Optional[int] = None) -> None:
        """keep_weights: only the KV cache would go (vLLM's KV-only sleep): the weights stay readable, and
        the next awake window starts at the sync (no wake_weights). kv_bytes: only that much of it would go
        (recorded in `timings`, as vLLM's figure of what it released)."""
        check_kv_bytes(keep_weights, kv_bytes)
        self._require((AWAKE, WEIGHTS_ONLY), "sleep", "the rollout is already asleep")
        t0 = time.perf_counter()
        self.timings["kv_release_asked_bytes"] = kv_bytes or 0
        self._phase = WEIGHTS_ONLY if keep_weights else ASLEEP
        self._weights_valid = self._weights_valid and keep_weights
        self.timings["sleep_s"] = time.perf_counter() - t0

    def wake_need(self, tags: Iterable[str]) -> Optional[int]:
        """The stand-in maps no GPU memory when it wakes."""
        return 0

    def wake_weights(self) -> None:
        self._require((ASLEEP,), "wake_weights", "call sleep() first")
        t0 = time.perf_counter()
        self._phase = WEIGHTS_ONLY
        self.timings["wake_weights_s"] = time.perf_counter() - t0

    def wake_kv(self) -> None:
        self._require((WEIGHTS_ONLY,), "wake_kv", "call wake_weights() (and sync) first")
        t0 = time.perf_counter()
        self._phase = AWAKE
        self.timings["wake_kv_s"] = time.perf_counter() - t0

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> SyncStats:
        """Copies (HF name, tensor) pairs into the model; after a sleep without keep_weights every parameter
        must be written (with an adapter: every adapter tensor, peft names; the base is not the sync's to
        write), as vLLM requires after a sleep that discarded its weights."""
        self._require((WEIGHTS_ONLY, AWAKE), "load_weights", "call wake_weights() first")
        if int(version) < self.weight_version:
            raise InvalidArgumentError(f"version {version} is older than the rollout's {self.weight_version}")
        t0 = time.perf_counter()
        stats = SyncStats(version=int(version))
        written = set()
        with torch.no_grad():
            for name, t in named_tensors:
                if self.lora is not None:
                    name = adapter_key(name if name.startswith("base_model.model.") else "base_model.model." + name)
                p = self._params.get(name)
                if p is None and self.lora is not None:
                    raise InvalidArgumentError(f"load_weights: {name!r} is not a tensor of the rollout's LoRA "
                                               "adapter; with an adapter the sync sends the adapter only")
                if p is None:
                    raise InvalidArgumentError(f"load_weights: the rollout model has no parameter {name!r}")
                if tuple(p.shape) != tuple(t.shape):
                    raise InvalidArgumentError(f"load_weights: {name} has shape {tuple(t.shape)}, the rollout "
                                               f"model expects {tuple(p.shape)}")
                p.copy_(t.to(device=p.device, dtype=p.dtype))
                written.add(name)
                stats.nbytes += t.numel() * t.element_size()
                stats.ntensors += 1
        missing = sorted(set(self._params) - written)
        stats.complete = not missing
        stats.nmissing, stats.missing = len(missing), tuple(missing[:4])
        if missing and (not self._weights_valid or not written):
            raise WeightCheckError(f"load_weights wrote {len(written)} of {len(self._params)} parameters; "
                                   f"missing e.g. {missing[:4]}")
        self._weights_valid = True
        names = sorted(written)
        pick = names[:: max(1, len(names) // self.check_sample)][: self.check_sample]
        self._expected = {n: _fingerprint(self._params[n]) for n in pick}
        self.weight_version = int(version)
        self._expected_version = max(self._expected_version, self.weight_version)
        stats.seconds = stats.apply_seconds = time.perf_counter() - t0
        self.last_sync = stats
        return stats

    def check(self) -> None:
        """The sampled parameters still hold what the last sync wrote."""
        self._require((WEIGHTS_ONLY, AWAKE), "check", "call wake_weights() first")
        bad = [n for n, fp in self._expected.items() if _fingerprint(self._params[n]) != fp]
        if bad:
            raise WeightCheckError(f"{len(bad)} sampled rollout parameters changed since the last sync "
                                   f"(e.g. {bad[:3]}); sync again before generating")

    # -- generation --------------------------------------------------------------------------------------
    def generate(self, prompt_ids: list, *, n: int = 1, max_new_tokens: int = 16, temperature: float = 1.0,
                 top_p: float = 1.0, seed: Optional[int] = 0, top_k: Optional[int] = None,
                 min_p: float = 0.0, repetition_penalty: float = 1.0) -> list:
        """n sampled completions per prompt, with each sampled token's logprob (of logits / temperature).

        temperature 0 is greedy decoding (the most likely token each time, as vLLM does for 0; the seed is
        not used), with the logprobs of the logits themselves."""
        from colomem.grpo.batch import Completion

        self._require((AWAKE,), "generate", "call wake_weights(), load_weights(...) and wake_kv() first")
        if self.weight_version < self._expected_version:
            raise StaleWeightsError(f"the rollout holds weights version {self.weight_version} but the trainer "
                                    f"announced {self._expected_version}; sync first")
        if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
            raise InvalidArgumentError("prompt_ids must be a non-empty list of non-empty token lists")
        check_sampling(temperature, top_p, top_k, min_p, repetition_penalty)
        greedy = temperature == 0
        # greedy: no sampling knobs at all (transformers warns about sampling options given to a greedy call)
        knobs = dict(do_sample=False, temperature=None, top_p=None, top_k=None) if greedy else \
            dict(do_sample=True, temperature=float(temperature), top_p=float(top_p), top_k=int(top_k or 0),
                 min_p=float(min_p) if min_p else None)
        width = max(len(p) for p in prompt_ids)
        rows = [p for p in prompt_ids for _ in range(n)]
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(rows):                      # left padding for generation
            ids[i, width - len(p):] = torch.as_tensor(p)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        if repetition_penalty != 1.0:      # greedy decoding too, as in vLLM: it changes which token is the argmax
            starts = torch.as_tensor([width - len(p) for p in rows], dtype=torch.long)
            knobs["logits_processor"] = _penalty_over_own_tokens(repetition_penalty, starts)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            if seed is None:
                torch.random.set_rng_state(self._engine_rng)
            else:
                torch.manual_seed(int(seed))
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, **knobs, max_new_tokens=int(max_new_tokens), min_new_tokens=0,
                eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id,
                output_logits=True, return_dict_in_generate=True)
            if seed is None:
                self._engine_rng = torch.random.get_rng_state()
        gen = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1)[:, : gen.shape[1]].float() / (1.0 if greedy else float(temperature))
        lps = torch.log_softmax(logits, dim=-1).gather(-1, gen[..., None]).squeeze(-1)
        result: list[list] = []
        for i in range(len(rows)):
            toks = gen[i].tolist()
            if self.eos_token_id in toks:
                k = toks.index(self.eos_token_id) + 1
                c = Completion(toks[:k], lps[i, :k].tolist(), "stop")
            else:
                c = Completion(toks, lps[i].tolist(), "length")
            if i % n == 0:
                result.append([])
            result[-1].append(c)
        return result

    def memory(self) -> dict:
        return {"phase": self._phase, "weight_version": self.weight_version}

    def close(self) -> None:
        self._phase = CLOSED
        self.model = None
        self._params = {}
        self._base = {}


__all__ = ["HFRollout"]
