"""DP-FTRL by tree aggregation (Kairouz et al., ICML 2021) or by banded matrix factorisation
(:class:`BandedAggregation`).

Tree aggregation: the server releases, after every aggregation, the noised prefix sum of all
the clipped sums so far, each prefix noised from a binary tree of Gaussian nodes
(:mod:`felix.privacy.tree`). No sampling assumption is needed (nor by the banded factorisation):
the guarantee holds whoever the availability trace and the selector let in, so these are the
natural mechanisms under churn.

The aggregation's step is the difference of two consecutive noised prefix sums over the fixed
denominator K: g_t + n_t - n_(t-1), with g_t the clipped sum (as ``central_gaussian``: each
client moves it by at most C) and n_t the noise of prefix t. Under the plain server step the
model is then theta_0 + lr (noised prefix sum) / K, FTRL's iterate; a server optimiser acts on
those differences, which is post-processing of the released prefix sums.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from felix.core.types import BufferedUpdate
from felix.privacy.banded import BandedNoise
from felix.privacy.central import ClippedSum
from felix.privacy.tree import TreeNoise


class CorrelatedNoiseSum(ClippedSum):
    """The clipped sum of the DP-FTRL mechanisms, whose noise is correlated across aggregations
    (the tree's nodes, the banded factorisation's stream): each draws Gaussian noise of std
    sigma C per coordinate from ``rng``."""

    def __init__(
        self, noise_multiplier: float, clip_norm: float, denominator: int, rng: np.random.Generator
    ) -> None:
        if not noise_multiplier > 0:
            raise ValueError("noise_multiplier must be > 0")
        super().__init__(clip_norm, denominator)
        self.noise_multiplier = float(noise_multiplier)
        self.rng = rng

    @property
    def noise_std(self) -> float:
        """The std of each coordinate of a noise draw (sigma C)."""
        return self.noise_multiplier * self.clip_norm


class TreeAggregation(CorrelatedNoiseSum):
    """Clip, sum with capped weights, add the tree's prefix-noise difference, divide by K."""

    def __init__(
        self, noise_multiplier: float, clip_norm: float, denominator: int, rng: np.random.Generator
    ) -> None:
        super().__init__(noise_multiplier, clip_norm, denominator, rng)
        self._tree: TreeNoise | None = None  # made at the first aggregation, when the size is known
        self._last_noise: np.ndarray | None = None

    def noised_step(
        self, buffer: Sequence[BufferedUpdate], weights: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        total, capped, _ = self.clipped_sum(buffer, weights)
        rng = self.generator()
        if self._tree is None:
            self._tree = TreeNoise(total.size, self.noise_std, rng)
        self._tree.rng = rng
        noise = self._tree.advance()
        step = total + noise if self._last_noise is None else total + (noise - self._last_noise)
        self._last_noise = noise
        return (step / self.denominator).astype(np.float32), capped / self.denominator

    def state_dict(self) -> dict[str, Any]:
        return {
            "rng": self.rng_state(),
            "max_contribution_norm": self.max_contribution_norm,
            "tree": None if self._tree is None else self._tree.state_dict(),
            "last_noise": self._last_noise,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_rng_state(state["rng"])
        self.max_contribution_norm = float(state["max_contribution_norm"])
        self._last_noise = None if state["last_noise"] is None else np.asarray(state["last_noise"])
        if state["tree"] is None:
            self._tree = None
        else:
            assert self._last_noise is not None  # saved together with the tree
            self._tree = TreeNoise(self._last_noise.size, self.noise_std, self.rng)
            self._tree.load_state_dict(state["tree"])


class BandedAggregation(CorrelatedNoiseSum):
    """Clip, sum with capped weights, add the increment's correlated noise w_t = (C^-1 z)_t of the
    ``bands``-banded square-root factorisation (:mod:`felix.privacy.banded`), divide by K. The
    released prefix sums are A x + B z with B = A C^-1; a server optimiser acting on the steps is
    post-processing of them. The last ``bands - 1`` noise vectors are checkpointed with the
    generator, so a resumed run continues the same noise."""

    def __init__(
        self,
        noise_multiplier: float,
        clip_norm: float,
        denominator: int,
        bands: int,
        rng: np.random.Generator,
    ) -> None:
        super().__init__(noise_multiplier, clip_norm, denominator, rng)
        self.bands = int(bands)
        self._noise: BandedNoise | None = None  # made at the first aggregation, when the size is known

    def noised_step(
        self, buffer: Sequence[BufferedUpdate], weights: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        total, capped, _ = self.clipped_sum(buffer, weights)
        rng = self.generator()
        if self._noise is None:
            self._noise = BandedNoise(total.size, self.noise_std, self.bands, rng)
        self._noise.rng = rng
        step = total + self._noise.advance()
        return (step / self.denominator).astype(np.float32), capped / self.denominator

    def state_dict(self) -> dict[str, Any]:
        return {
            "rng": self.rng_state(),
            "max_contribution_norm": self.max_contribution_norm,
            "size": None if self._noise is None else self._noise.size,
            "noise": None if self._noise is None else self._noise.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_rng_state(state["rng"])
        self.max_contribution_norm = float(state["max_contribution_norm"])
        if state["noise"] is None:
            self._noise = None
        else:
            self._noise = BandedNoise(int(state["size"]), self.noise_std, self.bands, self.rng)
            self._noise.load_state_dict(state["noise"])


__all__ = ["BandedAggregation", "TreeAggregation"]
