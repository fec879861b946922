"""Rewards for the count-chat example, in TRL's batched signature (a TRL reward file works unchanged).

    --rewards examples/chat/rewards.py:digits_in_place
"""


def digits_in_place(prompts, completions, answer, **kwargs):
    """Partial credit: the share of the answer's digits the completion has in the right place, extra
    characters counted as wrong, so only the exact answer scores 1. A row without an answer is not
    scorable (None)."""
    scores = []
    for completion, gold in zip(completions, answer):
        if not gold:
            scores.append(None)
            continue
        got = completion.strip()
        hits = sum(a == b for a, b in zip(got, gold))
        scores.append(hits / max(len(got), len(gold)))
    return scores
