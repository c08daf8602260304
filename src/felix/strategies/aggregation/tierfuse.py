"""TierFuse (FeLiX §3.4): weight each buffered update by its staleness and its utility.

    w = sigma * alpha(T) + (1 - sigma) * beta(L)
    alpha(T) = 1 / (1 + T)^a                     decreasing in the staleness T (versions)
    beta(L)  = min(1.5 - 1 / (1 + L)^b, 1)       increasing in the utility L, saturating
    theta <- theta + eta * sum(w_i u_i) / sum(w_i)

Staleness alone cannot tell a delayed-but-informative update (high loss on the current model's
weak spots) from an obsolete one; the utility term rescues the former while ``alpha`` still
damps very old updates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from felix.core.aggregation import AGGREGATORS, Aggregator
from felix.core.registry import params_from_dataclass
from felix.core.run_facts import RunFacts
from felix.core.types import BufferedUpdate


@dataclass(frozen=True, slots=True)
class TierFuseParams:
    """TierFuse's knobs; defaults sigma 0.4, a 0.25, b 0.1 are the paper's and the authors'.

    ``utility``: the L of beta(L). ``"stat_utility"`` (default) is what the FeLiX authors' code
    feeds in, Oort's statistical utility |D| x sqrt(mean squared loss) of the update; ``"loss"``
    is the paper's text, the client's local loss. They differ in scale: |D| makes the utility
    large (hundreds), so beta is near its cap for most updates, while a loss of 0.5-3 keeps
    beta in its sensitive range.

    ``cap_beta``: the paper's min(., 1); the authors' code omits it (beta up to 1.5).

    ``utility_scale``: ``"absolute"`` (default, the paper and the authors) feeds L as measured;
    ``"buffer_mean"`` divides each L by the mean L of the buffer being aggregated, so that beta
    sees how much more (or less) informative an update is than its peers rather than the absolute
    size of Oort's |D|-scaled utility, which saturates beta (weight CV 0.055, issue 12). Pair it
    with a larger ``b`` (and ``cap_beta: false``) for beta to separate clients around L = 1.

    ``freshness``: on streaming data (``stream:``), ``"data_age"`` multiplies each weight by
    2^(-age / ``age_half_life_s``), where age is how old the newest sample behind the update was
    when the update arrived (``ClientUpdate.data_span``): of two equally stale updates, the one
    trained on the more recent data counts more when the class mix moves. ``"none"`` (default)
    is the paper's TierFuse; an update without a data span (no stream) keeps its weight.

    ``t_max``: the paper's safeguard, "updates older than T_max are clipped or dropped". We drop
    them: their weight is 0, so they neither move the model nor count in the normaliser. (Clamping
    T at T_max would instead *raise* their weight, the opposite of a safeguard.) ``None``: off,
    as in the authors' code.
    """

    sigma: float = 0.4
    a: float = 0.25
    b: float = 0.1
    cap_beta: bool = True
    utility: Literal["stat_utility", "loss"] = "stat_utility"
    t_max: int | None = None
    utility_scale: Literal["absolute", "buffer_mean"] = "absolute"
    freshness: Literal["none", "data_age"] = "none"
    age_half_life_s: float = 3600.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.sigma <= 1.0:
            raise ValueError(f"sigma must lie in [0, 1], not {self.sigma}")
        if self.a < 0 or self.b < 0:
            raise ValueError(f"a and b must be >= 0, not a={self.a}, b={self.b}")
        if self.utility not in ("stat_utility", "loss"):
            raise ValueError(f"utility must be 'stat_utility' or 'loss', not {self.utility!r}")
        if self.utility_scale not in ("absolute", "buffer_mean"):
            raise ValueError(f"utility_scale must be 'absolute' or 'buffer_mean', not {self.utility_scale!r}")
        if self.freshness not in ("none", "data_age"):
            raise ValueError(f"freshness must be 'none' or 'data_age', not {self.freshness!r}")
        if not self.age_half_life_s > 0:
            raise ValueError(f"age_half_life_s must be > 0 seconds, not {self.age_half_life_s}")
        if self.t_max is not None and self.t_max < 0:
            raise ValueError(f"t_max must be >= 0 versions, or None, not {self.t_max}")


def staleness_decay(t: float, a: float) -> float:
    """alpha(T) = 1 / (1 + T)^a."""
    return 1.0 / (1.0 + t) ** a


def utility_gain(loss: float, b: float, cap: bool = True) -> float:
    """beta(L) = 1.5 - 1 / (1 + L)^b, capped at 1 when ``cap``.

    Defined for L >= 0 (a loss or a utility); a negative value is read as 0, since (1 + L)^b is
    undefined below L = -1 and "less than no loss" carries no extra signal.
    """
    g = 1.5 - 1.0 / (1.0 + max(loss, 0.0)) ** b
    return min(g, 1.0) if cap else g


def data_age_decay(age_s: float, half_life_s: float) -> float:
    """2^(-age / half-life): the freshness factor of ``freshness: data_age`` (age 0 or less: 1)."""
    return 2.0 ** (-max(age_s, 0.0) / half_life_s)


class TierFuseAggregator(Aggregator):
    """TierFuse weights on the base buffer arithmetic.

    ``normalize="weights"`` (default) is the paper's sum(w_i u_i) / sum(w_i); ``"count"`` is the
    authors' code, sum(w_i u_i) / aggGoal. ``server_lr`` 0.3 is the authors' CIFAR-10 setting.
    ``clip_norm`` clips each update's L2 norm before weighting (the paper's optional safeguard).
    """

    name = "tierfuse"

    def __init__(
        self,
        params: TierFuseParams | None = None,
        server_lr: float = 0.3,
        normalize: str = "weights",
        clip_norm: float | None = None,
    ) -> None:
        super().__init__(server_lr=server_lr, normalize=normalize, clip_norm=clip_norm)
        if clip_norm is not None and clip_norm <= 0:
            raise ValueError(f"clip_norm must be > 0 or None, not {clip_norm}")
        self.params = params if params is not None else TierFuseParams()

    def weight(self, item: BufferedUpdate, utility_mean: float = 1.0) -> float:
        """One update's w; ``utility_mean`` divides L under ``utility_scale="buffer_mean"``."""
        p = self.params
        if p.t_max is not None and item.staleness > p.t_max:
            return 0.0
        utility = float(getattr(item.update, p.utility))
        if p.utility_scale == "buffer_mean":
            utility = utility / utility_mean if utility_mean > 0 else 1.0
        w = p.sigma * staleness_decay(item.staleness, p.a) + (1.0 - p.sigma) * utility_gain(
            utility, p.b, p.cap_beta
        )
        span = item.update.data_span
        if p.freshness == "data_age" and span is not None:
            w *= data_age_decay(item.arrived_at - span[1], p.age_half_life_s)
        return w

    def weights(self, buffer: Sequence[BufferedUpdate]) -> np.ndarray:
        """The weights of one buffer; under ``"buffer_mean"`` L is relative to the buffer's mean
        (over the non-negative utilities, as beta reads a negative one as 0)."""
        p = self.params
        mean = 1.0
        if p.utility_scale == "buffer_mean" and buffer:
            mean = float(np.mean([max(float(getattr(b.update, p.utility)), 0.0) for b in buffer]))
        return np.array([self.weight(b, mean) for b in buffer], dtype=np.float64)

    def aggregate(
        self, theta: np.ndarray, buffer: Sequence[BufferedUpdate]
    ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """As the base, except that a buffer whose updates all exceed ``t_max`` leaves the model
        unchanged (the base would refuse a zero weight sum); the version still advances."""
        if buffer and not self.weights(buffer).any():
            return theta.copy(), np.zeros(len(buffer)), {}
        return super().aggregate(theta, buffer)


TierFuseModel = params_from_dataclass(TierFuseParams, "TierFuseModel")


@AGGREGATORS.register(
    "tierfuse", params=TierFuseModel, reads_reports=lambda p: p.sigma < 1.0
)  # beta(L) weighs a reported loss or utility unless sigma is 1
def _tierfuse(params: Any, ctx: RunFacts) -> TierFuseAggregator:
    return TierFuseAggregator(
        TierFuseParams(**params.model_dump()), ctx.server_lr, ctx.normalize, ctx.clip_norm
    )
