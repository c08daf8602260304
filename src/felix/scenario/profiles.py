"""Per-client training runtimes: the system heterogeneity of the emulated population.

``RUNTIMES`` is the runtime-profile registry: a profile is
``profile(cfg: RuntimeCfg, num_clients: int, rng: np.random.Generator, sizes: list[int] | None)
-> np.ndarray`` of per-client task seconds, ``rng`` the scenario's runtime stream and ``sizes`` the
clients' sample counts (None where the caller has none). A config names it ``runtime.kind: NAME``
or ``package.module:profile``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from felix.config import ConfigError
from felix.core.registry import CallShape, Registry

if TYPE_CHECKING:
    from felix.config import RuntimeCfg

# The FeLiX authors' profile: half-normal whose median is 10 s of a 60 s spread
# (scale = 60 / (2 sqrt(2 ln 2)) / sqrt(pi) ~ 14.38 s), rounded up, 1 s draws dropped.
FELIX_HALFNORMAL_SCALE = 60.0 / (2.0 * math.sqrt(2.0 * math.log(2.0))) / math.sqrt(math.pi)


def halfnormal_runtimes(
    n: int, rng: np.random.Generator, scale: float = FELIX_HALFNORMAL_SCALE, min_s: float = 2.0
) -> np.ndarray:
    out = np.empty(n)
    filled = 0
    while filled < n:
        draw = np.ceil(np.abs(rng.normal(0.0, scale, size=2 * (n - filled) + 8)))
        draw = draw[draw >= min_s][: n - filled]
        out[filled : filled + len(draw)] = draw
        filled += len(draw)
    return out


def uniform_runtimes(n: int, rng: np.random.Generator, low: float, high: float) -> np.ndarray:
    if not 0 < low <= high:
        raise ValueError("uniform runtimes need 0 < low <= high")
    return rng.uniform(low, high, size=n)


RuntimeProfile = Callable[..., np.ndarray]
RUNTIMES: Registry[RuntimeProfile] = Registry(
    "runtime profile",
    key="runtime.kind",
    call=CallShape(
        "runtime profile(cfg: RuntimeCfg, num_clients: int, rng: np.random.Generator, "
        "sizes: list[int] | None) -> np.ndarray",
        None,
        passed=4,
    ),
)


def make_runtimes(
    cfg: RuntimeCfg, num_clients: int, rng: np.random.Generator, sizes: list[int] | None
) -> np.ndarray:
    """The configured profile's per-client runtimes, checked: one finite, non-negative float per client."""
    out = np.asarray(RUNTIMES.resolve(cfg.kind)(cfg, num_clients, rng, sizes), dtype=np.float64)
    if out.shape != (num_clients,) or not (np.isfinite(out).all() and (out >= 0).all()):
        raise RUNTIMES.wrong(cfg.kind, f"gave {out.shape} runtimes, not {num_clients} finite seconds >= 0")
    return out


@RUNTIMES.register("halfnormal")
def _halfnormal(
    cfg: RuntimeCfg, num_clients: int, rng: np.random.Generator, sizes: list[int] | None
) -> np.ndarray:
    return halfnormal_runtimes(num_clients, rng, cfg.scale_s or FELIX_HALFNORMAL_SCALE, cfg.min_s)


@RUNTIMES.register("constant")
def _constant(
    cfg: RuntimeCfg, num_clients: int, rng: np.random.Generator, sizes: list[int] | None
) -> np.ndarray:
    return np.full(num_clients, cfg.constant_s)


@RUNTIMES.register("uniform")
def _uniform(
    cfg: RuntimeCfg, num_clients: int, rng: np.random.Generator, sizes: list[int] | None
) -> np.ndarray:
    return uniform_runtimes(num_clients, rng, cfg.low_s, cfg.high_s)


@RUNTIMES.register("per_sample")
def _per_sample(
    cfg: RuntimeCfg, num_clients: int, rng: np.random.Generator, sizes: list[int] | None
) -> np.ndarray:
    if sizes is None:
        raise ConfigError("runtime.kind 'per_sample' needs the clients' sample counts")
    return cfg.seconds_per_sample * np.asarray(sizes, dtype=np.float64)
