"""Epsilon of a run's aggregations, by Google's ``dp-accounting`` library (extra ``privacy``).

Composition WITHOUT amplification by sampling: under churn, who trains is decided by
availability (the trace, TierTrack, Oort's utilities), not by a uniform draw at a fixed rate,
so the premise of privacy amplification by sampling does not hold and every aggregation counts
as a full mechanism on every client (docs/privacy.md).

What one run releases, as a ``dp-accounting`` event (:func:`run_event`):

- ``central_gaussian``: T Gaussian mechanisms of noise multiplier sigma (adaptive clipping's
  noised count included: its share is taken off the update noise so that the pair is one
  Gaussian mechanism of multiplier sigma, :mod:`felix.privacy.adaptive`);
- ``dp_ftrl``: the tree's nodes, each noised with sigma C, as one Gaussian mechanism on a vector
  whose L2 sensitivity is C sqrt(S), S from :func:`felix.privacy.tree.sensitivity_sq` (Kairouz et
  al. 2021, appendix D; a client in at most m of the T aggregations);
- ``banded_mf``: one Gaussian mechanism C x + z, z of std sigma C per coordinate, whose
  sensitivity is C sqrt(k) times the largest column norm of the banded factor over the T
  aggregations, k = min(m, ceil(T / b)) the aggregations a client can reach b apart
  (:func:`felix.privacy.banded.sensitivity`);
- ``local``: each client's own reports that use its data, at most ``max_participations`` of them
  (the device enforces it), each a Gaussian (or Laplace) mechanism whose sensitivity is the
  diameter 2C of the clip ball; the whole run's guarantee from the first aggregation on;
- with ``privacy.reports``, composed with the above: each client's at most ``max_per_client``
  noised losses (probes and training replies), each a Gaussian mechanism of the reports'
  multiplier (:class:`felix.privacy.local.ScalarNoise`), from the start of the run.

Cheap per aggregation: an aggregation only counts; epsilon is composed by the library when it is
read (an evaluation row, the summary), once per distinct event (per count; for ``dp_ftrl``, per
tree depth), and the stop at ``target_epsilon``
compares the count with the largest count within the target, found once before the run
(``felix.privacy.budget``).
"""

from __future__ import annotations

import math
from typing import Any

from felix.config.base import ConfigError
from felix.privacy.banded import sensitivity
from felix.privacy.tree import sensitivity_sq

#: PLD's value discretisation: coarser than the library's default (1e-4), which costs ten times
#: more for an epsilon that differs in the seventh digit; a coarser grid only over-reports.
PLD_DISCRETIZATION = 1e-3


def library() -> Any:
    """The ``dp_accounting`` module, or a one-line refusal naming the extra."""
    try:
        import dp_accounting
    except ImportError:
        raise ConfigError(
            "privacy needs the dp-accounting library (extra felix-fl[privacy]): pip install 'felix-fl[privacy]'"
        ) from None
    return dp_accounting


def run_event(
    mechanism: str,
    noise_multiplier: float,
    steps: int,
    *,
    max_participations: int | None = None,
    noise: str = "gaussian",
    bands: int | None = None,
) -> Any:
    """The ``dp-accounting`` event of ``steps`` aggregations of ``mechanism``."""
    dp = library()
    if mechanism == "central_gaussian":
        return dp.SelfComposedDpEvent(dp.GaussianDpEvent(noise_multiplier), steps)
    if mechanism == "dp_ftrl":
        m = steps if max_participations is None else min(max_participations, steps)
        return dp.GaussianDpEvent(noise_multiplier / math.sqrt(sensitivity_sq(m, steps)))
    if mechanism == "banded_mf":
        assert bands is not None, "banded_mf's sensitivity depends on its bands"
        return dp.GaussianDpEvent(noise_multiplier / sensitivity(steps, bands, max_participations))
    if mechanism == "local":
        assert max_participations is not None, "local DP composes each client's capped reports"
        # the clip ball's diameter 2C is the sensitivity of one report: half the multiplier
        one = (dp.LaplaceDpEvent if noise == "laplace" else dp.GaussianDpEvent)(noise_multiplier / 2)
        return dp.SelfComposedDpEvent(one, max_participations)
    raise ValueError(f"no accounting for mechanism {mechanism!r}")


class Accountant:
    """Epsilon at ``delta`` after ``steps`` aggregations of the configured mechanism, by the RDP
    or the PLD accountant of ``dp-accounting``."""

    def __init__(
        self,
        mechanism: str,
        noise_multiplier: float,
        delta: float,
        *,
        kind: str = "rdp",
        max_participations: int | None = None,
        noise: str = "gaussian",
        reports: tuple[float, int] | None = None,
        bands: int | None = None,
    ) -> None:
        self._dp = library()
        if kind not in ("rdp", "pld"):
            raise ValueError(f"accountant must be rdp or pld, not {kind!r}")
        self.name = kind
        self.mechanism = mechanism
        self.noise_multiplier = float(noise_multiplier)
        self.delta = float(delta)
        self.max_participations = max_participations
        self.noise = noise
        self.reports = reports  # (noise multiplier, reports per client) of the private losses
        self.bands = bands
        self.steps = 0
        self._cached: tuple[int, float] = (0, 0.0)
        # epsilon by event: dp_ftrl's event changes only when the tree deepens (or the cap binds),
        # so a run composes it about log2 T times, not T; banded_mf's, until the run outgrows
        # the bands and then once every b aggregations until the cap binds
        self._by_event: dict[str, float] = {}

    def step(self) -> None:
        """Account one more aggregation (a count: epsilon is composed when read)."""
        self.steps += 1

    def with_noise(self, noise_multiplier: float) -> Accountant:
        """The same accounting at another noise multiplier (to name the noise a target needs)."""
        return Accountant(
            self.mechanism,
            noise_multiplier,
            self.delta,
            kind=self.name,
            max_participations=self.max_participations,
            noise=self.noise,
            reports=self.reports,
            bands=self.bands,
        )

    def epsilon_after(self, steps: int) -> float:
        """Epsilon after ``steps`` aggregations in all, composed at once by the library."""
        events = []
        if steps > 0:
            events.append(
                run_event(
                    self.mechanism,
                    self.noise_multiplier,
                    steps,
                    max_participations=self.max_participations,
                    noise=self.noise,
                    bands=self.bands,
                )
            )
        if self.reports is not None:
            sigma, count = self.reports
            events.append(self._dp.SelfComposedDpEvent(self._dp.GaussianDpEvent(sigma), count))
        if not events:
            return 0.0
        event = events[0] if len(events) == 1 else self._dp.ComposedDpEvent(events)
        key = repr(event)  # attrs' repr names every field; a composition holds a list (unhashable)
        known = self._by_event.get(key)
        if known is not None:
            return known
        if self.name == "pld":
            acc = self._dp.pld.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
        else:
            acc = self._dp.rdp.RdpAccountant()
        acc.compose(event)
        self._by_event[key] = eps = float(acc.get_epsilon(self.delta))
        return eps

    @property
    def epsilon(self) -> float:
        """Epsilon after the aggregations so far (computed once per count)."""
        if self._cached[0] != self.steps:
            self._cached = (self.steps, self.epsilon_after(self.steps))
        return self._cached[1]


__all__ = ["Accountant", "library", "run_event"]
