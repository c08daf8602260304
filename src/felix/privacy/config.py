"""The ``privacy:`` config section and the cross-section rules it imposes on the aggregator.

Kept here, apart from ``felix.config``, so that the mechanisms, the accountant and their settings
grow in one package; the root config holds one field of this type and calls
:func:`check_privacy` once the whole tree is read.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: The mechanisms: the trusted server's (central, tree, banded matrix factorisation) and the
#: device's own (local).
MECHANISMS = ("none", "central_gaussian", "dp_ftrl", "banded_mf", "local")

#: Aggregators whose weighted sum the central mechanism forms (the base class's sum, weights
#: capped at 1); the others take their own step (q-FFL), reweight by data (REFL's SAA) or are
#: custom, so their sensitivity is not bounded by construction.
BOUNDED_AGGREGATORS = ("fedavg", "fedbuff", "tierfuse")


class AdaptiveClipCfg(BaseModel):
    """Adaptive clipping (Andrew et al. 2021, ``felix.privacy.adaptive``) for ``central_gaussian``."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    target_quantile: float = Field(0.5, gt=0, lt=1, description="gamma: the share of updates left unclipped")
    learning_rate: float = Field(0.2, gt=0, description="eta: the geometric step of the clip norm")
    count_noise: float | None = Field(
        None,
        gt=0,
        description="sigma_b: the std of the noise on the count of unclipped updates "
        "(null: orchestrator.agg_goal / 20, the paper's choice); must exceed noise_multiplier / 2",
    )


class ReportsCfg(BaseModel):
    """The scalars a client reports beside its update (``felix.privacy.local.ScalarNoise``): the
    loss and statistical utility of TierSelect's probes (eval tasks) and of training replies,
    which steer selection and TierFuse's weights. Each reply releases one number, the client's
    RMS loss clipped to [0, ``clip``] plus N(0, (``noise_multiplier`` x clip)^2); its loss and
    utility are computed from it. A device sends at most ``max_per_client`` such numbers from its
    data (noise alone beyond), and the run's epsilon composes them."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    noise_multiplier: float = Field(
        ..., gt=0, description="the noise std on each reported RMS loss, in units of clip"
    )
    clip: float = Field(10.0, gt=0, description="the bound on a reported RMS loss (cross-entropy per sample)")
    max_per_client: int = Field(
        ..., ge=1, description="reports (probes and training replies) that use a client's data"
    )


class PrivacyCfg(BaseModel):
    """User-level differential privacy (docs/privacy.md). ``mechanism: none`` (the default) leaves
    a run exactly as without this section.

    Strict as ``felix.config.base.StrictModel`` (unknown keys, non-finite numbers refused) without
    importing it: ``felix.config`` imports this module, so this one cannot import that package."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    mechanism: str = Field(
        "none",
        description="none | central_gaussian: the trusted server clips each client's update to "
        "clip_norm and adds Gaussian noise to each aggregation's sum | dp_ftrl: the same sums, "
        "noised by tree aggregation (no sampling assumption) | banded_mf: the same sums, noised by "
        "a banded matrix factorisation (set bands) | local: each client clips and noises its own "
        "update before it leaves the device",
    )
    bands: int | None = Field(
        None,
        ge=1,
        description="banded_mf: the bands b of the factor C; a client's contributions fall at least "
        "b aggregations apart (b = 1: independent noise on every aggregation)",
    )
    local_noise: Literal["gaussian", "laplace"] = Field(
        "gaussian",
        description="local: Gaussian noise (L2 clip) or Laplace noise (L1 clip), of scale noise_multiplier x clip_norm",
    )
    reports: ReportsCfg | None = Field(
        None,
        description="clip, noise and account the losses and utilities clients report (probes "
        "included); required with an eval selector",
    )
    adaptive_clip: AdaptiveClipCfg | None = Field(
        None, description="central_gaussian: the clip norm follows a noised quantile of the update norms"
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
        "rdp", description="rdp: Renyi DP composition | pld: privacy loss distributions (both dp-accounting)"
    )

    @property
    def enabled(self) -> bool:
        return self.mechanism != "none"

    @field_validator("mechanism")
    @classmethod
    def _mechanism(cls, v: str) -> str:
        if v not in MECHANISMS:
            raise ValueError(f"mechanism must be one of {', '.join(MECHANISMS)}, not {v!r}")
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

    @model_validator(mode="after")
    def _combinations(self) -> PrivacyCfg:
        if self.mechanism == "local" and self.max_participations is None:
            raise ValueError(
                "mechanism local composes each client's reports: set max_participations (the device enforces it)"
            )
        if self.local_noise == "laplace" and self.mechanism != "local":
            raise ValueError(
                "local_noise laplace is for mechanism local: central mechanisms add Gaussian noise"
            )
        if self.mechanism == "banded_mf" and self.bands is None:
            raise ValueError("mechanism banded_mf needs privacy.bands (b >= 1, e.g. 8)")
        if self.bands is not None and self.mechanism != "banded_mf":
            raise ValueError(
                f"privacy.bands is for mechanism banded_mf, not {self.mechanism}: remove bands or set banded_mf"
            )
        if self.adaptive_clip is not None and self.mechanism != "central_gaussian":
            raise ValueError(
                f"adaptive_clip is built for central_gaussian, not {self.mechanism}: use a fixed clip_norm"
            )
        return self


def check_privacy(cfg: Any) -> None:
    """Refuse (``ValueError``, one line naming the alternative) a run whose aggregation has no
    bounded sensitivity under the mechanism: a data-dependent denominator, a robust statistic, an
    aggregator other than the weighted sum, or aux state sent by the clients (SCAFFOLD's control
    variates, FedeRage's beta), which would leave the server un-noised."""
    p, a = cfg.privacy, cfg.aggregator
    if not p.enabled:
        return
    if p.reports is None:
        check_report_readers(cfg)
    if p.adaptive_clip is not None:
        from felix.privacy.adaptive import update_noise_multiplier

        update_noise_multiplier(p.noise_multiplier, count_noise(p, cfg.orchestrator.agg_goal))
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
    if p.mechanism == "banded_mf":
        check_bands(cfg)
    if p.mechanism in ("dp_ftrl", "banded_mf") and cfg.secure_aggregation.enabled:
        raise ValueError(
            f"privacy: mechanism {p.mechanism} with secure_aggregation: the unmasked sums are noised "
            "by central_gaussian only: use mechanism central_gaussian"
        )
    if p.target_epsilon is not None:
        check_target(cfg)
    from felix.strategies.objectives.base import objective_class

    if objective_class(cfg.client.objective).declared_aux(1):
        raise ValueError(
            f"privacy: client.objective {cfg.client.objective!r} sends aux state that would leave "
            "the server without noise: use an objective without aux (ce, fedprox)"
        )


def report_readers(cfg: Any) -> list[tuple[str, str]]:
    """What in ``cfg`` reads the losses and utilities clients report, each with the alternative
    that reads none: its selector, eval selector or aggregator, as each declares it (its registry
    entry's ``reads_reports``, a value or a predicate of its parameters; one that declares nothing,
    such as an unregistered import path, is taken to read them), and ``run.converge_threshold``,
    which stops the run on the reported training losses."""
    from felix.core.policies import AGGREGATORS, EVAL_SELECTORS, TRAIN_SELECTORS

    out = []
    for registry, section in (
        (TRAIN_SELECTORS, cfg.selector),
        (EVAL_SELECTORS, cfg.eval_selector),
        (AGGREGATORS, cfg.aggregator),
    ):
        if registry.declares(section.name, "reads_reports", section.params, default=True):
            blind = " or ".join(registry.declaring("reads_reports", False))
            out.append(
                (
                    f"{registry.kind} {section.name!r} reads the losses and utilities clients report (probes included)",
                    f"use a {registry.kind} that reads none ({blind}), e.g. strategy fedbuff or fedavg",
                )
            )
    if cfg.run.converge_threshold is not None:
        out.append(
            (
                "run.converge_threshold stops the run on the clients' reported training losses",
                "stop by run.max_aggregations or privacy.target_epsilon",
            )
        )
    return out


def check_report_readers(cfg: Any) -> None:
    """Refuse a private run without ``privacy.reports`` that reads the reports
    (:func:`report_readers`): un-noised, they would steer the run outside its epsilon."""
    readers = report_readers(cfg)
    if readers:
        what, instead = readers[0]
        raise ValueError(
            f"privacy: {what}, which would reach the server un-noised: set privacy.reports "
            f"(clipped, noised, accounted) or {instead}"
        )


def check_bands(cfg: Any) -> None:
    """Refuse bands that the population cannot serve: after each contribution a client sits out
    b - 1 aggregations, so b consecutive aggregations of K updates (or all of a shorter run) need
    b K distinct clients; with fewer the run would stall once they are spent."""
    b, k, n = cfg.privacy.bands, cfg.orchestrator.agg_goal, cfg.partition.num_clients
    runs = cfg.run.max_aggregations
    window = b if runs is None else min(b, runs)
    if window * k > n:
        raise ValueError(
            f"privacy.bands {b}: {window} aggregations of agg_goal {k} need {window * k} distinct "
            f"clients (each sits out {b - 1} after contributing), more than the {n} of "
            f"partition.num_clients: set bands <= {max(n // k, 1)}"
        )


def count_noise(p: PrivacyCfg, agg_goal: int) -> float:
    """Adaptive clipping's count noise: as configured, else K / 20 (Andrew et al.)."""
    assert p.adaptive_clip is not None
    return p.adaptive_clip.count_noise if p.adaptive_clip.count_noise is not None else agg_goal / 20


def check_target(cfg: Any) -> None:
    """Refuse, when the config is read, a ``target_epsilon`` that the run cannot meet (one
    aggregation, or the reports alone, exceed it), naming the noise it would need. Without the
    accounting library the run is refused later, naming the extra."""
    from felix.config.base import ConfigError
    from felix.privacy.accountant import library
    from felix.privacy.budget import PrivacyBudget

    try:
        library()
    except ConfigError:
        return
    PrivacyBudget(cfg, None)
