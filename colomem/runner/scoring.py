"""The score phase of a step: rewards, group advantages, this rank's batch and the step's statistics."""
from __future__ import annotations

import math
import threading
from typing import Any, Callable

from colomem.errors import ColomemError

from .phases import PhaseTimeoutError


def run_bounded(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """fn() on a daemon thread; its result or its exception, or PhaseTimeoutError after timeout_s (the thread
    is left behind: the run stops, and a daemon thread does not keep the process alive)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            box["error"] = e

    t = threading.Thread(target=target, name="colomem-score", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise PhaseTimeoutError(f"{what} ran past phase_timeout_s={timeout_s:g} s; a reward function hangs (a "
                                "remote verifier that does not answer?): bound its own waits, or raise "
                                "--phase-timeout-s if it is just slow")
    if "error" in box:
        raise box["error"]
    return box["value"]


def encode(tokenizer, text: str) -> list[int]:
    """Prompt text -> token ids, as the rollout sees them (no special tokens added)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def score_step(cfg, tokenizer, ranks, reward_specs, metric_specs, samples, gen_idx, train_idx, completions):
    """Rewards for the generated groups, advantages per group, this rank's batch, global statistics.

    Returns (batch, stats, shown): this rank's GRPOBatch, metrics summed over every rank (the train groups
    partition all groups), and the completions rank 0 prints."""
    from colomem.grpo.advantages import group_advantages
    from colomem.grpo.batch import build_batch
    from colomem.grpo.rewards import compute_rewards, score

    n = cfg.grpo.group_size
    if len(completions) != len(gen_idx) or any(len(g) != n for g in completions):
        raise ColomemError(f"the rollout returned {len(completions)} groups (sizes "
                           f"{sorted({len(g) for g in completions})}) for {len(gen_idx)} prompts x n={n}")
    pos = {g: j for j, g in enumerate(gen_idx)}
    mine = list(train_idx)
    prompts, texts, metas, comps = [], [], [], []
    for i in mine:
        for c in completions[pos[i]]:
            prompts.append(samples[i].prompt)
            texts.append(tokenizer.decode(c.token_ids, skip_special_tokens=True))
            metas.append(samples[i].meta)
            comps.append(c)
    scored, parts = compute_rewards(reward_specs, prompts, texts, metas)
    scorable = [r is not None for r in scored]            # None: no reward function could score it
    rewards = [r if r is not None else 0.0 for r in scored]
    extras = {}
    for name, spec in metric_specs:
        extras[name] = score(spec, prompts, texts, metas)
    adv = group_advantages(rewards, n, scale_by_std=cfg.grpo.scale_rewards, eps=cfg.grpo.adv_eps,
                           scorable=scorable, std=cfg.grpo.std)
    groups = [completions[pos[i]] for i in mine]
    batch = build_batch([encode(tokenizer, samples[i].prompt) for i in mine], groups, adv,
                        pad_id=tokenizer.pad_token_id, mask_truncated=cfg.grpo.mask_truncated,
                        rewards=rewards)
    # global statistics: sums over ranks (train groups partition all groups); rewards over scorable samples
    flat = [r for r in rewards]
    lens = [len(c.token_ids) for c in comps]
    trunc = [1.0 if c.truncated else 0.0 for c in comps]
    sc = [1.0 if s else 0.0 for s in scorable]
    groups_r = [[r for r, s in zip(flat[j:j + n], scorable[j:j + n]) if s] for j in range(0, len(flat), n)]
    no_signal = sum(1.0 for grp in groups_r if len(grp) < 2 or max(grp) == min(grp))
    vec = [len(flat), sum(flat), sum(r * r for r in flat), sum(lens), sum(trunc), len(groups_r), no_signal,
           sum(sc)]
    names_p = sorted(parts)
    names_e = sorted(extras)
    vec += [sum(v or 0.0 for v in parts[p]) for p in names_p] + [sum(v or 0.0 for v in extras[e]) for e in names_e]
    tot = ranks.sum(vec)
    cnt = max(tot[0], 1.0)
    scored_cnt = max(tot[7], 1.0)
    mean = tot[1] / scored_cnt
    stats = {"reward_mean": mean, "reward_std": math.sqrt(max(tot[2] / scored_cnt - mean * mean, 0.0)),
             "completion_len_mean": tot[3] / cnt, "truncated_frac": tot[4] / cnt,
             "groups_no_signal": tot[6] / max(tot[5], 1.0), "samples_total": int(tot[0]),
             "unscorable_frac": 1.0 - tot[7] / cnt}
    for j, p in enumerate(names_p):
        stats[f"reward/{p}"] = tot[8 + j] / cnt
    for j, e in enumerate(names_e):
        stats[e] = tot[8 + len(names_p) + j] / cnt
    shown = []
    if cfg.log_samples and ranks.is_main:
        for j in range(0, min(len(texts), cfg.log_samples * n), n):
            shown.append({"prompt": prompts[j], "completion": texts[j], "reward": rewards[j],
                          "answer": metas[j].get("answer")})
    return batch, stats, shown

