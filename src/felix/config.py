"""Run configuration: one validated tree, read from YAML, merged with a strategy preset and
``--set key=value`` overrides. Unknown keys and bad values fail with the key's dotted path."""

from __future__ import annotations

import copy
import importlib
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)


class ConfigError(ValueError):
    """A configuration that cannot run; the message says which key and why."""


class _Strict(BaseModel):
    # A number given where a string is expected (``name: 2024``) is taken as its text. Numbers are
    # finite: an infinite learning rate, time limit or horizon is a mistyped config, not a setting.
    model_config = ConfigDict(extra="forbid", frozen=True, coerce_numbers_to_str=True, allow_inf_nan=False)


class _Yaml12Loader(yaml.SafeLoader):
    """YAML 1.2 core-schema scalars: PyYAML follows YAML 1.1, where ``3_75`` is the integer 375,
    ``1:30`` a sexagesimal number and ``on`` / ``no`` booleans, which silently mistypes settings
    such as ``trace.series=3_75``. Here only plain decimal, 0o / 0x integers, decimal floats and
    true / false are typed; anything else stays a string."""


_Yaml12Loader.yaml_implicit_resolvers = {
    k: [
        (tag, rx)
        for tag, rx in v
        if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:bool")
    ]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node))
    return int(text, 0) if text.startswith(("0o", "0x")) else int(text)


_Yaml12Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def load_yaml(text: str) -> Any:
    """Parse YAML with the core-schema scalars of ``_Yaml12Loader``."""
    return yaml.load(text, Loader=_Yaml12Loader)  # a SafeLoader subclass


def _registered(module: str, registry: str, value: str) -> str:
    """A scenario part given as a registered name or an import path, checked against its registry
    (``felix.scenario.registry``). The registry's module is imported only here, when a config is
    validated: it may import torch, which merely importing this module must not."""
    reg = getattr(importlib.import_module(module), registry)
    try:
        return str(reg.check(value))
    except ConfigError as exc:
        raise ValueError(str(exc).removeprefix(f"{reg.key}: ")) from None


def _component(module: str, registry: str, name: str, params: Any = None, where: str | None = None) -> None:
    """Check a strategy component against its registry (``felix.core.registry``): ``name`` is
    registered there or an import path, and ``params`` (when given) validate against the
    component's own typed parameters, so a config fails with one line naming the component and
    the key. The registry's module is imported only here (it may import torch); the config keeps
    the mapping as written, so a run's written config is unchanged."""
    from felix.core.registry import RegistryError  # pydantic only

    reg = getattr(importlib.import_module(module), registry)
    try:
        reg.entry(name) if params is None else reg.parse(name, params, where)
    except RegistryError as exc:
        raise ValueError(str(exc).removeprefix(f"{reg.key}: ")) from None


class DatasetCfg(_Strict):
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
        return _registered("felix.scenario.datasets", "DATASETS", v)


class PartitionCfg(_Strict):
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
        return _registered("felix.scenario.partition", "PARTITIONERS", v)

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


class RamCfg(_Strict):
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


class TraceCfg(_Strict):
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
        return _registered("felix.scenario.traces", "TRACES", v)

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


class RuntimeCfg(_Strict):
    kind: Literal["halfnormal", "constant", "uniform", "per_sample"] = "halfnormal"
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


class AdmissionCfg(_Strict):
    """Per-client admission control (felix.core.admission): flap damping and a task budget. The
    defaults are far above what honest clients of the shipped scenarios and the MobiPerf trace do."""

    flap_limit: int | None = Field(
        100,
        ge=1,
        description="a client whose reported tier changes more than this many times within "
        "flap_window_s is treated as unavailable (null: never)",
    )
    flap_window_s: float = Field(60.0, gt=0)
    flap_hold_s: float = Field(
        600.0, gt=0, description="a damped client is available again after this long without a tier change"
    )
    task_rate: float | None = Field(
        2.0, gt=0, description="tasks and cancels per second a client's budget refills (null: no budget)"
    )
    task_burst: float = Field(30.0, ge=1, description="the task budget's capacity")


class OrchestratorCfg(_Strict):
    mode: str = Field(
        "async",
        description="round policy: sync | async, or a registered name or import path "
        "(felix.core.rounds.ROUND_POLICIES); its parameters in mode_params",
    )
    agg_goal: int = Field(10, ge=1)
    concurrency: int = Field(30, ge=1)
    overcommit: float = Field(1.3, ge=1)
    deadline_s: float | None = Field(None, gt=0)
    cancel_stragglers: bool = True
    task_timeout_s: float | None = Field(90.0, gt=0)
    accept_late: bool = True
    max_staleness: int | None = Field(None, ge=0)
    one_late_task_per_client: bool = Field(
        False,
        description="keep only each client's oldest task that "
        "timed out (newer ones cancelled): open tasks bounded by the population; "
        "felix serve always sets it",
    )
    eval_utility_scale: float = Field(
        1.0,
        gt=0,
        description="multiplies the statistical utility an eval task "
        "reports, to put it on the training utilities' scale (1: as measured)",
    )
    spare_queued_evals: bool = Field(
        False,
        description="an eval task that times out while its client still owes an "
        "older task's reply (it waits behind it) does not mark the client unavailable",
    )
    probe_busy_clients: bool = Field(
        True,
        description="eval probes may go to clients that still owe an older task's "
        "reply (false: they are skipped, as their eval would wait behind it)",
    )
    knowledge: str = Field(
        "none",
        description="availability policy: none | oracle | tiertrack, or a registered "
        "name or import path (felix.core.availability.AVAILABILITY); parameters in knowledge_params",
    )
    mode_params: dict[str, Any] = Field(
        default_factory=dict, description="the round policy's typed parameters"
    )
    knowledge_params: dict[str, Any] = Field(
        default_factory=dict, description="the availability policy's typed parameters"
    )
    admission: AdmissionCfg = AdmissionCfg()


class PolicyCfg(_Strict):
    """A policy by registered name or import path; ``params`` is validated against the policy's own
    parameter model when the run is built (``felix.core.registry``)."""

    name: str
    params: dict[str, Any] = Field(default_factory=dict)


class AggregatorCfg(_Strict):
    name: str = "fedbuff"
    server_lr: float = Field(1.0, gt=0)
    normalize: Literal["weights", "count"] = "weights"
    clip_norm: float | None = Field(None, gt=0)
    params: dict[str, Any] = Field(default_factory=dict)
    robust: Literal["none", "median", "trimmed_mean"] = Field(
        "none",
        description="replace the weighted mean of the deltas by a coordinate-wise weighted median "
        "or trimmed mean, keeping the aggregator's weights (felix.strategies.aggregation.robust)",
    )
    trim_fraction: float = Field(0.2, ge=0, lt=0.5, description="trimmed_mean: weight mass cut from each end")


class ValidationCfg(_Strict):
    """Bounds on client results (felix.core.validation); on by default in simulation and deployment."""

    max_samples_factor: float = Field(
        1.0, ge=1, description="num_samples <= factor x the registered count (+ the data-plan row)"
    )
    norm_policy: Literal["reject", "clip", "off"] = "reject"
    norm_factor: float = Field(30.0, gt=1, description="norm bound: factor x median of recent accepted norms")
    norm_window: int = Field(
        50, ge=1, description="distinct clients whose latest accepted norm forms the median"
    )
    norm_min_history: int = Field(5, ge=1, description="clients needed before the median rule applies")
    warmup_factor: float = Field(
        1.0, ge=0, description="bound before that: factor x the model's norm (0: none)"
    )
    norm_floor: float = Field(
        0.5,
        ge=0,
        le=1,
        description="the median never counts below this fraction of its peak so far, so that the "
        "bound does not shrink with the updates as the model converges (0: no floor)",
    )


class ClientCfg(_Strict):
    lr: float = Field(0.05, gt=0)
    batch_size: int = Field(32, ge=1)
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    drop_last: bool = False
    optimizer: Literal["sgd", "adam"] = "sgd"
    objective: str = "ce"
    objective_params: dict[str, Any] = Field(default_factory=dict)
    buffers: Literal["aggregate", "local"] = Field(
        "aggregate",
        description="model buffers (BatchNorm running statistics): aggregate = sent with the "
        "weights and averaged by the server like parameters; local = kept per client, never sent, and the "
        "global model is evaluated with the buffers its factory made (felix.client.trainer)",
    )
    probe_loss: bool = Field(
        False,
        description="before training, measure the loss at the received model over "
        "the client's data (one forward pass) and send it as aux qffl_loss: the F_k q-FFL "
        "needs (aggregator qffl only; trains one client at a time)",
    )
    flower_app: str | None = Field(
        None,
        description="a Flower ClientApp by import path 'package.module:app' whose train handler "
        "trains every task (extra felix-fl[flower]; docs/flower.md); null: felix's own trainer",
    )

    @field_validator("flower_app")
    @classmethod
    def _flower_app(cls, v: str | None) -> str | None:
        if v is not None and (v.count(":") != 1 or not all(v.partition(":")[::2])):
            raise ValueError(f"{v!r} is not an import path 'package.module:app'")
        return v

    @model_validator(mode="after")
    def _objective(self) -> ClientCfg:
        _component(
            "felix.strategies.objectives",
            "OBJECTIVES",
            self.objective,
            self.objective_params,
            "client.objective_params",
        )
        return self


class DaflCfg(_Strict):
    """Planner and augmentation settings for ``data_plan: lb | dafl``; defaults are the DAFL paper's
    (Sec. VI). ``zeta`` / ``zeta_prime`` are relative per-sample augmentation / training times: the
    planner weighs with them, and the simulator charges a client ``zeta / zeta_prime`` of its
    per-sample training time for each sample it augments. LB uses ``tau``, ``step`` and ``augmenter``."""

    lambda1: float = Field(1.0, ge=0)
    lambda2: float = Field(100.0, ge=0)
    tau: float = Field(1e-3, ge=0)
    epsilon: float = Field(1e-3, gt=0)
    step: int = Field(1, ge=1)
    zeta: float = Field(1.0, ge=0)
    zeta_prime: float = Field(2.0, gt=0)
    local_updates: int = Field(2, ge=1, description="E in the time model's (E-1)^2 L^2CG^2 I term")
    smoothness: float = Field(1.0, ge=0, description="L^2 C G^2, set to 1 in the paper")
    augmenter: str = Field("rotate_flip", description="felix.strategies.dataplans.augment.AUGMENTERS name")


class RunCfg(_Strict):
    target_accuracy: float = Field(0.8, gt=0, le=1)
    target_window: int = Field(5, ge=1, description="K: mean of the last K evaluations must reach the target")
    max_time_s: float = Field(86400.0, gt=0)
    max_aggregations: int | None = Field(None, ge=1)
    eval_every: int = Field(
        1,
        ge=0,
        description="evaluate every N-th model version (and the initial and final "
        "models); 0: no evaluation at all",
    )
    stop_at_target: bool = True
    device: str = Field("cpu", description="torch device: cpu, cuda, cuda:1, ...")
    threads: int | None = Field(
        1,
        ge=1,
        description="torch intra-op threads, applied to every run, compare "
        "worker and benchmark (null: torch's default). On a CPU a model without convolutions "
        "gives the same results at any count (its cohorts split by client over the threads; "
        "one client's work stays on one); a model with convolutions may differ in its last bits",
    )
    cohort: Literal["auto"] | Annotated[int, Field(ge=1)] = Field(
        "auto",
        description="clients trained together in one vectorised pass: 1 = one at a time; auto = "
        "vectorised on a GPU, and on a CPU for models without convolutions (felix.client.cohort)",
    )
    executor: Literal["local", "ray"] = Field(
        "local",
        description="where cohorts train: local = in this process; ray = split over Ray actors "
        "(felix.distributed.cohort_executor, extra felix-fl[ray]), with the same results",
    )
    ray_actors: int | None = Field(
        None,
        ge=1,
        description="cohort actors for executor ray (null: one per GPU "
        "of the cluster, or one per run.threads CPUs)",
    )
    ray_address: str | None = Field(
        None,
        description="Ray cluster for executor ray (HOST:PORT or auto); "
        "null: a safe local instance, or the one this process is already connected to",
    )
    precision: Literal["fp32", "tf32", "bf16"] = Field(
        "fp32",
        description="GPU arithmetic: tf32 matmuls, or bf16 autocast of forward passes; fp32 by default",
    )
    per_client_eval: bool = Field(
        False,
        description="evaluate the final global model per client and per class "
        "(felix.metrics.per_client): mean, worst, bottom-10%, rare-client and per-class "
        "accuracy, macro and minority F1, in the summary's per_client section",
    )
    rare_p: float | None = Field(
        None,
        ge=0,
        le=1,
        description="per_client_eval: rare clients are those with "
        "participation p <= rare_p (null: the lowest-p quarter by rank)",
    )
    converge_threshold: float | None = Field(
        None,
        gt=0,
        description="stop when the training loss changes by "
        "less than this for converge_patience consecutive aggregations "
        "(the DAFL paper's convergence rule; null: no such stop)",
    )
    converge_patience: int = Field(5, ge=1)
    log_to: list[Literal["tensorboard", "mlflow"]] = Field(
        default_factory=list,
        description="trackers that receive each evaluation and the final summary "
        "(felix.metrics.tracking; extra felix-fl[tracking]): tensorboard = event files in "
        "<run folder>/tensorboard; mlflow = a run in run.mlflow_uri",
    )
    mlflow_uri: str | None = Field(
        None,
        description="MLflow tracking URI for log_to mlflow (null: a local file store, <run folder>/mlruns)",
    )
    mlflow_experiment: str | None = Field(None, description="MLflow experiment (null: the config's name)")

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        import torch  # here, not at the top: reading a config needs no torch otherwise

        try:
            kind = torch.device(v).type
        except (RuntimeError, TypeError):
            raise ValueError(f"{v!r} is not a torch device (cpu, cuda, cuda:1, mps, ...)") from None
        if kind == "meta":
            raise ValueError("'meta' tensors hold no data: a run needs a device that computes")
        return v


class ArrivalCfg(_Strict):
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


class ShiftCfg(_Strict):
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


class DriftCfg(_Strict):
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


class LabelCfg(_Strict):
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


class StoreCfg(_Strict):
    """What a client keeps and trains on (felix.stream.store)."""

    cap: int = Field(500, ge=1, description="samples a client stores at most; the oldest are dropped")
    window_s: float | None = Field(None, gt=0, description="train only on samples younger than this")
    window_count: int | None = Field(None, ge=1, description="train only on the newest N labelled samples")


class StreamCfg(_Strict):
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


class Config(_Strict):
    name: str = "run"
    description: str = Field(
        "", description="what the config runs; documentation only (configs/ files have one)"
    )
    strategy: str = "custom"
    # Task generators are seeded with seed * 1,000,003 + task id, which torch takes as a 64-bit integer.
    seed: int = Field(0, ge=0, le=2**32 - 1)
    model: str = Field(
        "small_cnn",
        description="a registered model (felix.scenario.models.MODELS: felix_cnn, kws_cnn, resnet34_1d, "
        "small_cnn, mlp) or an import path 'package.module:factory' (docs/python-api.md)",
    )
    model_params: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments for the model factory"
    )
    data_plan: str = Field(
        "none",
        description="a registered data plan (felix.core.dataplan.DATA_PLANS: none, lb, dafl; "
        "settings in dafl) or an import path",
    )
    dafl: DaflCfg = DaflCfg()
    dataset: DatasetCfg = DatasetCfg()
    partition: PartitionCfg = PartitionCfg()
    trace: TraceCfg = TraceCfg()
    runtime: RuntimeCfg = RuntimeCfg()
    orchestrator: OrchestratorCfg = OrchestratorCfg()
    selector: PolicyCfg = PolicyCfg(name="random")
    eval_selector: PolicyCfg = PolicyCfg(name="none")
    aggregator: AggregatorCfg = AggregatorCfg()
    validation: ValidationCfg = ValidationCfg()
    client: ClientCfg = ClientCfg()
    run: RunCfg = RunCfg()
    stream: StreamCfg = StreamCfg()

    @model_serializer(mode="wrap")
    def _without_stream_off(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
        """Leave ``stream`` out of a run's written config while it is off, so that the configs of
        runs without streams read exactly as they did before streams existed."""
        out = handler(self)
        if isinstance(out, dict) and not self.stream.enabled:
            out.pop("stream", None)
        return out

    @field_validator("model")
    @classmethod
    def _model(cls, v: str) -> str:
        return _registered("felix.scenario.models", "MODELS", v)

    @field_validator("data_plan")
    @classmethod
    def _data_plan(cls, v: str) -> str:
        _component("felix.core.dataplan", "DATA_PLANS", v)
        return v

    @model_validator(mode="after")
    def _components(self) -> Config:
        """Each strategy component's ``params`` by the component's own model (its registry)."""
        o = self.orchestrator
        for module, registry, name, params, where in (
            ("felix.core.rounds", "ROUND_POLICIES", o.mode, o.mode_params, "orchestrator.mode_params"),
            (
                "felix.core.availability",
                "AVAILABILITY",
                o.knowledge,
                o.knowledge_params,
                "orchestrator.knowledge_params",
            ),
            (
                "felix.core.policies",
                "TRAIN_SELECTORS",
                self.selector.name,
                self.selector.params,
                "selector.params",
            ),
            (
                "felix.core.policies",
                "EVAL_SELECTORS",
                self.eval_selector.name,
                self.eval_selector.params,
                "eval_selector.params",
            ),
            (
                "felix.core.policies",
                "AGGREGATORS",
                self.aggregator.name,
                self.aggregator.params,
                "aggregator.params",
            ),
        ):
            _component(module, registry, name, params, where)
        return self

    @model_validator(mode="after")
    def _ram_and_probe_loss(self) -> Config:
        t, p = self.trace, self.partition
        if t.kind == "ram" and t.ram.coupling == "rare_clients":
            n_rare = p.num_clients - round(t.ram.frequent_fraction * p.num_clients)
            if p.kind != "rare_clients" or n_rare != round(p.rare_fraction * p.num_clients):
                raise ValueError(
                    "trace.ram.coupling 'rare_clients' gives p_rare to the last (1 - frequent_fraction) "
                    "of the clients: it needs partition.kind 'rare_clients' with the same number of "
                    f"rare clients ({n_rare} here)"
                )
        if self.client.probe_loss and self.aggregator.name != "qffl":
            raise ValueError(
                f"client.probe_loss sends aux qffl_loss, which only aggregator 'qffl' reads "
                f"(aggregator is {self.aggregator.name!r})"
            )
        return self


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Nested dicts merge key by key; anything else in ``over`` replaces. ``params`` dicts replace
    whole, so a strategy preset never inherits another selector's parameters."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if (
            isinstance(v, dict)
            and isinstance(out.get(k), dict)
            and k not in ("params", "objective_params", "model_params", "mode_params", "knowledge_params")
        ):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def parse_set(items: list[str]) -> dict[str, Any]:
    """``a.b=value`` pairs into a nested dict; values are parsed as YAML 1.2 (numbers, null, lists)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects key=value, got {item!r}")
        try:
            value = load_yaml(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {key}: cannot parse value {raw!r} ({exc})") from None
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {p} is set both as a value and as a section")
        node[parts[-1]] = value
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        doc = load_yaml(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {p} not found") from None
    except OSError as exc:  # a folder, no permission
        raise ConfigError(f"config file {p}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not a UTF-8 text file ({exc})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML ({exc})") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections")
    return doc


def validate(raw: dict[str, Any], source: str = "config") -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
            msg = (
                "unknown key"
                if err["type"] == "extra_forbidden"
                else err["msg"].removeprefix("Value error, ")
            )
            lines.append(f"  {loc}: {msg}")
        raise ConfigError(f"{source}: invalid configuration\n" + "\n".join(lines)) from None
