"""Putting the ``privacy:`` section into a built run, the same for both shells: the server's
mechanism on the orchestrator's aggregator, the participation cap and (``banded_mf``) the
separation of a client's contributions on the orchestrator (they
share ``felix.engine.components.build_orchestrator``, which calls :func:`install`), and the
device's own mechanism for ``local`` (:func:`device_mechanism`, which both shells' devices apply
to each result before it leaves). A deployment turns the noise to the operating system's CSPRNG
(:func:`use_os_noise`, and ``device_mechanism(..., os_noise=True)``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from felix.core.separation import Separation
from felix.privacy.adaptive import AdaptiveClip
from felix.privacy.central import CentralGaussian, ClippedSum
from felix.privacy.config import count_noise
from felix.privacy.ftrl import BandedAggregation, TreeAggregation
from felix.privacy.local import LocalMechanism, ScalarNoise

#: The noise stream's id under the run seed, apart from the scenario and strategy streams, so
#: that turning privacy on changes no other random draw.
_NOISE_STREAM = 0x50524956  # "PRIV"


def noise_stream(seed: int) -> np.random.Generator:
    """The simulator's noise source: seeded, so a run is reproducible (``noise_source: seeded``)."""
    return np.random.default_rng(np.random.SeedSequence([seed, _NOISE_STREAM]))


def install(cfg: Any, orch: Any) -> None:
    """Attach the configured server mechanism (denominator ``orchestrator.agg_goal``), the cap
    and ``banded_mf``'s separation of a client's contributions; nothing when privacy is off. Under ``local`` the devices noise and the server adds
    nothing (what arrives is already private: any aggregation of it is post-processing)."""
    p = cfg.privacy
    orch.max_participations = p.max_participations
    if p.enabled and p.adaptive_clip is None:  # an adaptive clip norm moves: the server's clip holds it
        orch.validator.privacy_bound = private_norm_bound(p, int(orch.weights.size))
    k = cfg.orchestrator.agg_goal
    rng = noise_stream(cfg.seed)
    if p.mechanism == "central_gaussian":
        adaptive = None
        if p.adaptive_clip is not None:
            a = p.adaptive_clip
            adaptive = AdaptiveClip(a.target_quantile, a.learning_rate, count_noise(p, k), k)
        orch.aggregator.privacy = CentralGaussian(p.noise_multiplier, p.clip_norm, k, rng, adaptive)
    elif p.mechanism == "dp_ftrl":
        orch.aggregator.privacy = TreeAggregation(p.noise_multiplier, p.clip_norm, k, rng)
    elif p.mechanism == "banded_mf":
        orch.aggregator.privacy = BandedAggregation(p.noise_multiplier, p.clip_norm, k, p.bands, rng)
        orch.separation = Separation(p.bands)


def private_norm_bound(p: Any, size: int) -> float:
    """The largest norm a private update of ``size`` coordinates may have when it reaches the
    server, which re-checks it (``UpdateValidator.privacy_bound``): the clip norm (with float32
    rounding) and, under ``local``, a tail bound of the device's noise that an honest report does
    not reach in practice (Gaussian: ||N(0, s^2 I)|| <= s (sqrt(d) + 10) but with probability
    e^-50; Laplace of scale s: ||.||^2 has mean 2 s^2 d and std s^2 sqrt(20 d), so 3 s^2 d + 100 s^2
    is over 7 of its stds above the mean for a model of 1,000 parameters or more)."""
    bound = p.clip_norm * (1 + 1e-5)
    if p.mechanism == "local":
        s = p.noise_multiplier * p.clip_norm
        spread = math.sqrt(3 * size + 100) if p.local_noise == "laplace" else math.sqrt(size) + 10
        bound += s * spread
    return bound


def use_os_noise(orch: Any, controller: Any) -> None:
    """A deployment's server: the mechanism's noise from the OS's CSPRNG, not the run seed, and
    the summary says so (under ``local`` the devices' noise is theirs: a deployed device draws it
    from its own OS, ``device_mechanism(..., os_noise=True)``)."""
    mechanism = getattr(orch.aggregator, "privacy", None)
    mechanism = getattr(mechanism, "dp", mechanism)  # under secure aggregation's sum (SecureSum.dp)
    if isinstance(mechanism, ClippedSum):
        mechanism.os_noise = True
    if controller.privacy is not None:
        controller.privacy.noise_source = "os_csprng"


def device_mechanism(cfg: Any, *, os_noise: bool = False) -> LocalMechanism | None:
    """What each device applies to its update (None with privacy off): clip and noise under
    ``local`` (seeded per task from the run seed in the simulator, from the OS's CSPRNG on a
    deployed device), clip alone under the server's mechanisms with a fixed clip norm (an adaptive
    one moves at the server, which clips); with ``privacy.reports``, the reply's loss and utility
    made private."""
    p = cfg.privacy
    if not p.enabled:
        return None
    r = p.reports
    return LocalMechanism(
        p.noise_multiplier if p.mechanism == "local" else None,
        None if p.adaptive_clip is not None else p.clip_norm,
        p.local_noise,
        p.max_participations,
        scalars=None if r is None else ScalarNoise(r.noise_multiplier, r.clip, r.max_per_client),
        seed=None if os_noise else cfg.seed,
    )


__all__ = ["device_mechanism", "install", "noise_stream", "use_os_noise"]
