"""Run configuration: one validated tree, read from YAML, merged with a strategy preset and
``--set key=value`` overrides. Unknown keys and bad values fail with the key's dotted path.

The sections live beside this module by concern (:mod:`~felix.config.scenario`,
:mod:`~felix.config.stream`; files and overrides in :mod:`~felix.config.files`); this one holds
the strategy, client and run sections, the whole ``Config`` and :func:`validate`. The
``orchestrator`` and ``validation`` sections are the core's own settings models
(``felix.core.orchestrator_config``, ``felix.core.validation``), which the core reads as they are.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from felix.client.settings import Buffers, TrainSettings, buffers_field
from felix.config.base import (
    ConfigError,
    StrictModel,
    check_component,
    check_part_params,
    registered,
    unknown_key,
)
from felix.config.files import deep_merge, load_yaml, parse_set, read_yaml
from felix.config.scenario import DatasetCfg, PartitionCfg, RamCfg, RuntimeCfg, TraceCfg
from felix.config.stream import ArrivalCfg, DriftCfg, LabelCfg, ShiftCfg, StoreCfg, StreamCfg
from felix.core.admission import AdmissionConfig
from felix.core.key_aliases import KEY_ALIASES, renamed
from felix.core.orchestrator_config import OrchestratorConfig
from felix.core.rounds import ROUND_POLICIES
from felix.core.validation import ValidationConfig
from felix.privacy.config import PrivacyCfg, check_privacy
from felix.secagg.config import SecureAggregationCfg, check_secure_aggregation

__all__ = [
    "KEY_ALIASES",
    "AdmissionConfig",
    "AggregatorCfg",
    "ArrivalCfg",
    "ClientCfg",
    "Config",
    "ConfigError",
    "DaflCfg",
    "DaflPlannerCfg",
    "DatasetCfg",
    "DriftCfg",
    "LabelCfg",
    "OrchestratorConfig",
    "PartitionCfg",
    "PolicyCfg",
    "RamCfg",
    "RunCfg",
    "RuntimeCfg",
    "ShiftCfg",
    "StoreCfg",
    "StreamCfg",
    "TraceCfg",
    "ValidationConfig",
    "deep_merge",
    "load_yaml",
    "parse_set",
    "read_yaml",
    "validate",
]


log = logging.getLogger("felix.config")


class PolicyCfg(StrictModel):
    """A policy by registered name or import path; ``params`` is validated against the policy's own
    parameter model when the run is built (``felix.core.registry``)."""

    name: str
    params: dict[str, Any] = Field(default_factory=dict)


class AggregatorCfg(StrictModel):
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
    server_optimizer: str = Field(
        "sgd",
        description="how the aggregated update moves the model: sgd (x + server_lr x update) | momentum "
        "| adam | yogi | adagrad (Reddi et al. 2021; felix.core.server_optim), parameters in "
        "server_optimizer_params",
    )
    server_optimizer_params: dict[str, Any] = Field(
        default_factory=dict,
        description="momentum: beta; adam, yogi: beta1, beta2, tau; adagrad: beta1, tau",
    )

    @model_validator(mode="after")
    def _server_optimizer(self) -> AggregatorCfg:
        """The optimiser is built once here (pure numpy, cheap), so a bad name, key or value fails at
        config read, not at the first aggregation."""
        from felix.core.aggregation import AGGREGATORS
        from felix.core.registry import RegistryError
        from felix.core.server_optim import SERVER_OPTIMIZERS

        try:
            SERVER_OPTIMIZERS.create(
                self.server_optimizer,
                self.server_optimizer_params,
                where="aggregator.server_optimizer_params",
            )
        except RegistryError as exc:
            raise ValueError(str(exc)) from None
        own_step = self.name in AGGREGATORS and AGGREGATORS.entry(self.name).traits.get("own_step")
        if self.server_optimizer != "sgd" and own_step:
            raise ValueError(
                f"aggregator {self.name!r} takes its own server step: server_optimizer must be 'sgd', "
                f"not {self.server_optimizer!r}"
            )
        return self


class ClientCfg(TrainSettings):
    """The clients' local training (the fields of :class:`~felix.client.settings.TrainSettings`,
    which the trainer's own settings share), their objective and where their buffers live."""

    objective: str = "ce"
    objective_params: dict[str, Any] = Field(default_factory=dict)
    buffers: Buffers = buffers_field()
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


class DaflPlannerCfg(StrictModel):
    """Every constant of the DAFL paper's Problem 1 and Algorithm 1, declared once: the config's
    ``dafl`` section, the planner's parameters (``felix.strategies.dataplans.dafl.DaflParams``)
    and the ``felix plan-augmentation`` options all derive from it. Defaults are the paper's
    experiment settings (Sec. VI)."""

    lambda1: float = Field(1.0, ge=0, description="weight of the estimated training time T_t in P")
    lambda2: float = Field(
        100.0, ge=0, description="weight of the estimated augmentation time T_a in P (paper: 1e2, 1e3, 1e4)"
    )
    tau: float = Field(
        1e-3, ge=0, description="largest tolerated global class imbalance J after augmentation"
    )
    epsilon: float = Field(
        1e-3,
        gt=0,
        description="bound on the I-dependent term of the convergence bound; rounds ~ (1 + ...)/epsilon",
    )
    step: int = Field(
        1, ge=1, strict=True, description="s: samples added per greedy step; larger is faster and coarser"
    )
    zeta: float = Field(1.0, ge=0, description="relative time for a client to augment one sample (eq. 16)")
    zeta_prime: float = Field(
        2.0, gt=0, description="relative time for a client to train on one sample, per round (eq. 17)"
    )
    local_updates: int = Field(
        2, ge=1, strict=True, description="E in the time model's (E-1)^2 L^2CG^2 I term"
    )
    smoothness: float = Field(1.0, ge=0, description="L^2 C G^2, set to 1 in the paper")

    @model_validator(mode="after")
    def _exact_balance(self) -> DaflPlannerCfg:
        if self.tau == 0 and self.step != 1:
            raise ValueError("tau = 0 needs step = 1: with larger steps exact balance may be unreachable")
        return self


class DaflCfg(DaflPlannerCfg):
    """Planner and augmentation settings for ``data_plan: lb | dafl``. ``zeta`` / ``zeta_prime``
    are relative per-sample augmentation / training times: the planner weighs with them, and the
    simulator charges a client ``zeta / zeta_prime`` of its per-sample training time for each
    sample it augments. LB uses ``tau``, ``step`` and ``augmenter``."""

    augmenter: str = Field("rotate_flip", description="felix.strategies.dataplans.augment.AUGMENTERS name")


class RunCfg(StrictModel):
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
    workers: int = Field(
        1,
        ge=1,
        description="simulator: threads that train clients side by side, each on one torch thread "
        "(felix.client.workers): a live cohort split in shares, or clients that train one at a "
        "time trained a few at once, groups of eval tasks and the global evaluation's test batches; "
        "the same results as one worker at run.threads 1, for any count",
    )
    executor: Literal["local", "ray"] = Field(
        "local",
        description="where cohorts train: local = in this process; ray = split over Ray actors "
        "(felix.sim.ray_cohorts, extra felix-fl[ray]), with the same results",
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
        description="MLflow tracking URI for log_to mlflow (null: a SQLite store, <run folder>/mlflow.db)",
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


class Config(StrictModel):
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
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    selector: PolicyCfg = PolicyCfg(name="random")
    eval_selector: PolicyCfg = PolicyCfg(name="none")
    aggregator: AggregatorCfg = AggregatorCfg()
    validation: ValidationConfig = ValidationConfig()
    client: ClientCfg = ClientCfg()
    run: RunCfg = RunCfg()
    stream: StreamCfg = StreamCfg()
    privacy: PrivacyCfg = Field(PrivacyCfg(), description="user-level differential privacy (docs/privacy.md)")
    secure_aggregation: SecureAggregationCfg = Field(
        SecureAggregationCfg(),
        description="the server learns only sums of groups of updates (docs/privacy.md)",
    )

    @model_serializer(mode="wrap")
    def _without_stream_off(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
        """Leave ``stream`` and ``privacy`` out of a run's written config while they are off, so
        that the configs of runs without them read exactly as they did before they existed."""
        out = handler(self)
        if isinstance(out, dict) and not self.stream.enabled:
            out.pop("stream", None)
        if isinstance(out, dict) and not self.privacy.enabled:
            out.pop("privacy", None)
        if isinstance(out, dict) and not self.secure_aggregation.enabled:
            out.pop("secure_aggregation", None)
        return out

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        """Old keys under their new names (``felix.core.key_aliases``): a config file, or a finished
        run's ``config.json``, written before a key was renamed."""
        return renamed(data) if isinstance(data, dict) else data

    @field_validator("model")
    @classmethod
    def _model(cls, v: str) -> str:
        return registered("felix.scenario.models", "MODELS", v)

    @field_validator("data_plan")
    @classmethod
    def _data_plan(cls, v: str) -> str:
        check_component("felix.core.dataplan", "DATA_PLANS", v, keep_key=False)
        return v

    @model_validator(mode="after")
    def _components(self) -> Config:
        """Each strategy component's ``params`` by the component's own model (its registry); here,
        not on the sections, so that importing the config (which builds default sections) stays
        free of torch."""
        o, c = self.orchestrator, self.client
        for module, registry, name, params, where in (
            (
                "felix.strategies.objectives",
                "OBJECTIVES",
                c.objective,
                c.objective_params,
                "client.objective_params",
            ),
            (
                "felix.core.rounds",
                "ROUND_POLICIES",
                o.round_policy,
                o.round_policy_params,
                "orchestrator.round_policy_params",
            ),
            (
                "felix.core.availability",
                "AVAILABILITY",
                o.availability,
                o.availability_params,
                "orchestrator.availability_params",
            ),
            (
                "felix.core.selection",
                "TRAIN_SELECTORS",
                self.selector.name,
                self.selector.params,
                "selector.params",
            ),
            (
                "felix.core.eval_selection",
                "EVAL_SELECTORS",
                self.eval_selector.name,
                self.eval_selector.params,
                "eval_selector.params",
            ),
            (
                "felix.core.aggregation",
                "AGGREGATORS",
                self.aggregator.name,
                self.aggregator.params,
                "aggregator.params",
            ),
        ):
            check_component(module, registry, name, params, where)
        return self

    @model_validator(mode="after")
    def _scenario_params(self) -> Config:
        """Each scenario part's keyword parameters by the part's own model (its registry's
        ``check_params``), so a misspelt key fails here rather than when the run is built."""
        for module, registry, ref, params in (
            ("felix.scenario.models", "MODELS", self.model, self.model_params),
            ("felix.scenario.datasets", "DATASETS", self.dataset.name, self.dataset.params),
            ("felix.scenario.partition", "PARTITIONERS", self.partition.kind, self.partition.params),
            ("felix.scenario.traces", "TRACES", self.trace.kind, self.trace.params),
        ):
            check_part_params(module, registry, ref, params)
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
        if self.client.probe_loss:
            # declared by the aggregators (their registry entry's reads_aux), not a test of names
            from felix.core.aggregation import AGGREGATORS

            if "qffl_loss" not in AGGREGATORS.entry(self.aggregator.name).traits.get("reads_aux", ()):
                readers = ", ".join(repr(n) for n in AGGREGATORS.having("reads_aux", "qffl_loss"))
                raise ValueError(
                    f"client.probe_loss sends aux qffl_loss, which only aggregator {readers} reads "
                    f"(aggregator is {self.aggregator.name!r})"
                )
        check_privacy(self)
        check_secure_aggregation(self)
        return self


def validate(raw: dict[str, Any], source: str = "config") -> Config:
    """``raw`` as a :class:`Config`; a bad tree is one :class:`ConfigError` that names each bad key
    by its dotted path, in felix's words (one line when one key is wrong)."""
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as exc:
        lines = [
            ".".join(str(x) for x in err["loc"]) + ": " + _problem(err) if err["loc"] else _problem(err)
            for err in exc.errors()
        ]
        if len(lines) == 1:
            raise ConfigError(f"{source}: {lines[0]}") from None
        raise ConfigError(
            f"{source}: invalid configuration\n" + "\n".join(f"  {line}" for line in lines)
        ) from None
    o = cfg.orchestrator
    unread = o.unread_settings()
    if unread:
        # A warning, not an error: one --set for several strategies (felix compare --strategies
        # fedbuff,oort --set orchestrator.concurrency=4) legitimately sets what some do not read.
        log.warning(
            "%s: round policy %r does not use orchestrator.%s (it reads %s)",
            source,
            o.round_policy,
            ", orchestrator.".join(unread),
            ", ".join(ROUND_POLICIES.entry(o.round_policy).traits["reads"]),
        )
    return cfg


#: pydantic error types whose own message would read as pydantic's: what the key expects.
_EXPECTED = {
    "float_parsing": "a number",
    "float_type": "a number",
    "int_parsing": "a whole number",
    "int_type": "a whole number",
    "int_from_float": "a whole number",
    "bool_parsing": "true or false",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list, e.g. [a, b]",
    "dict_type": "a mapping, e.g. {key: value}",
    "model_type": "a mapping of keys, e.g. {key: value}",
}


def _problem(err: Any) -> str:
    """One validation error in felix's words: an unknown key with the nearest known one, a value of
    the wrong kind with what the key expects, and otherwise the validator's own message."""
    if err["type"] == "extra_forbidden":
        return unknown_key(str(err["loc"][-1]), _known_keys(err["loc"][:-1]))
    if err["type"] in _EXPECTED:
        return f"expected {_EXPECTED[err['type']]}, got {err['input']!r}"
    return str(err["msg"]).removeprefix("Value error, ")


def _known_keys(loc: tuple[Any, ...]) -> list[str]:
    """The keys the section at ``loc`` accepts (none where it is not a config section)."""
    model: Any = Config
    for part in loc:
        if not isinstance(part, str):
            continue  # a list index
        field = (
            model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        )
        if field is None:
            return []
        model = _section(field.annotation)
    return list(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else []


def _section(annotation: Any) -> Any:
    """The model class inside an annotation (``X``, ``X | None``, ``list[X]``), else the annotation."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _section(arg)
        if isinstance(found, type) and issubclass(found, BaseModel):
            return found
    return annotation
