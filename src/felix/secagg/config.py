"""The ``secure_aggregation:`` config section and the cross-section rules it imposes.

Kept apart from ``felix.config`` as the privacy section is: the root config holds one field of
this type and calls :func:`check_secure_aggregation` once the whole tree is read."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: Aggregators whose step is a weighted sum the clients can fold in as ``[w, w * delta]`` (the
#: per-client weight from what the client knows, the staleness factor per group by the server).
#: The others need individual updates: q-FFL's per-client losses, REFL's SAA deviations.
SUM_AGGREGATORS = ("fedavg", "fedbuff", "tierfuse")


class LinkCfg(BaseModel):
    """The link a group member's protocol messages cross in the simulator (its traces carry
    availability and runtimes, no link): every member the same. The default stands for a mid-range
    mobile link; a scenario that knows its clients' links sets its own."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    rtt_s: float = Field(0.1, ge=0, description="round-trip latency of one exchange (s)")
    down_mbps: float = Field(20.0, gt=0, description="server-to-client bandwidth (Mbit/s)")
    up_mbps: float = Field(5.0, gt=0, description="client-to-server bandwidth (Mbit/s)")


class SecureAggregationCfg(BaseModel):
    """Secure aggregation (docs/privacy.md). ``protocol: none`` (the default) leaves a run exactly
    as without this section. Strict as the other sections (unknown keys, non-finite numbers
    refused) without importing ``felix.config``, which imports this module."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    protocol: Literal["none", "secagg_plus", "buffered"] = Field(
        "none",
        description="none | secagg_plus: SecAgg+ groups over each synchronous round's cohort | "
        "buffered: SecAgg+ groups over each async aggregation's buffered updates, formed when the "
        "aggregation is due (after the updates' metadata arrived, before any member masks), the "
        "aggregate made from the groups' sums",
    )
    group_size: int = Field(
        100, description="members of one group (a cohort is cut into groups of about this size)"
    )
    num_shares: int | None = Field(
        None,
        description="share holders of each member, itself included (SecAgg+'s k-regular graph; "
        "odd; null: the whole group, classic SecAgg)",
    )
    threshold: int | None = Field(
        None,
        description="holders that rebuild a member's secrets (Shamir t; null: a strict majority of num_shares)",
    )
    clipping_range: float = Field(8.0, gt=0, description="each coordinate of w x delta is clipped to +-this")
    quantization_bits: int = Field(22, ge=1, le=62, description="levels per coordinate: 2^quantization_bits")
    modulus_bits: int = Field(32, ge=2, le=64, description="the ring of the masked sums: Z_(2^modulus_bits)")
    max_weight: float | None = Field(
        None,
        gt=0,
        description="a client's aggregation weight is divided by this (and capped at 1) before folding; "
        "null: by the largest weight of the aggregation, so that the weights use the whole quantisation range",
    )

    link: LinkCfg = Field(
        LinkCfg(),
        description="the simulator's cost of each protocol exchange: latency and bandwidth of a member's link",
    )
    stage_timeout_s: float = Field(
        10.0,
        gt=0,
        description="how long the server waits for a stage's answers before it goes on without the "
        "silent members (seconds: virtual in the simulator, wall in a deployment)",
    )
    stage_grace_s: float = Field(
        3.0,
        ge=0,
        description="once the answers in suffice for the group to finish (threshold holders of every "
        "needed secret), the server waits this long more for the others, then goes on without them: "
        "a silent member costs a stage this grace, not stage_timeout_s, and an honest member slower "
        "than that counts as dropped",
    )

    @property
    def enabled(self) -> bool:
        return self.protocol != "none"

    @property
    def shares(self) -> int:
        return self.group_size if self.num_shares is None else min(self.num_shares, self.group_size)

    @property
    def t(self) -> int:
        return self.shares // 2 + 1 if self.threshold is None else self.threshold

    @model_validator(mode="after")
    def _consistent(self) -> SecureAggregationCfg:
        g, k = self.group_size, self.shares
        if g < 2:
            raise ValueError(f"group_size {g}: a group of one is its own sum (use >= 2)")
        if self.num_shares is not None and self.num_shares < g and self.num_shares % 2 == 0:
            raise ValueError(f"num_shares {self.num_shares} must be odd (a symmetric ring) or >= group_size")
        if self.num_shares is not None and self.num_shares < 2:
            raise ValueError(f"num_shares {self.num_shares} must be >= 2")
        if self.threshold is not None and self.threshold > g:
            raise ValueError(f"threshold {self.threshold} exceeds group_size {g}")
        if self.t > k:
            raise ValueError(f"threshold {self.t} exceeds num_shares {k}")
        if 2 * self.t <= k:
            raise ValueError(
                f"threshold {self.t} must exceed half of num_shares {k}, or the holders could rebuild both "
                "secrets of one member"
            )
        if self.quantization_bits >= self.modulus_bits:
            raise ValueError(
                f"quantization_bits {self.quantization_bits} must be below modulus_bits {self.modulus_bits}"
            )
        if g * ((1 << self.quantization_bits) - 1) >= 1 << self.modulus_bits:
            raise ValueError(
                f"modulus 2^{self.modulus_bits} overflows: a group of {g} sums values in "
                f"[-{self.clipping_range:g}, {self.clipping_range:g}] at 2^{self.quantization_bits} levels up to "
                f"{g} x 2^{self.quantization_bits}; raise modulus_bits or lower quantization_bits or group_size"
            )
        return self


def check_secure_aggregation(cfg: Any) -> None:
    """Refuse (``ValueError``, one line) a run whose aggregation needs individual updates."""
    s, a = cfg.secure_aggregation, cfg.aggregator
    if not s.enabled:
        return
    if a.name not in SUM_AGGREGATORS:
        raise ValueError(
            f"secure_aggregation: aggregator {a.name!r} needs individual updates (q-FFL's per-client "
            f"losses, REFL's SAA deviations): use {', '.join(SUM_AGGREGATORS)}"
        )
    if a.robust != "none":
        raise ValueError(
            f"secure_aggregation: aggregator.robust {a.robust!r} needs individual updates: set robust: none"
        )
    if a.clip_norm is not None:
        raise ValueError(
            "secure_aggregation: aggregator.clip_norm needs each update's norm: clip by clipping_range instead"
        )
    from felix.strategies.objectives.base import objective_class

    if objective_class(cfg.client.objective).declared_aux(1):
        raise ValueError(
            f"secure_aggregation: client.objective {cfg.client.objective!r} sends aux state in the clear "
            "beside the update: use an objective without aux (ce, fedprox)"
        )
    sync = cfg.orchestrator.round_policy == "sync"
    if s.protocol == "secagg_plus" and not sync:
        raise ValueError(
            "secure_aggregation: secagg_plus needs orchestrator.round_policy sync: use buffered for async"
        )
    if s.protocol == "buffered" and sync:
        raise ValueError(
            "secure_aggregation: buffered serves orchestrator.round_policy async: use secagg_plus for sync"
        )


__all__ = ["SUM_AGGREGATORS", "LinkCfg", "SecureAggregationCfg", "check_secure_aggregation"]
