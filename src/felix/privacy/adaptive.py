"""Adaptive clipping (Andrew et al., NeurIPS 2021, "Differentially private learning with adaptive
clipping"): the clip norm follows a target quantile of the clients' update norms, estimated from a
noised count so that the estimate is private too.

At each aggregation, every client in it contributes a bit b_i = 1 if its update's norm is at most
the current clip norm C. The server releases the noised centred count
sum_i (b_i - 1/2) + N(0, sigma_b^2) (one client moves it by at most 1/2), estimates the fraction
below C as that over the fixed denominator K plus 1/2, and moves C geometrically:
C <- C exp(-eta (fraction - gamma)).

Accounting (their Theorem 1): the update sum with multiplier z_delta and the count with multiplier
2 sigma_b are together one Gaussian mechanism of multiplier
z = (z_delta^-2 + (2 sigma_b)^-2)^(-1/2). The configured ``noise_multiplier`` is that z; the
update noise is z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2), which needs 2 sigma_b > z.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


def update_noise_multiplier(noise_multiplier: float, count_noise: float) -> float:
    """z_delta: the multiplier left to the update sum when the count takes its share of z."""
    rest = noise_multiplier**-2 - (2.0 * count_noise) ** -2
    if rest <= 0:
        raise ValueError(
            f"adaptive_clip.count_noise {count_noise:g} must exceed noise_multiplier / 2 "
            f"({noise_multiplier / 2:g})"
        )
    return rest**-0.5


@dataclass(frozen=True)
class AdaptiveClip:
    """The quantile tracker: ``target_quantile`` gamma, ``learning_rate`` eta, the count's noise
    std ``count_noise`` sigma_b, the fixed denominator ``denominator`` K."""

    target_quantile: float
    learning_rate: float
    count_noise: float
    denominator: int

    def update_noise_multiplier(self, noise_multiplier: float) -> float:
        return update_noise_multiplier(noise_multiplier, self.count_noise)

    def next_clip(self, clip_norm: float, norms: Iterable[float], rng: np.random.Generator) -> float:
        """The clip norm for the next aggregation, from this one's clients' update norms."""
        centred = sum((1.0 if n <= clip_norm else 0.0) - 0.5 for n in norms)
        fraction = (centred + rng.normal(0.0, self.count_noise)) / self.denominator + 0.5
        return clip_norm * math.exp(-self.learning_rate * (fraction - self.target_quantile))


__all__ = ["AdaptiveClip", "update_noise_multiplier"]
