"""Putting the ``secure_aggregation:`` section into a built run: the secure sum on the
orchestrator's aggregator, the same for both shells (``felix.engine.components.build_orchestrator``
calls :func:`install`, after the privacy section's ``install``); nothing when the section is off,
so such runs are unchanged."""

from __future__ import annotations

from typing import Any

import numpy as np

from felix.privacy.central import CentralGaussian
from felix.secagg.aggregate import SecureSum

#: The group-order stream's id under the run seed, apart from the other streams, so that turning
#: secure aggregation on changes no other random draw.
_GROUP_STREAM = 0x53454341  # "SECA"


def install(cfg: Any, orch: Any) -> None:
    s = cfg.secure_aggregation
    if s.enabled:
        rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, _GROUP_STREAM]))
        dp = orch.aggregator.privacy  # the central mechanism, when privacy is on: it noises the unmasked sum
        assert dp is None or isinstance(dp, CentralGaussian)
        orch.aggregator.privacy = SecureSum(s, cfg.aggregator.normalize, orch, rng, dp)


__all__ = ["install"]
