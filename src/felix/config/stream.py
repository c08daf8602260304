"""The stream's config sections (``stream:``, felix.stream): arrivals, drift, label delay and the
client's sample store."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from felix.config.base import StrictModel


class ArrivalCfg(StrictModel):
    """When each client's samples arrive (felix.stream.arrivals): a Poisson process per client."""

    kind: Literal["poisson", "diurnal", "availability"] = Field(
        "poisson",
        description="poisson: a constant rate; diurnal: the rate follows the time of day (a cosine "
        "peaking at peak_hour); availability: arrivals only while the client's availability trace "
        "is in (tied_to: available) or out of (tied_to: unavailable) the AVL_TRAIN tier",
    )
    rate_per_hour: float = Field(30.0, ge=0, description="mean arrivals per client and hour")
    rate_spread: float = Field(
        0.5,
        ge=0,
        description="per-client rates are lognormal around rate_per_hour with this sigma (0: equal)",
    )
    diurnal_amplitude: float = Field(0.8, ge=0, le=1, description="diurnal: relative swing of the rate")
    peak_hour: float = Field(20.0, ge=0, lt=24, description="diurnal: hour of day of the highest rate")
    tied_to: Literal["available", "unavailable"] = Field(
        "unavailable",
        description="availability: generate data while the device is in use (unavailable for "
        "training) or while it is idle and charging (available)",
    )
    warmup_s: float = Field(
        3600.0, ge=0, description="the stream starts this long before the run, so clients hold data at time 0"
    )


class ShiftCfg(StrictModel):
    """One global shift of the class mix: an abrupt surge of a few classes, or a gradual rotation."""

    kind: Literal["surge", "rotate"]
    at_s: float = Field(ge=0, description="run time at which the shift starts")
    classes: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, description="surge: the classes whose share surges"
    )
    factor: float = Field(8.0, gt=0, description="surge: their weight is multiplied by this")
    duration_s: float | None = Field(None, gt=0, description="surge: how long it lasts (null: for good)")
    period_s: float = Field(
        3600.0, gt=0, description="rotate: seconds for the class ranks to move by one class, continuously"
    )
    steps: float | None = Field(
        None, gt=0, description="rotate: stop after moving this many classes (null: keeps rotating)"
    )

    @model_validator(mode="after")
    def _surge(self) -> ShiftCfg:
        if self.kind == "surge" and not self.classes:
            raise ValueError("a surge needs the classes that surge (classes: [..])")
        return self


class DriftCfg(StrictModel):
    """The class mix over time (felix.stream.drift): a global mix with shifts, and per-client interests."""

    imbalance: float = Field(
        1.0,
        ge=1,
        description="the global mix before any shift: class weights fall geometrically from 1 to "
        "1/imbalance over a seeded class order (1: every class alike)",
    )
    shifts: list[ShiftCfg] = Field(default_factory=list)
    personal_weight: float = Field(
        0.0, ge=0, le=1, description="share of a client's mix that is its own interest (Dirichlet)"
    )
    personal_alpha: float = Field(0.5, gt=0, description="Dirichlet concentration of the personal interests")
    personal_shifts_per_day: float = Field(
        0.0, ge=0, description="rate at which a client redraws its interest (0: never)"
    )

    @model_validator(mode="after")
    def _rotation(self) -> DriftCfg:
        if any(s.kind == "rotate" for s in self.shifts) and self.imbalance == 1:
            raise ValueError("a rotation moves the ranks of an uneven mix: set drift.imbalance above 1")
        return self


class LabelCfg(StrictModel):
    """When each sample's label becomes known (felix.stream.labels), and the proxy label before it."""

    delay: Literal["none", "constant", "exponential", "lognormal", "pareto"] = Field(
        "none",
        description="none: labelled on arrival; constant: after median_s; exponential: mean "
        "median_s / ln 2; lognormal: median median_s, shape sigma; pareto (Lomax): median "
        "median_s, tail index shape (> 1 for a finite mean)",
    )
    median_s: float = Field(600.0, gt=0, description="median label delay")
    sigma: float = Field(1.0, gt=0, description="lognormal: sigma of the log-delay")
    shape: float = Field(2.0, gt=0, description="pareto: tail index; <= 1 has no finite mean")
    proxy_error: float | None = Field(
        None,
        ge=0,
        le=1,
        description="a proxy label at arrival, wrong with this probability, replaced when the true "
        "label arrives (null: an unlabelled sample is not trained on)",
    )

    @model_validator(mode="after")
    def _finite_mean(self) -> LabelCfg:
        if self.delay == "pareto" and self.shape <= 1:
            raise ValueError(
                f"a pareto delay with shape {self.shape:g} <= 1 has no finite mean: use shape > 1"
            )
        return self


class StoreCfg(StrictModel):
    """What a client keeps and trains on (felix.stream.store)."""

    cap: int = Field(500, ge=1, description="samples a client stores at most; the oldest are dropped")
    window_s: float | None = Field(None, gt=0, description="train only on samples younger than this")
    window_count: int | None = Field(None, ge=1, description="train only on the newest N labelled samples")


class StreamCfg(StrictModel):
    """Streaming data (docs/streaming.md): off by default; a run with it off is the fixed-split run."""

    enabled: bool = False
    arrivals: ArrivalCfg = ArrivalCfg()
    drift: DriftCfg = DriftCfg()
    labels: LabelCfg = LabelCfg()
    store: StoreCfg = StoreCfg()
    recovery_tolerance: float = Field(
        0.02, gt=0, lt=1, description="recovered: back within this accuracy of the level before a shift"
    )
    recovery_before_s: float = Field(
        1800.0, gt=0, description="the level before a shift: mean accuracy over this long before it"
    )
    grid_s: float = Field(60.0, gt=0, description="spacing of the accuracy-over-time curve (freshness.csv)")
