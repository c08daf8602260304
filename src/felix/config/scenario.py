"""The scenario's config sections: dataset, partition, availability trace (and its random-access
model) and runtimes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from felix.config.base import StrictModel, registered


class DatasetCfg(StrictModel):
    name: str = Field(
        "digits",
        description="a registered dataset (felix.scenario.datasets.DATASETS: digits, fsdd, speech_commands, "
        "fashion_mnist, cifar10) or an import path 'package.module:loader' (docs/python-api.md)",
    )
    root: str | None = None
    download: bool = False
    per_class_limit: int | None = Field(None, ge=1)
    test_limit: int | None = Field(
        None, ge=1, description="evaluate on N test samples, the first of each class in equal shares"
    )
    num_classes: int | None = Field(
        None,
        ge=2,
        description="keep only the first N classes (label order), "
        "train and test, e.g. the first 8 CIFAR-10 classes of the DAFL paper",
    )
    params: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the loader")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return registered("felix.scenario.datasets", "DATASETS", v)


class PartitionCfg(StrictModel):
    kind: str = Field(
        "dirichlet",
        description="a registered partitioner (felix.scenario.partition.PARTITIONERS: "
        "dirichlet, iid, table, rare_clients, speaker) or an import path 'package.module:partitioner'",
    )
    num_clients: int = Field(100, ge=1)
    alpha: float = Field(0.5, gt=0)
    min_samples: int = Field(1, ge=1)
    table: list[list[int]] | None = None
    imbalance: float = Field(
        1.0,
        ge=1,
        description="make the training set long-tailed before the split: the "
        "class ranked r of a random order keeps head_per_class * imbalance^(-r/(C-1)) "
        "samples (1: keep every sample)",
    )
    head_per_class: int | None = Field(
        None,
        ge=1,
        description="samples kept of the head class when imbalance > 1 (null: the dataset's largest class)",
    )
    rare_classes: int = Field(
        2, ge=1, description="rare_clients: the tail classes held only by the rare clients"
    )
    rare_fraction: float = Field(
        0.25,
        gt=0,
        lt=1,
        description="rare_clients: share of clients (the last ones) that hold the rare classes",
    )
    params: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the partitioner")

    @field_validator("kind")
    @classmethod
    def _kind(cls, v: str) -> str:
        return registered("felix.scenario.partition", "PARTITIONERS", v)

    @model_validator(mode="after")
    def _table(self) -> PartitionCfg:
        if self.kind == "table":
            if not self.table:
                raise ValueError("partition.kind 'table' needs partition.table (clients x classes counts)")
            if len({len(r) for r in self.table}) != 1:
                raise ValueError("partition.table rows must all have the same number of classes")
        if (
            self.kind == "rare_clients"
            and not 1 <= round(self.rare_fraction * self.num_clients) < self.num_clients
        ):
            raise ValueError(
                f"partition.kind 'rare_clients' needs 1 <= round(rare_fraction x num_clients) < "
                f"num_clients, got {round(self.rare_fraction * self.num_clients)} of {self.num_clients}"
            )
        return self


class RamCfg(StrictModel):
    """The Random Access Model (``trace.kind: ram``; felix.scenario.random_access): client i is
    available for a whole slot of ``trace.slot_s`` seconds with its own probability p_i, drawn
    independently per slot, for ``horizon_s / slot_s`` slots. The p_i are hidden from the strategy."""

    p_dist: Literal["beta", "two_level"] = Field(
        "beta",
        description="beta: p ~ Beta(a, b) clipped to "
        "[p_min, p_max]; two_level: frequent_fraction of clients at "
        "p_frequent, the rest at p_rare",
    )
    a: float = Field(0.5, gt=0)
    b: float = Field(3.0, gt=0)
    p_min: float = Field(0.02, gt=0, le=1)
    p_max: float = Field(0.9, gt=0, le=1)
    frequent_fraction: float = Field(0.2, ge=0, le=1)
    p_frequent: float = Field(0.5, gt=0, le=1)
    p_rare: float = Field(0.05, gt=0, le=1)
    coupling: Literal["rarity", "rare_clients", "none"] = Field(
        "rarity",
        description="rarity: the same p values reassigned so the clients with the globally rarest "
        "data get the lowest p; rare_clients (two_level, partition.kind rare_clients): the last "
        "(1 - frequent_fraction) of the clients, who hold the rare classes, join with p_rare, the others with "
        "p_frequent; none: p independent of the data",
    )

    @model_validator(mode="after")
    def _ranges(self) -> RamCfg:
        if self.p_min > self.p_max:
            raise ValueError(f"trace.ram: need p_min <= p_max, got {self.p_min} > {self.p_max}")
        if self.p_rare > self.p_frequent:
            raise ValueError(f"trace.ram: need p_rare <= p_frequent, got {self.p_rare} > {self.p_frequent}")
        return self


class TraceCfg(StrictModel):
    kind: str = Field(
        "always",
        description="a registered trace (felix.scenario.traces.TRACES: always, slotted, "
        "mobiperf, fedscale, ram) or an import path 'package.module:builder'",
    )
    path: str | None = None
    series: Literal["2", "3_50", "3_75", "failures_48h"] = "3_50"
    unavailable_fraction: float = Field(0.1, ge=0, lt=1)
    slot_s: float = Field(600.0, gt=0)
    horizon_s: float = Field(86400.0, gt=0)
    offset_s: float = Field(
        0.0,
        ge=0,
        description="start this many seconds into the trace (e.g. past an "
        "all-available head); the run's time 0 is the trace's offset_s",
    )
    ram: RamCfg = RamCfg()
    params: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments for the trace builder"
    )

    @field_validator("kind")
    @classmethod
    def _kind(cls, v: str) -> str:
        return registered("felix.scenario.traces", "TRACES", v)

    @field_validator("series", mode="before")
    @classmethod
    def _series_text(cls, v: object) -> object:
        """``series: 2`` is the 2-state series, whether YAML typed it as a number or not."""
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @model_validator(mode="after")
    def _path(self) -> TraceCfg:
        if self.kind in ("mobiperf", "fedscale") and not self.path:
            raise ValueError(f"trace.kind {self.kind!r} needs trace.path")
        if self.kind == "ram" and self.ram.coupling == "rare_clients" and self.ram.p_dist != "two_level":
            raise ValueError(
                "trace.ram.coupling 'rare_clients' gives the rare clients p_rare: it needs "
                "trace.ram.p_dist 'two_level'"
            )
        if self.kind == "ram" and self.horizon_s < self.slot_s:
            raise ValueError(
                f"trace.kind 'ram' draws horizon_s / slot_s rounds: horizon_s ({self.horizon_s:g}) "
                f"must be at least slot_s ({self.slot_s:g})"
            )
        return self


class RuntimeCfg(StrictModel):
    kind: str = Field(
        "halfnormal",
        description="a registered runtime profile (felix.scenario.profiles.RUNTIMES: halfnormal, "
        "constant, uniform, per_sample) or an import path 'package.module:profile'",
    )
    scale_s: float | None = Field(
        None, gt=0, description="half-normal scale; default the FeLiX authors' 14.38 s"
    )
    min_s: float = Field(2.0, ge=0)
    constant_s: float = Field(10.0, gt=0)
    low_s: float = Field(1.0, gt=0)
    high_s: float = Field(60.0, gt=0)
    seconds_per_sample: float = Field(
        0.01,
        gt=0,
        description="per_sample: a training task lasts this times the "
        "client's sample count, so time grows with data (and with augmentation)",
    )
    eval_fraction: float = Field(0.05, gt=0, le=1)

    @field_validator("kind")
    @classmethod
    def _kind(cls, v: str) -> str:
        return registered("felix.scenario.profiles", "RUNTIMES", v)
