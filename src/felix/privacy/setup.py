"""Putting the ``privacy:`` section into a built run: the mechanism on the orchestrator's
aggregator and the participation cap on the orchestrator, the same for both shells (they share
``felix.engine.components.build_orchestrator``, which calls :func:`install`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from felix.privacy.central import CentralGaussian

#: The noise stream's id under the run seed, apart from the scenario and strategy streams, so
#: that turning privacy on changes no other random draw.
_NOISE_STREAM = 0x50524956  # "PRIV"


def noise_stream(seed: int) -> np.random.Generator:
    """The simulator's noise source: seeded, so a run is reproducible (``noise_source: seeded``)."""
    return np.random.default_rng(np.random.SeedSequence([seed, _NOISE_STREAM]))


def install(cfg: Any, orch: Any) -> None:
    """Attach the configured mechanism (denominator ``orchestrator.agg_goal``) and the cap;
    nothing when privacy is off."""
    p = cfg.privacy
    orch.max_participations = p.max_participations
    if p.mechanism == "central_gaussian":
        orch.aggregator.privacy = CentralGaussian(
            p.noise_multiplier, p.clip_norm, cfg.orchestrator.agg_goal, noise_stream(cfg.seed)
        )


__all__ = ["install", "noise_stream"]
