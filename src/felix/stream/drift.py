"""The class mix over time: a global mix with abrupt surges and gradual rotations, and each
client's own interest blended into it (``stream.drift``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from felix.config import ConfigError, DriftCfg


@dataclass(frozen=True)
class Shift:
    """A moment the global mix changes abruptly (a surge starts or ends) or starts to rotate."""

    at_s: float
    kind: str  # "surge", "surge_end" or "rotate"


class GlobalMix:
    """g(t): class weights that fall geometrically (``imbalance``) over a seeded class order,
    rotated by ``rotate`` shifts (the order moves by one class every ``period_s``, interpolated,
    so the mix changes continuously) and multiplied by ``surge`` factors while a surge lasts.

    ``present``: the classes the training pool holds; the others get weight 0."""

    def __init__(
        self, cfg: DriftCfg, num_classes: int, rng: np.random.Generator, present: np.ndarray
    ) -> None:
        c = num_classes
        check_classes(cfg, c)
        order = rng.permutation(c)
        self.rank = np.empty(c, dtype=np.int64)
        self.rank[order] = np.arange(c)
        self.by_rank = cfg.imbalance ** (-np.arange(c) / max(c - 1, 1))
        self.present = np.asarray(present, dtype=bool)
        self.num_classes = c
        self.surges = [
            (
                s.at_s,
                np.inf if s.duration_s is None else s.at_s + s.duration_s,
                np.asarray(s.classes),
                s.factor,
            )
            for s in cfg.shifts
            if s.kind == "surge"
        ]
        self.rotations = [
            (s.at_s, s.period_s, np.inf if s.steps is None else s.steps)
            for s in cfg.shifts
            if s.kind == "rotate"
        ]

    def shifts(self) -> list[Shift]:
        """The abrupt changes and rotation starts, in time order (the recovery measure's shifts)."""
        out = [Shift(a, "surge") for a, _, _, _ in self.surges]
        out += [Shift(e, "surge_end") for _, e, _, _ in self.surges if np.isfinite(e)]
        out += [Shift(a, "rotate") for a, _, _ in self.rotations]
        return sorted(out, key=lambda s: s.at_s)

    def at(self, t: np.ndarray | float) -> np.ndarray:
        """The normalised mix at each time of ``t``: shape (len(t), C) (or (C,) for a scalar)."""
        ts = np.atleast_1d(np.asarray(t, dtype=np.float64))
        c = self.num_classes
        shift = np.zeros(len(ts))
        for at, period, steps in self.rotations:
            shift += np.clip((ts - at) / period, 0.0, steps)
        k = np.floor(shift).astype(np.int64)
        f = (shift - k)[:, None]
        pos = self.rank[None, :] + k[:, None]
        w = (1.0 - f) * self.by_rank[pos % c] + f * self.by_rank[(pos + 1) % c]
        for at, end, classes, factor in self.surges:
            on = (ts >= at) & (ts < end)
            if on.any():
                w[np.ix_(on, classes)] *= factor
        w = w * self.present[None, :]
        w /= w.sum(axis=1, keepdims=True)
        return w[0] if np.ndim(t) == 0 else w


def check_classes(cfg: DriftCfg, num_classes: int) -> None:
    """A ``ConfigError`` naming the shift whose classes the dataset does not have."""
    for i, s in enumerate(cfg.shifts):
        bad = [c for c in s.classes if c >= num_classes]
        if bad:
            raise ConfigError(
                f"stream.drift.shifts[{i}].classes: class {bad[0]} is not one of the dataset's "
                f"{num_classes} classes (0..{num_classes - 1})"
            )
