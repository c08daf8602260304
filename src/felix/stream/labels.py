"""Label delays (``stream.labels``): when each sample's true label becomes known, and the proxy
label a client may train on before it."""

from __future__ import annotations

import math

import numpy as np

from felix.config import LabelCfg


def lomax_scale(median_s: float, shape: float) -> float:
    """The Lomax (Pareto II) scale whose median is ``median_s``: median = scale (2^(1/shape) - 1)."""
    return median_s / (2.0 ** (1.0 / shape) - 1.0)


def draw_delays(cfg: LabelCfg, rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` label delays in seconds from the configured distribution, all with median ``median_s``.
    (Draws nothing for ``none`` and ``constant``, so those streams use no random numbers here.)"""
    if cfg.delay == "none":
        return np.zeros(n)
    if cfg.delay == "constant":
        return np.full(n, cfg.median_s)
    if cfg.delay == "exponential":
        return rng.exponential(cfg.median_s / math.log(2.0), n)
    if cfg.delay == "lognormal":
        return cfg.median_s * np.exp(cfg.sigma * rng.standard_normal(n))
    return lomax_scale(cfg.median_s, cfg.shape) * rng.pareto(cfg.shape, n)


def mean_delay(cfg: LabelCfg) -> float:
    """The distribution's mean (finite: the config refuses a Pareto shape <= 1)."""
    if cfg.delay == "none":
        return 0.0
    if cfg.delay == "constant":
        return cfg.median_s
    if cfg.delay == "exponential":
        return cfg.median_s / math.log(2.0)
    if cfg.delay == "lognormal":
        return cfg.median_s * math.exp(cfg.sigma**2 / 2.0)
    return lomax_scale(cfg.median_s, cfg.shape) / (cfg.shape - 1.0)
