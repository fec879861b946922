"""Which rows go into which micro-batch: a row count or a token budget, longest first, and as many
micro-batches as the ranks that step together need; the same gradient whatever the grouping."""
import pytest
import torch

from colomem.errors import InvalidArgumentError
from colomem.grpo.micro_batches import micro_batch_rows, padded_positions


def _lists(groups):
    return [g.tolist() for g in groups]


def test_rows_by_count_longest_first_or_in_order():
    lengths = torch.tensor([5, 40, 7, 38, 6, 41])
    assert _lists(micro_batch_rows(lengths, 2)) == [[5, 1], [3, 2], [4, 0]]
    assert _lists(micro_batch_rows(lengths, 2, by_length=False)) == [[0, 1], [2, 3], [4, 5]]
    assert padded_positions(lengths, micro_batch_rows(lengths, 2)) == 2 * 41 + 2 * 38 + 2 * 6
    assert padded_positions(lengths, micro_batch_rows(lengths, 2, by_length=False)) == 2 * (40 + 38 + 41)


def test_a_token_budget_puts_many_short_rows_or_few_long_ones_together():
    lengths = torch.tensor([10, 100, 12, 90, 11, 95, 9, 10])
    groups = micro_batch_rows(lengths, 1, max_tokens=200)      # micro_batch does not cap the rows then
    assert _lists(groups) == [[1, 5], [3, 2], [4, 0, 7, 6]]   # 2 x 100, 2 x 90, 4 x 11
    for g in groups:
        assert len(g) * int(lengths[g].max()) <= 200
    # a row longer than the budget goes alone rather than being refused
    assert _lists(micro_batch_rows(torch.tensor([300, 20, 20]), 4, max_tokens=100)) == [[0], [1, 2]]
    # every row in exactly one micro-batch
    assert sorted(torch.cat(groups).tolist()) == list(range(8))


def test_count_halves_the_largest_micro_batches_until_there_are_enough():
    lengths = torch.tensor([10, 100, 12, 90, 11, 95, 9, 10])
    groups = micro_batch_rows(lengths, 1, max_tokens=200, count=5)
    assert len(groups) == 5
    assert sorted(torch.cat(groups).tolist()) == list(range(8))
    assert all(len(g) * int(lengths[g].max()) <= 200 for g in groups)
    assert len(micro_batch_rows(lengths, 1, max_tokens=200, count=2)) == 3   # at least: never merged
    with pytest.raises(InvalidArgumentError, match="needs a row"):
        micro_batch_rows(lengths, 1, max_tokens=200, count=9)


def test_bad_sizes_are_refused():
    with pytest.raises(InvalidArgumentError, match="micro_batch must be >= 1"):
        micro_batch_rows(torch.tensor([3]), 0)
    with pytest.raises(InvalidArgumentError, match="micro_batch_tokens must be >= 1"):
        micro_batch_rows(torch.tensor([3]), 1, max_tokens=0)


def test_the_run_config_and_the_trainers_take_the_budget():
    from colomem.engines.deepspeed.config import DeepSpeedConfig
    from colomem.runner.config import load_run_config

    cfg = load_run_config(["--micro-batch-tokens", "4096"])
    assert cfg.micro_batch_tokens == 4096
    assert cfg.deepspeed_config(grad_accum=1).micro_batch_tokens == 4096
    with pytest.raises(InvalidArgumentError, match="micro_batch_tokens=0"):
        DeepSpeedConfig(micro_batch_tokens=0)
