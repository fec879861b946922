"""Group-normalised advantages, checked against values computed by hand."""
import math

import pytest
import torch

from colomem.errors import InvalidArgumentError
from colomem.grpo.advantages import group_advantages, group_stats


def test_hand_computed_group_of_four():
    # group {1, 0, 0, 1}: mean 0.5, population std 0.5 -> (r - 0.5) / (0.5 + eps)
    eps = 1e-4
    a = group_advantages([1.0, 0.0, 0.0, 1.0], 4, eps=eps)
    want = [0.5 / (0.5 + eps), -0.5 / (0.5 + eps), -0.5 / (0.5 + eps), 0.5 / (0.5 + eps)]
    assert a.tolist() == pytest.approx(want, abs=1e-7)


def test_uneven_group_values():
    # {3, 1, 2}: mean 2, population std sqrt(2/3)
    a = group_advantages([3.0, 1.0, 2.0], 3, eps=0.0)
    s = math.sqrt(2 / 3)
    assert a.tolist() == pytest.approx([1 / s, -1 / s, 0.0], abs=1e-6)


def test_groups_are_independent_and_in_row_order():
    a = group_advantages([1.0, 0.0, 10.0, 30.0], 2, eps=0.0)
    assert a.tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-6)


def test_all_equal_group_gives_exact_zero():
    a = group_advantages([0.7, 0.7, 0.7, 0.1, 0.3, 0.5], 3)
    assert a[:3].tolist() == [0.0, 0.0, 0.0]
    assert a[3:].abs().sum() > 0


def test_without_std_scaling_only_centres():
    a = group_advantages([1.0, 0.0, 0.0, 0.0], 4, scale_by_std=False)
    assert a.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_each_group_sums_to_zero():
    g = torch.Generator().manual_seed(0)
    r = torch.rand(8 * 5, generator=g)
    a = group_advantages(r, 8).view(5, 8)
    assert a.sum(dim=1).abs().max() < 1e-5


@pytest.mark.parametrize("rewards,n", [([1.0, 2.0, 3.0], 2), ([1.0], 0)])
def test_bad_group_size(rewards, n):
    with pytest.raises(InvalidArgumentError):
        group_advantages(rewards, n)


def test_non_finite_reward_refused():
    with pytest.raises(InvalidArgumentError, match="finite"):
        group_advantages([1.0, float("nan")], 2)


def test_group_stats():
    st = group_stats([1.0, 1.0, 0.0, 1.0], 2)
    assert st["reward_mean"] == pytest.approx(0.75)
    assert st["groups_no_signal"] == pytest.approx(0.5)
    assert st["reward_max"] == 1.0 and st["reward_min"] == 0.0


def test_sample_std_divides_by_n_minus_one():
    # {3, 1, 2}: mean 2, squared deviations 2; sample std sqrt(2 / 2) = 1 (TRL and verl), population sqrt(2/3)
    a = group_advantages([3.0, 1.0, 2.0], 3, eps=0.0, std="sample")
    assert a.tolist() == pytest.approx([1.0, -1.0, 0.0], abs=1e-6)
    # n = 2, {0, 1}: sample std sqrt(0.5) -> +-0.5 / (sqrt(0.5) + eps); population: +-0.5 / (0.5 + eps)
    eps = 1e-4
    s = group_advantages([0.0, 1.0], 2, eps=eps, std="sample")
    p = group_advantages([0.0, 1.0], 2, eps=eps)
    assert s.tolist() == pytest.approx([-0.5 / (math.sqrt(0.5) + eps), 0.5 / (math.sqrt(0.5) + eps)], abs=1e-6)
    assert float(p[1] / s[1]) == pytest.approx(math.sqrt(2), rel=1e-3)


def test_sample_std_with_unscorable_samples_counts_only_the_scored_ones():
    # scored {4, 0, 2} (the None is left out): mean 2, squared deviations 8, sample std sqrt(8 / 2) = 2
    a = group_advantages([4.0, 0.0, 99.0, 2.0], 4, eps=0.0, std="sample", scorable=[True, True, False, True])
    assert a.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-6)
    # one scored sample: no signal, no division by n - 1 = 0
    b = group_advantages([1.0, 5.0], 2, std="sample", scorable=[True, False])
    assert b.tolist() == [0.0, 0.0]


def test_unknown_std_refused():
    with pytest.raises(InvalidArgumentError, match="std"):
        group_advantages([1.0, 0.0], 2, std="biased")
