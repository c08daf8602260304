"""DP-FTRL by tree aggregation (Kairouz et al., ICML 2021): the server releases, after every
aggregation, the noised prefix sum of all the clipped sums so far, each prefix noised from a
binary tree of Gaussian nodes (:mod:`felix.privacy.tree`). No sampling assumption is needed: the
guarantee holds whoever the availability trace and the selector let in, so this is the natural
mechanism under churn.

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
from felix.privacy.central import ClippedSum
from felix.privacy.tree import TreeNoise


class TreeAggregation(ClippedSum):
    """Clip, sum with capped weights, add the tree's prefix-noise difference, divide by K."""

    def __init__(
        self, noise_multiplier: float, clip_norm: float, denominator: int, rng: np.random.Generator
    ) -> None:
        if not noise_multiplier > 0:
            raise ValueError("noise_multiplier must be > 0")
        super().__init__(clip_norm, denominator)
        self.noise_multiplier = float(noise_multiplier)
        self.rng = rng
        self._tree: TreeNoise | None = None  # made at the first aggregation, when the size is known
        self._last_noise: np.ndarray | None = None

    @property
    def noise_std(self) -> float:
        """The std of each tree node's noise, per coordinate (sigma C)."""
        return self.noise_multiplier * self.clip_norm

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


__all__ = ["TreeAggregation"]
