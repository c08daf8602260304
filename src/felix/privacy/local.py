"""What a device does to its training update before the update leaves it, the same in both shells
(the simulator's devices and the MQTT client apply :meth:`LocalMechanism.release` to each result).

- Under ``local`` DP (threat model: an honest-but-curious server) the device clips its update and
  noises it: Gaussian noise N(0, (sigma C)^2) per coordinate after an L2 clip to C, or Laplace
  noise of scale sigma C after an L1 clip to C. One report's sensitivity is the clip ball's
  diameter 2C. The device counts its reports: beyond ``max_participations`` it sends noise alone
  (its update zeroed), so no more than that many reports use its data, whatever the server asks.
- Under the server's mechanisms (``central_gaussian``, ``dp_ftrl``) the device only clips (no
  noise, ``noise_multiplier`` None): the server clips again, so a device that skips it gains
  nothing. Under adaptive clipping the bound moves at the server, which alone clips.
- With ``privacy.reports`` every reply's loss and utility (a probe's included) become one noised,
  clipped number (:class:`ScalarNoise`), at most ``max_per_client`` of them from the client's data.

The noise comes from a generator per task: seeded by the run seed and the task id in the
simulator (reproducible), from the operating system's CSPRNG on a deployed device.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections import Counter
from dataclasses import dataclass

import numpy as np

from felix.core.types import ClientUpdate
from felix.privacy.central import l2

#: The device noise's stream id under the run seed (beside the server's, ``felix.privacy.setup``).
_DEVICE_STREAM = 0x4C4F43  # "LOC"


@dataclass(frozen=True)
class ScalarNoise:
    """A reply's loss and utility as one private number: the RMS loss r = utility / n clipped to
    [0, ``clip``] plus N(0, (``noise_multiplier`` clip)^2), floored at 0; the reply's utility is
    n r and its loss r (post-processing; n, the sample count, is what the client registered).
    One such number's sensitivity is ``clip`` (the range's width): a Gaussian mechanism of
    multiplier ``noise_multiplier``."""

    noise_multiplier: float
    clip: float
    max_per_client: int


class LocalMechanism:
    """Clip (L2 or, for Laplace, L1) to ``clip_norm`` (None: no clip) and, with a
    ``noise_multiplier``, noise; with ``scalars``, make the reply's loss and utility private."""

    def __init__(
        self,
        noise_multiplier: float | None,
        clip_norm: float | None,
        noise: str = "gaussian",
        max_participations: int | None = None,
        *,
        scalars: ScalarNoise | None = None,
        seed: int | None = None,
    ) -> None:
        if noise not in ("gaussian", "laplace"):
            raise ValueError(f"noise must be gaussian or laplace, not {noise!r}")
        self.noise_multiplier = noise_multiplier
        self.clip_norm = clip_norm
        self.noise = noise
        self.max_participations = max_participations
        self.scalars = scalars
        self.seed = seed
        self.reports: Counter[int] = Counter()  # noised updates sent, by client
        self.scalar_reports: Counter[int] = Counter()  # noised losses sent, by client

    @property
    def noise_source(self) -> str:
        return "os_csprng" if self.seed is None else "seeded"

    def _rng(self, task_id: int) -> np.random.Generator:
        """One reply's noise (the scalar's first, then the update's)."""
        if self.seed is None:
            return np.random.default_rng(secrets.randbits(128))
        return np.random.default_rng(np.random.SeedSequence([self.seed, _DEVICE_STREAM, task_id]))

    def clip(self, delta: np.ndarray) -> np.ndarray:
        """``delta`` within the clip ball (L1 for Laplace noise, else L2), float64."""
        v = np.asarray(delta, dtype=np.float64)
        if self.clip_norm is None:
            return v
        norm = float(np.abs(v).sum()) if self.noise == "laplace" else l2(v)
        return v * (self.clip_norm / norm) if norm > self.clip_norm else v

    def release(self, cid: int, task_id: int, update: ClientUpdate) -> ClientUpdate:
        """The reply as it leaves device ``cid``: its update (if any) clipped and noised, its
        loss and utility private under ``scalars``."""
        noised = self.scalars is not None or (self.noise_multiplier is not None and update.delta is not None)
        rng = self._rng(task_id) if noised else None
        if self.scalars is not None:
            assert rng is not None
            update = self._private_scalars(cid, update, self.scalars, rng)
        if update.delta is None:
            return update
        assert self.clip_norm is not None or self.noise_multiplier is None
        v = self.clip(update.delta)
        if self.noise_multiplier is not None and self.clip_norm is not None:
            self.reports[cid] += 1
            if self.max_participations is not None and self.reports[cid] > self.max_participations:
                v = np.zeros_like(v)  # beyond the cap: a report that uses none of the client's data
            scale = self.noise_multiplier * self.clip_norm
            assert rng is not None
            v = v + (
                rng.laplace(0.0, scale, v.size) if self.noise == "laplace" else rng.normal(0.0, scale, v.size)
            )
        return dataclasses.replace(update, delta=v.astype(np.float32))

    def _private_scalars(
        self, cid: int, update: ClientUpdate, sc: ScalarNoise, rng: np.random.Generator
    ) -> ClientUpdate:
        n = max(int(update.num_samples), 1)
        self.scalar_reports[cid] += 1
        rms = 0.0 if self.scalar_reports[cid] > sc.max_per_client else update.stat_utility / n
        rms = min(max(rms, 0.0), sc.clip) + float(rng.normal(0.0, sc.noise_multiplier * sc.clip))
        rms = max(rms, 0.0)
        return dataclasses.replace(update, stat_utility=n * rms, loss=rms)


__all__ = ["LocalMechanism", "ScalarNoise"]
