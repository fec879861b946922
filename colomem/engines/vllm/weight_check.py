"""What VLLMRollout.check() compares vLLM's parameters against, and the comparison.

Per worker rank, the checksums of a spread sample of parameters (checks.py: the same numbers on both sides),
recorded at each sync (the trainer's bytes for the names vLLM holds unfused, the worker's own right after the
copies for the rest) or taken before a sleep that keeps the weights. check() asks each worker for the same
names now; any difference is a WeightCheckError. The rollout's guards (phase, weights discarded by a sleep)
stay in rollout.py.
"""

from __future__ import annotations

from typing import Iterable, Optional

from colomem.errors import InvalidArgumentError, WeightCheckError

from .checks import same_layout, tensor_checksum
from .engine_calls import EngineCalls


class WeightCheck:
    """The checksums check() must find (`expected`, per worker rank, and where they came from: `source`)."""

    def __init__(self, calls: EngineCalls):
        self._calls = calls
        self.expected: list = []     # per worker rank: {vLLM param name: checksum check() must find}
        self.source = "start"
        self._param_info: Optional[dict] = None

    def direct_names(self) -> dict:
        """vLLM parameter names that equal an HF name with the same shape (checkable against the trainer)."""
        if self._param_info is None:
            self._param_info = self._calls.rpc("colomem_param_info")[0]
        return self._param_info

    @property
    def recorded(self) -> bool:
        """Whether a sync or a snapshot left anything to compare against."""
        return any(self.expected)

    def forget(self) -> None:
        """The weights were discarded (or are about to be rewritten): nothing they must match any more."""
        self.expected = []

    def record_sync(self, sampled: dict, snapshots: list, version: int) -> None:
        """After a sync: the trainer's checksums (`sampled`) over each worker's snapshot of its own."""
        self.expected = [{**snap, **sampled} for snap in snapshots] or [dict(sampled)]
        self.source = f"version {version}"

    def snapshot(self, why: str, sample: int) -> None:
        """Records checksums of a spread sample of vLLM's parameters (per worker) for check() to find again."""
        self.expected = [r["checksums"] for r in self._calls.rpc("colomem_param_checksums", None, sample)]
        self.source = why

    def check(self, reference: Optional[Iterable] = None) -> None:
        """Compares the workers' checksums now with the recorded ones, or with `reference`'s (HF (name, tensor)
        pairs, for the names vLLM holds unfused). Raises WeightCheckError on any difference."""
        if reference is not None:
            info = self.direct_names()
            expected = {n: tensor_checksum(t) for n, t in reference if same_layout(t, info.get(n))}
            if not expected:
                raise InvalidArgumentError("no reference tensor matches a vLLM parameter's name, shape and dtype")
            source = "the reference tensors"
            per_rank = None
        else:
            per_rank, source = [dict(e) for e in self.expected], self.source
            if not any(per_rank):
                return
            expected = per_rank[0]
        names = sorted(set().union(*per_rank) if per_rank else expected)
        for rank, got in enumerate(self._calls.rpc("colomem_param_checksums", names, 0)):
            want = per_rank[rank] if per_rank and rank < len(per_rank) else expected
            bad = [n for n, c in got["checksums"].items() if n in want and c != want[n]]
            if bad:
                raise WeightCheckError(
                    f"{len(bad)} of {len(want)} sampled vLLM parameters on worker {rank} differ from {source} "
                    f"(e.g. {bad[:3]}); the weights are not what they must be: sync them again "
                    f"(load_weights) before generating")


__all__ = ["WeightCheck"]
