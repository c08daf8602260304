"""Turn a validated ``Config`` into a ready simulation: data, population, traces, policies.

The scenario's random streams (partition, traces, runtimes, model init) are derived from the
seed independently of the strategy's stream, so every strategy of a comparison sees exactly the
same clients, data and availability.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from felix.client.cohort import CohortTrainer, resolve_cohort
from felix.client.trainer import ClientData, LocalTrainer, TrainConfig, autocast
from felix.config import Config, ConfigError
from felix.core.availability import AVAILABILITY
from felix.core.orchestrator import Orchestrator, OrchestratorConfig
from felix.core.policies import AGGREGATORS, EVAL_SELECTORS, TRAIN_SELECTORS, Aggregator
from felix.core.registry import Registry, RegistryError
from felix.core.rounds import ROUND_POLICIES
from felix.core.validation import UpdateValidator, ValidationConfig
from felix.metrics.recorder import Recorder
from felix.scenario.datasets import ArrayDataset, first_classes, load_dataset
from felix.scenario.models import make_model
from felix.scenario.partition import count_table_partition, dirichlet_partition
from felix.scenario.profiles import FELIX_HALFNORMAL_SCALE, halfnormal_runtimes, uniform_runtimes
from felix.scenario.traces import (
    AvailabilityTrace,
    always_available,
    load_fedscale,
    load_mobiperf,
    slotted_churn,
)
from felix.sim.engine import CohortExecutor, SimSettings, Simulation, make_devices
from felix.strategies.dataplans.plans import DataPlanRun, build_data_plan, prepare_data_plan
from felix.strategies.dataplans.policy import PlannedDataPlan
from felix.strategies.objectives import Objective, make_objective, objective_class, objective_params_model

log = logging.getLogger("felix.scenario.build")

# Stream ids under the run seed: scenario streams never depend on the strategy.
_PARTITION, _TRACE, _RUNTIME, _MODEL, _STRATEGY = range(5)


def _stream(seed: int, which: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, which]))


# ---------------------------------------------------------------------- policies
def _create(registry: Registry[Any], name: str, params: Any, where: str, ctx: Any) -> Any:
    """A policy from its registry (``felix.core.registry``), its errors as ``ConfigError``."""
    try:
        return registry.create(name, params, ctx, where=where)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


# ---------------------------------------------------------------------- scenario parts
@functools.lru_cache(maxsize=4)
def _dataset(name: str, root: str | None, download: bool, limit: int | None,
             num_classes: int | None = None) -> tuple[ArrayDataset, ArrayDataset]:
    train, test = load_dataset(name, root, download, limit)
    if num_classes is not None:
        if num_classes > train.num_classes:
            raise ConfigError(f"dataset.num_classes is {num_classes} but {name} has {train.num_classes} classes")
        train, test = first_classes(train, num_classes), first_classes(test, num_classes)
    return train, test


def partition_indices(cfg: Config, labels: np.ndarray, num_classes: int) -> list[np.ndarray]:
    p = cfg.partition
    rng = _stream(cfg.seed, _PARTITION)
    if p.kind == "dirichlet":
        return dirichlet_partition(labels, p.num_clients, p.alpha, rng, p.min_samples)
    if p.kind == "iid":
        return [np.sort(s) for s in np.array_split(rng.permutation(len(labels)), p.num_clients)]
    table = np.array(p.table, dtype=np.int64)
    if table.shape[1] != num_classes:
        raise ConfigError(f"partition.table has {table.shape[1]} classes, the dataset {num_classes}")
    if table.shape[0] != p.num_clients:
        raise ConfigError(f"partition.table has {table.shape[0]} rows but partition.num_clients is {p.num_clients}")
    try:
        return count_table_partition(labels, table, rng)
    except ValueError as exc:
        raise ConfigError(f"partition.table: {exc}") from None


def build_trace(cfg: Config) -> AvailabilityTrace:
    """The scenario's availability, from ``trace.offset_s`` seconds into it."""
    return _base_trace(cfg).shifted(cfg.trace.offset_s)


def _base_trace(cfg: Config) -> AvailabilityTrace:
    t = cfg.trace
    n = cfg.partition.num_clients
    if t.kind == "always":
        return always_available(1)
    if t.kind == "slotted":
        return slotted_churn(n, t.unavailable_fraction, _stream(cfg.seed, _TRACE), t.slot_s, t.horizon_s)
    if t.kind == "mobiperf":
        return load_mobiperf(t.path, t.series)  # type: ignore[arg-type]
    return load_fedscale(t.path)  # type: ignore[arg-type]


def build_runtimes(cfg: Config, sizes: list[int] | None = None) -> np.ndarray:
    """Per-client task runtimes; ``per_sample`` needs the clients' sample counts ``sizes``."""
    r = cfg.runtime
    n = cfg.partition.num_clients
    if r.kind == "per_sample":
        if sizes is None:
            raise ConfigError("runtime.kind 'per_sample' needs the clients' sample counts")
        return r.seconds_per_sample * np.asarray(sizes, dtype=np.float64)
    rng = _stream(cfg.seed, _RUNTIME)
    if r.kind == "halfnormal":
        return halfnormal_runtimes(n, rng, r.scale_s or FELIX_HALFNORMAL_SCALE, r.min_s)
    if r.kind == "constant":
        return np.full(n, r.constant_s)
    return uniform_runtimes(n, rng, r.low_s, r.high_s)


def make_evaluator(model: torch.nn.Module, test: ArrayDataset, device: str, batch_size: int = 1000,
                   autocast_dtype: torch.dtype | None = None) -> Callable[[np.ndarray], tuple[float, float]]:
    """The global model's test accuracy and loss. The test set is copied to ``device`` once; the
    sums stay there, one transfer per evaluation."""
    model = model.to(device)
    params = list(model.parameters())
    x, y = test.x.to(device), test.y.to(device)

    @torch.no_grad()
    def evaluate(weights: np.ndarray) -> tuple[float, float]:
        vector_to_parameters(torch.from_numpy(np.array(weights, dtype=np.float32)).to(device), params)
        model.eval()
        correct = torch.zeros((), dtype=torch.long, device=device)
        loss = torch.zeros((), device=device)
        for s in range(0, len(test), batch_size):
            xb, yb = x[s:s + batch_size], y[s:s + batch_size]
            with autocast(device, autocast_dtype):
                logits = model(xb).float()
            loss += F.cross_entropy(logits, yb, reduction="sum")
            correct += (logits.argmax(1) == yb).sum()
        return int(correct.cpu()) / len(test), float(loss.cpu()) / len(test)

    return evaluate


def apply_threads(cfg: Config) -> None:
    """``run.threads`` for this process (runs, ``felix compare`` workers and benchmarks all build
    through here): results and speed must not depend on the machine's core count."""
    if cfg.run.threads is not None and torch.get_num_threads() != cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)


def apply_precision(cfg: Config) -> torch.dtype | None:
    """``run.precision``: TF32 matmuls (CUDA) or the bf16 autocast dtype; fp32 changes nothing."""
    on_cuda = str(cfg.run.device).startswith("cuda")
    if on_cuda:
        tf32 = cfg.run.precision == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    return torch.bfloat16 if cfg.run.precision == "bf16" else None


@dataclass
class Population:
    """The scenario side of a run, shared by the simulator and the deployment's server/clients."""

    train: ArrayDataset
    test: ArrayDataset
    client_data: list[ClientData]
    initial_weights: np.ndarray
    model: torch.nn.Module


def build_population(cfg: Config) -> Population:
    d = cfg.dataset
    train, test = _dataset(d.name, d.root, d.download, d.per_class_limit, d.num_classes)
    if d.test_limit is not None and d.test_limit < len(test):
        # Folder datasets list the test set class by class: take a class-balanced subset, not a prefix.
        per_class = -(-d.test_limit // test.num_classes)
        y = test.y.numpy()
        keep = np.sort(np.concatenate([np.flatnonzero(y == c)[:per_class] for c in range(test.num_classes)]))
        test = test.subset(keep[: d.test_limit] if len(keep) > d.test_limit else keep)
    parts = partition_indices(cfg, train.y.numpy(), train.num_classes)
    datas = [ClientData(train.x[torch.as_tensor(ix)], train.y[torch.as_tensor(ix)]) for ix in parts]
    seed = int(_stream(cfg.seed, _MODEL).integers(2**31))
    try:
        model = make_model(cfg.model, train.sample_shape, train.num_classes, seed=seed)
    except ValueError as exc:
        raise ConfigError(f"model: {exc}") from None
    weights = parameters_to_vector(model.parameters()).detach().numpy().copy()
    return Population(train, test, datas, weights, model)


def build_objective(cfg: Config) -> Objective:
    """The client objective, its ``objective_params`` validated against the objective's own typed
    parameters (``objective_params_model``): a misspelt key fails with its dotted path."""
    c = cfg.client
    params = dict(c.objective_params)
    if c.objective == "scaffold":
        params.setdefault("num_clients", cfg.partition.num_clients)  # SCAFFOLD's N
    try:
        typed = objective_params_model(c.objective).model_validate(params)
    except ValueError as exc:
        if not isinstance(exc, ValidationError):
            raise ConfigError(f"client.objective: {exc}") from None
        raise ConfigError("; ".join(
            f"client.objective_params.{'.'.join(str(x) for x in e['loc'])}: "
            f"{'unknown key' if e['type'] == 'extra_forbidden' else e['msg']}" for e in exc.errors())) from None
    try:
        return make_objective(c.objective, **typed.model_dump(exclude_unset=True))
    except ValueError as exc:
        raise ConfigError(f"client: {exc}") from None


def build_trainer(cfg: Config, pop: Population) -> LocalTrainer:
    apply_threads(cfg)
    c = cfg.client
    try:
        tcfg = TrainConfig(c.lr, c.batch_size, c.epochs, c.max_steps, c.momentum, c.weight_decay, c.drop_last, c.optimizer)
    except ValueError as exc:
        raise ConfigError(f"client: {exc}") from None
    objective = build_objective(cfg)
    if getattr(objective, "fixed_batch", False) and not tcfg.drop_last:
        tcfg = dataclasses.replace(tcfg, drop_last=True)  # FedeRage's model mini-batch b is fixed
    return LocalTrainer(copy.deepcopy(pop.model), objective, tcfg, pop.train.num_classes, cfg.run.device,
                        apply_precision(cfg))


def build_cohort(cfg: Config, trainer: LocalTrainer,
                 sample_shape: tuple[int, ...]) -> tuple[CohortTrainer | None, int, int]:
    """The cohort trainer ``run.cohort`` asks for (None: sequential), its size and smallest cohort."""
    size, min_k = resolve_cohort(cfg.run.cohort, trainer.model, trainer.objective, cfg.run.device, sample_shape)
    if size == 1:
        return None, 1, 1
    # Its own objective instance: the sequential trainer's keeps per-task attributes.
    objective = build_objective(cfg)
    cohort = CohortTrainer(copy.deepcopy(trainer.model), objective, trainer.cfg, trainer.num_classes,
                           cfg.run.device, trainer.autocast_dtype)
    return cohort, size, min_k


def build_executor(cfg: Config, cohort: CohortTrainer | None, datas: list[ClientData]) -> CohortExecutor | None:
    """``run.executor``: the cohort trainer itself (local), or Ray actors training its cohorts."""
    if cfg.run.executor == "local" or cohort is None:
        if cfg.run.executor == "ray":
            log.warning("run.executor ray: this run trains one client at a time (run.cohort), so no actors start")
        return cohort
    from felix.distributed.cohort_executor import RayCohortExecutor

    return RayCohortExecutor(cohort, datas, cfg.run.ray_actors, cfg.run.ray_address, cfg.run.threads)


def build_orchestrator(cfg: Config, weights: np.ndarray,
                       trace: AvailabilityTrace | Callable[[], AvailabilityTrace] | None,
                       plan_errors: str = "raise") -> Orchestrator:
    """The orchestrator with the config's policies, each looked up in its registry by name (or
    import path) with its parameters validated. ``trace`` (or a function making it, called only
    then) is the oracle of an availability policy that reads one; ``plan_errors`` as
    ``PlanSetup.on_error``."""
    o = cfg.orchestrator
    try:
        ocfg = OrchestratorConfig(
            mode=o.mode, agg_goal=o.agg_goal, concurrency=o.concurrency, overcommit=o.overcommit,
            deadline_s=o.deadline_s, cancel_stragglers=o.cancel_stragglers, task_timeout_s=o.task_timeout_s,
            accept_late=o.accept_late, max_staleness=o.max_staleness, knowledge=o.knowledge,
            mode_params=o.mode_params, knowledge_params=o.knowledge_params,
        )
        rounds = ROUND_POLICIES.create(o.mode, o.mode_params, ocfg, where="orchestrator.mode_params")
        availability = AVAILABILITY.create(o.knowledge, o.knowledge_params, ocfg, where="orchestrator.knowledge_params")
    except RegistryError as exc:
        raise ConfigError(str(exc)) from None
    except ValueError as exc:
        raise ConfigError(f"orchestrator: {exc}") from None
    selector = _create(TRAIN_SELECTORS, cfg.selector.name, cfg.selector.params, "selector.params", cfg)
    eval_selector = _create(EVAL_SELECTORS, cfg.eval_selector.name, cfg.eval_selector.params,
                            "eval_selector.params", cfg)
    aggregator = _create(AGGREGATORS, cfg.aggregator.name, cfg.aggregator.params, "aggregator.params", cfg)
    if cfg.aggregator.robust != "none":
        from felix.strategies.aggregation.robust import RobustAggregator

        aggregator = RobustAggregator(aggregator, cfg.aggregator.robust, cfg.aggregator.trim_fraction)
    validator = build_validator(cfg, aggregator, int(weights.size))
    oracle = None
    if availability.needs_oracle:
        oracle = trace() if callable(trace) else trace
        if oracle is None:
            raise ConfigError(f"orchestrator.knowledge {o.knowledge!r} needs an availability trace")
    return Orchestrator(ocfg, weights, selector, aggregator, _stream(cfg.seed, _STRATEGY), eval_selector, oracle,
                        validator, build_data_plan(cfg, plan_errors), rounds, availability)


def build_validator(cfg: Config, aggregator: Aggregator, num_params: int) -> UpdateValidator:
    """Update validation with the aux entries the configured objective and aggregator declare."""
    try:
        objective = objective_class(cfg.client.objective)
    except ValueError as exc:
        raise ConfigError(f"client.objective: {exc}") from None
    v = cfg.validation
    try:
        c = cfg.client
        vcfg = ValidationConfig(v.max_samples_factor, v.norm_policy, v.norm_factor, v.norm_window,
                                v.norm_min_history, v.warmup_factor, c.batch_size, c.epochs, c.max_steps)
    except ValueError as exc:
        raise ConfigError(f"validation: {exc}") from None
    spec = {**objective.declared_aux(num_params), **aggregator.declared_aux(num_params)}
    return UpdateValidator(vcfg, spec)


@dataclass
class Built:
    cfg: Config
    sim: Simulation
    orch: Orchestrator
    recorder: Recorder
    trace: AvailabilityTrace
    population: Population
    data_plan: DataPlanRun | None = None


def build(cfg: Config) -> Built:
    apply_threads(cfg)
    pop = build_population(cfg)
    trace = build_trace(cfg)
    runtimes = build_runtimes(cfg, [len(d) for d in pop.client_data])
    trainer = build_trainer(cfg, pop)
    cohort, cohort_size, min_cohort = build_cohort(cfg, trainer, tuple(pop.train.sample_shape))
    executor = build_executor(cfg, cohort, pop.client_data)
    evaluate = make_evaluator(copy.deepcopy(pop.model), pop.test, cfg.run.device,
                              autocast_dtype=trainer.autocast_dtype)
    recorder = Recorder(evaluate, cfg.run.target_accuracy, cfg.run.target_window, cfg.run.eval_every)
    orch = build_orchestrator(cfg, pop.initial_weights, trace)
    data_plan = prepare_data_plan(cfg, pop.client_data, pop.train.num_classes, runtimes,
                                  orch.data_plan if isinstance(orch.data_plan, PlannedDataPlan) else None)
    devices = make_devices(pop.client_data, runtimes, trace.for_client)
    r = cfg.run
    settings = SimSettings(seed=cfg.seed, max_time_s=r.max_time_s, max_aggregations=r.max_aggregations,
                           stop_at_target=r.stop_at_target, eval_fraction=cfg.runtime.eval_fraction,
                           cohort_size=cohort_size, min_cohort=min_cohort)
    sim = Simulation(orch, devices, trainer, recorder, settings,
                     augment=None if data_plan is None else data_plan.applier, cohort=executor)
    return Built(cfg, sim, orch, recorder, trace, pop, data_plan)
