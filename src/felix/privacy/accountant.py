"""Epsilon of a run's aggregations, by Google's ``dp-accounting`` library (extra ``privacy``).

Composition WITHOUT amplification by sampling: under churn, who trains is decided by
availability (the trace, TierTrack, Oort's utilities), not by a uniform draw at a fixed rate,
so the premise of privacy amplification by sampling does not hold and every aggregation counts
as a full Gaussian mechanism on every client (docs/privacy.md).

Cheap per aggregation: an aggregation only counts; epsilon is composed by the library when it is
read (an evaluation row, the summary), once per count and at the same cost for any count (the
self-composition of T Gaussian mechanisms is one RDP curve times T), and the stop at
``target_epsilon`` compares the count with the largest count within the target, found once
before the run (``felix.privacy.budget``).
"""

from __future__ import annotations

from typing import Any

from felix.config.base import ConfigError


def _library() -> Any:
    try:
        import dp_accounting
    except ImportError:
        raise ConfigError(
            "privacy needs the dp-accounting library (extra felix-fl[privacy]): pip install 'felix-fl[privacy]'"
        ) from None
    return dp_accounting


class RdpAccountant:
    """Epsilon at ``delta`` after ``steps`` Gaussian mechanisms of noise multiplier ``sigma``."""

    name = "rdp"

    def __init__(self, noise_multiplier: float, delta: float) -> None:
        self._dp = _library()
        self.noise_multiplier = float(noise_multiplier)
        self.delta = float(delta)
        self.steps = 0
        self._event = self._dp.GaussianDpEvent(self.noise_multiplier)
        self._cached: tuple[int, float] = (0, 0.0)

    def step(self) -> None:
        """Account one more aggregation (a count: epsilon is composed when read)."""
        self.steps += 1

    def epsilon_after(self, steps: int) -> float:
        """Epsilon after ``steps`` aggregations in all: the library composes the ``steps``
        mechanisms at once (RDP adds up), at the same cost for any ``steps``."""
        if steps == 0:
            return 0.0
        acc = self._dp.rdp.RdpAccountant()
        acc.compose(self._dp.SelfComposedDpEvent(self._event, steps))
        return float(acc.get_epsilon(self.delta))

    @property
    def epsilon(self) -> float:
        """Epsilon after the aggregations so far (computed once per count)."""
        if self._cached[0] != self.steps:
            self._cached = (self.steps, self.epsilon_after(self.steps))
        return self._cached[1]


__all__ = ["RdpAccountant"]
