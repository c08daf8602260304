"""The ``privacy:`` config section and the cross-section rules it imposes on the aggregator.

Kept here, apart from ``felix.config``, so that the mechanisms, the accountant and their settings
grow in one package; the root config holds one field of this type and calls
:func:`check_privacy` once the whole tree is read.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: Mechanisms the issue names that are not built yet; refused at config read.
NOT_BUILT = ("dp_ftrl", "local")

#: Aggregators whose weighted sum the central mechanism forms (the base class's sum, weights
#: capped at 1); the others take their own step (q-FFL), reweight by data (REFL's SAA) or are
#: custom, so their sensitivity is not bounded by construction.
BOUNDED_AGGREGATORS = ("fedavg", "fedbuff", "tierfuse")


class PrivacyCfg(BaseModel):
    """User-level differential privacy (docs/privacy.md). ``mechanism: none`` (the default) leaves
    a run exactly as without this section.

    Strict as ``felix.config.base.StrictModel`` (unknown keys, non-finite numbers refused) without
    importing it: ``felix.config`` imports this module, so this one cannot import that package."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    mechanism: str = Field(
        "none",
        description="none | central_gaussian: the trusted server clips each client's update to "
        "clip_norm and adds Gaussian noise to each aggregation's sum (dp_ftrl and local are not built yet)",
    )
    noise_multiplier: float = Field(1.0, description="sigma: the noise std is sigma x clip_norm on the sum")
    clip_norm: float = Field(1.0, description="C: the L2 bound on each client's update in one aggregation")
    delta: float = Field(1e-5, description="the delta at which epsilon is reported")
    target_epsilon: float | None = Field(
        None, gt=0, description="stop the run before an aggregation would spend more than this (null: never)"
    )
    max_participations: int | None = Field(
        None, ge=1, description="a client is never selected again once it has contributed this many updates"
    )
    accountant: Literal["rdp", "pld"] = Field(
        "rdp", description="rdp: Renyi DP composition (dp-accounting); pld is not built yet"
    )

    @property
    def enabled(self) -> bool:
        return self.mechanism != "none"

    @field_validator("mechanism")
    @classmethod
    def _mechanism(cls, v: str) -> str:
        if v in NOT_BUILT:
            raise ValueError(f"mechanism {v!r} is not built yet: use central_gaussian (or none)")
        if v not in ("none", "central_gaussian"):
            raise ValueError(f"mechanism must be none or central_gaussian, not {v!r}")
        return v

    @field_validator("noise_multiplier", "clip_norm")
    @classmethod
    def _positive(cls, v: float) -> float:
        if not v > 0:
            raise ValueError(f"must be > 0, not {v}")
        return v

    @field_validator("delta")
    @classmethod
    def _delta(cls, v: float) -> float:
        if not 0 < v < 1:
            raise ValueError(f"must lie strictly between 0 and 1, not {v}")
        return v

    @field_validator("accountant")
    @classmethod
    def _accountant(cls, v: str) -> str:
        if v == "pld":
            raise ValueError("accountant 'pld' is not built yet: use rdp")
        return v


def check_privacy(cfg: Any) -> None:
    """Refuse (``ValueError``, one line naming the alternative) a run whose aggregation has no
    bounded sensitivity under the mechanism: a data-dependent denominator, a robust statistic, an
    aggregator other than the weighted sum, or aux state sent by the clients (SCAFFOLD's control
    variates, FedeRage's beta), which would leave the server un-noised."""
    p, a = cfg.privacy, cfg.aggregator
    if not p.enabled:
        return
    if a.name not in BOUNDED_AGGREGATORS:
        raise ValueError(
            f"privacy: aggregator {a.name!r} has no bounded sensitivity: use "
            + ", ".join(BOUNDED_AGGREGATORS)
        )
    if a.normalize != "count":
        raise ValueError(
            "privacy: aggregator.normalize 'weights' divides by a data-dependent sum: "
            "set aggregator.normalize: count (a fixed denominator, orchestrator.agg_goal)"
        )
    if a.robust != "none":
        raise ValueError(
            f"privacy: aggregator.robust {a.robust!r} has no bounded sensitivity: set robust: none"
        )
    from felix.strategies.objectives.base import objective_class

    if objective_class(cfg.client.objective).declared_aux(1):
        raise ValueError(
            f"privacy: client.objective {cfg.client.objective!r} sends aux state that would leave "
            "the server without noise: use an objective without aux (ce, fedprox)"
        )
