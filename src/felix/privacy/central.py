"""The central Gaussian mechanism: the trusted server bounds each client's contribution to an
aggregation's sum and adds Gaussian noise to that sum before dividing by a fixed denominator.

Sensitivity by construction (add or remove one client): each update is clipped to ``clip_norm``
C in L2, scaled by its aggregator weight capped at 1, and the contributions of one client to one
aggregation (a late reply beside a fresh one) are summed and clipped to C again, so one client
moves the sum by at most C. The denominator is fixed (``orchestrator.agg_goal``: FedBuff's K, the
cohort a sync round waits for), never the number or the weights of the updates that arrived,
so the mean's sensitivity is C / K. Noise N(0, (sigma C)^2) per coordinate of the sum.

Pure numpy, so the sans-I/O core can hold it: ``Aggregator.aggregate`` calls
:meth:`CentralGaussian.noised_step` where it would form its weighted mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from felix.core.types import BufferedUpdate


class CentralGaussian:
    """Clip, sum with capped weights, add noise from ``rng``, divide by ``denominator``.

    ``rng`` is the noise source: a seeded generator in the simulator (reproducible runs,
    ``noise_source: seeded``); it is checkpointed with the aggregator's state.
    ``max_contribution_norm`` is the largest per-client contribution norm applied so far (at
    most C), reported in the summary as evidence of the clip bound."""

    def __init__(
        self, noise_multiplier: float, clip_norm: float, denominator: int, rng: np.random.Generator
    ) -> None:
        if not (noise_multiplier > 0 and clip_norm > 0 and denominator >= 1):
            raise ValueError("noise_multiplier and clip_norm must be > 0, denominator >= 1")
        self.noise_multiplier = float(noise_multiplier)
        self.clip_norm = float(clip_norm)
        self.denominator = int(denominator)
        self.rng = rng
        self.max_contribution_norm = 0.0

    @property
    def noise_std(self) -> float:
        """The std of the noise on each coordinate of the sum (sigma C)."""
        return self.noise_multiplier * self.clip_norm

    def noised_step(
        self, buffer: Sequence[BufferedUpdate], weights: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The noised mean update of ``buffer`` (float32) and each update's effective weight
        (capped weight / denominator)."""
        capped = np.minimum(np.asarray(weights, dtype=np.float64), 1.0)
        per_client: dict[int, np.ndarray] = {}
        for wi, item in zip(capped, buffer, strict=True):
            delta = item.update.delta
            assert delta is not None
            part = _clipped(np.asarray(delta, dtype=np.float64), self.clip_norm) * wi
            prev = per_client.get(item.client_id)
            per_client[item.client_id] = part if prev is None else prev + part
        size = int(buffer[0].update.delta.size) if buffer and buffer[0].update.delta is not None else 0
        total = np.zeros(size, dtype=np.float64)
        for part in per_client.values():
            part = _clipped(part, self.clip_norm)  # a client with two updates in one aggregation
            self.max_contribution_norm = max(self.max_contribution_norm, float(np.linalg.norm(part)))
            total += part
        total += self.rng.normal(0.0, self.noise_std, size)
        return (total / self.denominator).astype(np.float32), capped / self.denominator

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state, "max_contribution_norm": self.max_contribution_norm}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.max_contribution_norm = float(state["max_contribution_norm"])


def _clipped(v: np.ndarray, bound: float) -> np.ndarray:
    n = float(np.linalg.norm(v))
    return v * (bound / n) if n > bound else v


__all__ = ["CentralGaussian"]
