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

import math
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from felix.core.types import BufferedUpdate
from felix.privacy.adaptive import AdaptiveClip


class ClippedSum:
    """Each client's contribution to one aggregation, clipped, and the noise source: the parts the
    server's mechanisms share.

    ``clip_norm`` may move between aggregations (adaptive clipping); ``max_contribution_norm``
    is the largest per-client contribution norm applied so far (at most the clip norm of its
    aggregation), reported in the summary as evidence of the clip bound. ``rng`` is the seeded
    noise source; ``os_noise`` (set by a deployment) replaces it by the OS's CSPRNG."""

    rng: np.random.Generator
    os_noise: bool = False

    def __init__(self, clip_norm: float, denominator: int) -> None:
        if not (clip_norm > 0 and denominator >= 1):
            raise ValueError("clip_norm must be > 0, denominator >= 1")
        self.clip_norm = float(clip_norm)
        self.denominator = int(denominator)
        self.max_contribution_norm = 0.0

    def generator(self) -> np.random.Generator:
        """This aggregation's noise source: the mechanism's ``rng``, or under ``os_noise`` a
        generator seeded afresh from the operating system's CSPRNG (a deployment), whose state is
        never kept, so no checkpoint can replay the noise."""
        if self.os_noise:
            self.rng = np.random.default_rng(secrets.randbits(128))
        return self.rng

    @property
    def noise_source(self) -> str:
        """What ``summary.json`` says of the noise: ``seeded`` (reproducible, a simulation) or
        ``os_csprng`` (a deployment)."""
        return "os_csprng" if self.os_noise else "seeded"

    def rng_state(self) -> Mapping[str, Any] | None:
        """The generator's state for a checkpoint (None under ``os_noise``: nothing to replay)."""
        return None if self.os_noise else self.rng.bit_generator.state

    def load_rng_state(self, state: Mapping[str, Any] | None) -> None:
        if state is not None and not self.os_noise:
            self.rng.bit_generator.state = state

    def clipped_sum(
        self, buffer: Sequence[BufferedUpdate], weights: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, dict[int, float]]:
        """The sum of the clients' clipped contributions (float64), each update's capped weight,
        and each client's largest raw update norm (for adaptive clipping's count)."""
        capped = np.minimum(np.asarray(weights, dtype=np.float64), 1.0)
        # client -> (its summed contribution, that sum's norm when it is one update's, else None)
        per_client: dict[int, tuple[np.ndarray, float | None]] = {}
        raw_norm: dict[int, float] = {}
        for wi, item in zip(capped, buffer, strict=True):
            delta = item.update.delta
            assert delta is not None
            vec = np.asarray(delta, dtype=np.float64)
            norm = l2(vec)
            raw_norm[item.client_id] = max(raw_norm.get(item.client_id, 0.0), norm)
            part = clipped(vec, self.clip_norm, norm) * wi
            prev = per_client.get(item.client_id)
            per_client[item.client_id] = (
                (part, min(norm, self.clip_norm) * wi) if prev is None else (prev[0] + part, None)
            )
        size = int(buffer[0].update.delta.size) if buffer and buffer[0].update.delta is not None else 0
        total = np.zeros(size, dtype=np.float64)
        for part, known in per_client.values():
            if known is None:  # a client with two updates in one aggregation: its sum clipped again
                summed = l2(part)
                part = clipped(part, self.clip_norm, summed)
                known = min(summed, self.clip_norm)
            self.max_contribution_norm = max(self.max_contribution_norm, known)
            total += part
        return total, capped, raw_norm


class CentralGaussian(ClippedSum):
    """Clip, sum with capped weights, add noise from ``rng``, divide by ``denominator``.

    ``rng`` is the noise source: a seeded generator in the simulator (reproducible runs,
    ``noise_source: seeded``, checkpointed with the aggregator's state), the operating system's
    CSPRNG in a deployment (``os_noise``). With ``adaptive`` (Andrew et al. 2021), the clip norm follows a
    noised quantile of the clients' update norms, and the update noise is the share of
    ``noise_multiplier`` the count leaves (:mod:`felix.privacy.adaptive`)."""

    def __init__(
        self,
        noise_multiplier: float,
        clip_norm: float,
        denominator: int,
        rng: np.random.Generator,
        adaptive: AdaptiveClip | None = None,
    ) -> None:
        if not noise_multiplier > 0:
            raise ValueError("noise_multiplier must be > 0")
        super().__init__(clip_norm, denominator)
        self.noise_multiplier = float(noise_multiplier)
        self.rng = rng
        self.adaptive = adaptive

    @property
    def update_noise_multiplier(self) -> float:
        """The multiplier of the noise on the updates' sum (sigma, less the count's share)."""
        if self.adaptive is None:
            return self.noise_multiplier
        return self.adaptive.update_noise_multiplier(self.noise_multiplier)

    @property
    def noise_std(self) -> float:
        """The std of the noise on each coordinate of the sum (sigma C at the current C)."""
        return self.update_noise_multiplier * self.clip_norm

    def noised_step(
        self, buffer: Sequence[BufferedUpdate], weights: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The noised mean update of ``buffer`` (float32) and each update's effective weight
        (capped weight / denominator)."""
        total, capped, raw_norm = self.clipped_sum(buffer, weights)
        rng = self.generator()
        total += rng.normal(0.0, self.noise_std, total.size)
        if self.adaptive is not None:
            self.clip_norm = self.adaptive.next_clip(self.clip_norm, raw_norm.values(), rng)
        return (total / self.denominator).astype(np.float32), capped / self.denominator

    def state_dict(self) -> dict[str, Any]:
        return {
            "rng": self.rng_state(),
            "max_contribution_norm": self.max_contribution_norm,
            "clip_norm": self.clip_norm,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_rng_state(state["rng"])
        self.max_contribution_norm = float(state["max_contribution_norm"])
        self.clip_norm = float(state.get("clip_norm", self.clip_norm))


def l2(v: np.ndarray) -> float:
    """The L2 norm of a float64 vector by a plain sum of squares: numpy's float64 ``dot`` (which
    ``np.linalg.norm`` calls) goes through BLAS, whose threads cost a hundred times more here when
    torch's own threads share the cores."""
    return math.sqrt(float(np.square(v).sum()))


def clipped(v: np.ndarray, bound: float, norm: float | None = None) -> np.ndarray:
    """``v`` scaled down to L2 norm ``bound`` if longer (``norm``: its norm, if known)."""
    n = l2(v) if norm is None else norm
    return v * (bound / n) if n > bound else v


__all__ = ["CentralGaussian", "ClippedSum", "clipped", "l2"]
