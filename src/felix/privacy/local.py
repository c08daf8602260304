"""What a device does to its training update before the update leaves it, the same in both shells
(the simulator's devices and the MQTT client apply :meth:`LocalMechanism.release` to each result).

- Under ``local`` DP (threat model: an honest-but-curious server) the device clips its update and
  noises it: Gaussian noise N(0, (sigma C)^2) per coordinate after an L2 clip to C, or Laplace
  noise of scale sigma C after an L1 clip to C. One report's sensitivity is the clip ball's
  diameter 2C. The device counts its reports: beyond ``max_participations`` it sends noise alone
  (its update zeroed), so no more than that many reports use its data, whatever the server asks.
- Under the server's mechanisms (``central_gaussian``, ``dp_ftrl``) the device only clips (no
  noise, ``noise_multiplier`` None): the server clips again, so a device that skips it gains
  nothing.

The noise comes from a generator per task: seeded by the run seed and the task id in the
simulator (reproducible), from the operating system's CSPRNG on a deployed device.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections import Counter

import numpy as np

from felix.core.types import ClientUpdate

#: The device noise's stream id under the run seed (beside the server's, ``felix.privacy.setup``).
_DEVICE_STREAM = 0x4C4F43  # "LOC"


class LocalMechanism:
    """Clip (L2 or, for Laplace, L1) to ``clip_norm`` and, with a ``noise_multiplier``, noise."""

    def __init__(
        self,
        noise_multiplier: float | None,
        clip_norm: float,
        noise: str = "gaussian",
        max_participations: int | None = None,
        *,
        seed: int | None = None,
    ) -> None:
        if noise not in ("gaussian", "laplace"):
            raise ValueError(f"noise must be gaussian or laplace, not {noise!r}")
        self.noise_multiplier = noise_multiplier
        self.clip_norm = float(clip_norm)
        self.noise = noise
        self.max_participations = max_participations
        self.seed = seed
        self.reports: Counter[int] = Counter()  # noised reports sent, by client

    @property
    def noise_source(self) -> str:
        return "os_csprng" if self.seed is None else "seeded"

    def _rng(self, task_id: int) -> np.random.Generator:
        if self.seed is None:
            return np.random.default_rng(secrets.randbits(128))
        return np.random.default_rng(np.random.SeedSequence([self.seed, _DEVICE_STREAM, task_id]))

    def clip(self, delta: np.ndarray) -> np.ndarray:
        """``delta`` within the clip ball (L1 for Laplace noise, else L2), float64."""
        v = np.asarray(delta, dtype=np.float64)
        norm = float(np.abs(v).sum()) if self.noise == "laplace" else float(np.linalg.norm(v))
        return v * (self.clip_norm / norm) if norm > self.clip_norm else v

    def release(self, cid: int, task_id: int, update: ClientUpdate) -> ClientUpdate:
        """The update as it leaves device ``cid`` (an eval's reply, with no delta, is unchanged)."""
        if update.delta is None:
            return update
        v = self.clip(update.delta)
        if self.noise_multiplier is not None:
            self.reports[cid] += 1
            if self.max_participations is not None and self.reports[cid] > self.max_participations:
                v = np.zeros_like(v)  # beyond the cap: a report that uses none of the client's data
            scale = self.noise_multiplier * self.clip_norm
            rng = self._rng(task_id)
            v = v + (
                rng.laplace(0.0, scale, v.size) if self.noise == "laplace" else rng.normal(0.0, scale, v.size)
            )
        return dataclasses.replace(update, delta=v.astype(np.float32))


__all__ = ["LocalMechanism"]
