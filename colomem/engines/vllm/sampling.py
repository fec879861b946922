"""vLLM's sampling requests for VLLMRollout.generate, and its outputs as colomem Completions."""

from __future__ import annotations

from typing import Any, Optional

from colomem.errors import ColomemError


def requests(prompt_ids: list, *, n: int, max_new_tokens: int, temperature: float, top_p: float,
             seed: Optional[int], stop_token_ids: Optional[list], ignore_eos: bool,
             logprobs: bool, top_k: Optional[int] = None, min_p: float = 0.0,
             repetition_penalty: float = 1.0) -> tuple[list, list]:
    """(SamplingParams per prompt, TokensPrompt per prompt); prompt i is seeded with seed + i * n (vLLM seeds
    completion j of a prompt seeded s with s + j, so every completion of the call has a seed of its own: with
    seed + i, completion j + 1 of prompt i and completion j of prompt i + 1 would draw the same noise). temperature 0
    is vLLM's greedy decoding; top_p is then 1 (no nucleus: the argmax token is always kept) and top_k and
    min_p are left out. top_k None and min_p 0 are left out too: vLLM's own defaults filter nothing. A
    repetition_penalty other than 1 goes with every request, greedy ones included (it moves the argmax)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra: dict[str, Any] = {}      # only what differs from vLLM's defaults
    if float(repetition_penalty) != 1.0:
        extra["repetition_penalty"] = float(repetition_penalty)
    if float(temperature) == 0.0:
        top_p = 1.0
    else:
        if top_k is not None:
            extra["top_k"] = int(top_k)
        if min_p:
            extra["min_p"] = float(min_p)

    params = [SamplingParams(n=int(n), max_tokens=int(max_new_tokens), temperature=float(temperature),
                             top_p=float(top_p), seed=None if seed is None else int(seed) + i * int(n),
                             logprobs=0 if logprobs else None, detokenize=False,
                             # the sampled tokens' logprobs as a few flat lists per completion instead of a
                             # dict and a Logprob object per token, built in this process at every decode step
                             flat_logprobs=bool(logprobs),
                             stop_token_ids=list(stop_token_ids) if stop_token_ids else None,
                             ignore_eos=bool(ignore_eos), **extra)
              for i in range(len(prompt_ids))]
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids]
    return params, prompts


def completions(outs: Any, logprobs: bool) -> list:
    """list[list[Completion]] from vLLM's RequestOutputs, each prompt's completions in index order."""
    from colomem.grpo.batch import Completion

    result = []
    for ro in outs:
        comps = []
        for c in sorted(ro.outputs, key=lambda c: c.index):
            finish = c.finish_reason
            if finish not in ("stop", "length"):
                raise ColomemError(f"vLLM ended a completion with finish_reason={finish!r} (aborted?)")
            ids = list(c.token_ids)
            comps.append(Completion(ids, _sampled_logprobs(c, ids) if logprobs else None, finish))
        result.append(comps)
    return result


def _sampled_logprobs(c: Any, ids: list) -> list:
    lps = c.logprobs
    if lps is None:
        return [float("nan")] * len(ids)
    if hasattr(lps, "start_indices"):  # FlatLogprobs
        out = []
        starts, ends, tokens, values = lps.start_indices, lps.end_indices, lps.token_ids, lps.logprobs
        for i, tok in enumerate(ids):
            if i >= len(starts):
                out.append(float("nan"))
                continue
            lo, hi = starts[i], ends[i]
            if lo < hi and tokens[lo] == tok:          # vLLM's sampler puts the sampled token first
                out.append(float(values[lo]))
                continue
            j = next((j for j in range(lo, hi) if tokens[j] == tok), None)
            out.append(float(values[j]) if j is not None else float("nan"))
        return out
    out = []
    for i, tok in enumerate(ids):
        pos = lps[i] if i < len(lps) else None
        lp = pos.get(tok) if pos else None
        out.append(float(lp.logprob) if lp is not None else float("nan"))
    return out


__all__ = ["completions", "requests"]
