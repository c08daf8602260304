"""REFL's Staleness-Aware Aggregation (``ahmedcs/REFL`` ``core/aggregator.py``, ``stale_factor=-4``).

Fresh updates (staleness 0) keep importance 1. A stale update c, tau_c versions old, gets

    w_c = (1 - beta) / (tau_c + 1) + beta * (1 - exp(-r_c / max r) / scale_coff)
    r_c = ||u_c/(n+1) + W/(n+1) - W/n||^2 / ||W/n||^2

with W the sum of the n fresh updates: r_c is how far adding u_c would move the fresh average,
relative to that average. The first term damps by age (AdaSGD); the second *boosts* a stale
update the more it deviates from the fresh ones, since it then carries information the fresh
clients lack (REFL's argument). All weights are then normalised to sum to 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from felix.core.aggregation import AGGREGATORS, Aggregator
from felix.core.registry import params_from_dataclass
from felix.core.run_facts import RunFacts
from felix.core.types import BufferedUpdate


@dataclass(frozen=True, slots=True)
class ReflSAAParams:
    """``stale_beta`` 0.35 and ``scale_coff`` 10 are REFL's defaults (its ``run_exps.sh`` passes 1).

    ``sample_weighted``: REFL's code starts every update at importance 1.0 (an unweighted mean,
    as FedScale aggregates); ``True`` multiplies by the update's sample count instead, FedAvg's
    base weight, should a comparison want SAA on top of FedAvg weighting.
    """

    stale_beta: float = 0.35
    scale_coff: float = 10.0
    sample_weighted: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.stale_beta <= 1.0:
            raise ValueError(f"stale_beta must lie in [0, 1], not {self.stale_beta}")
        if self.scale_coff < 1:
            # Below 1 the deviation "boost" 1 - exp(-r)/scale_coff turns negative (REFL's own
            # adaptive scale_coff is floored at 1).
            raise ValueError(f"scale_coff must be >= 1, not {self.scale_coff}")


class ReflSAAAggregator(Aggregator):
    """REFL SAA. Weights depend on the whole buffer (the fresh sum W, max r), so ``weights``
    is overridden. Always normalised by the weight sum, as REFL normalises importances to 1.

    The formula is applied to model deltas (what our clients send); REFL applies it to full
    models. Because r_c enters only as r_c / max r, the common denominator ||W/n||^2 cancels
    and only ||u_c - W/n|| matters; deltas and models then differ by the drift of the global
    model between the stale update's base version and now, which REFL's form folds in.
    """

    name = "refl-saa"

    def __init__(
        self, params: ReflSAAParams | None = None, server_lr: float = 1.0, clip_norm: float | None = None
    ) -> None:
        super().__init__(server_lr=server_lr, normalize="weights", clip_norm=clip_norm)
        self.params = params if params is not None else ReflSAAParams()

    def weight(self, item: BufferedUpdate) -> float:
        raise TypeError("REFL SAA weighs an update against the whole buffer: call weights(buffer)")

    def deviations(self, buffer: Sequence[BufferedUpdate]) -> np.ndarray:
        """r_c / max r for each stale update (NaN for fresh ones).

        No fresh update (n = 0): W / n is undefined, so there is no reference to deviate from;
        every stale update then gets r_c / max r = 1, i.e. the same deviation boost, and age
        alone orders them. (REFL's code divides by zero there.) When ||W/n|| = 0 the ratio is
        formed from the numerators, which is the same quantity since the denominator cancels.
        """
        stale = np.array([b.staleness > 0 for b in buffer], dtype=bool)
        out = np.full(len(buffer), np.nan)
        fresh = [b.update.delta for b, s in zip(buffer, stale, strict=True) if not s]
        n = len(fresh)
        if not stale.any():
            return out
        if n == 0:
            out[stale] = 1.0
            return out
        w_sum = np.sum([np.asarray(d, dtype=np.float64) for d in fresh], axis=0)
        mean = w_sum / n
        den = float(mean @ mean)
        r = []
        for item in (b for b, s in zip(buffer, stale, strict=True) if s):
            u = np.asarray(item.update.delta, dtype=np.float64)
            diff = u / (n + 1) + w_sum / (n + 1) - mean
            num = float(diff @ diff)
            r.append(num / den if den > 0 else num)
        r_arr = np.array(r)
        r_max = float(r_arr.max())
        out[stale] = r_arr / r_max if r_max > 0 else 0.0
        return out

    def weights(self, buffer: Sequence[BufferedUpdate]) -> np.ndarray:
        p = self.params
        base = np.array(
            [float(b.update.num_samples) if p.sample_weighted else 1.0 for b in buffer], dtype=np.float64
        )
        rel = self.deviations(buffer)
        tau = np.array([b.staleness for b in buffer], dtype=np.float64)
        stale = tau > 0
        factor = np.ones(len(buffer))
        factor[stale] = (1.0 - p.stale_beta) / (tau[stale] + 1.0) + p.stale_beta * (
            1.0 - np.exp(-rel[stale]) / p.scale_coff
        )
        return base * factor


ReflSAAModel = params_from_dataclass(ReflSAAParams, "ReflSAAModel")


@AGGREGATORS.register("refl_saa", params=ReflSAAModel, reads_reports=False)  # norms of updates only
def _refl_saa(params: Any, ctx: RunFacts) -> ReflSAAAggregator:
    return ReflSAAAggregator(ReflSAAParams(**params.model_dump()), ctx.server_lr, ctx.clip_norm)
