"""The decode diagnostic's round order (benchmarks/diag_decode.py): every condition takes every position once
over as many rounds as conditions, so a condition is not always the one after the same other's aftermath."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from diag_decode import CONDITIONS, rotated  # noqa: E402


def test_the_order_rotates_so_each_condition_takes_each_position_once():
    conds = list(CONDITIONS)
    orders = [rotated(conds, r) for r in range(len(conds))]
    assert orders[0] == conds and all(sorted(o) == sorted(conds) for o in orders)
    for pos in range(len(conds)):
        assert sorted(o[pos] for o in orders) == sorted(conds)
    assert rotated(conds, len(conds)) == conds
