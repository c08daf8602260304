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
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from felix.client.cohort import CohortTrainer, resolve_cohort
from felix.client.trainer import ClientData, LocalTrainer, TrainConfig, autocast
from felix.config import Config, ConfigError
from felix.core.orchestrator import Knowledge, Orchestrator, OrchestratorConfig
from felix.core.policies import Aggregator, EvalSelector, TrainSelector
from felix.core.validation import UpdateValidator, ValidationConfig
from felix.metrics.recorder import Recorder
from felix.scenario.datasets import ArrayDataset, DatasetError, first_classes, load_dataset
from felix.scenario.locations import dataset_root, trace_file
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
from felix.strategies.dataplans.plans import DataPlanRun, prepare_data_plan
from felix.strategies.objectives import OBJECTIVES, Objective, make_objective

log = logging.getLogger("felix.scenario.build")

# Stream ids under the run seed: scenario streams never depend on the strategy.
_PARTITION, _TRACE, _RUNTIME, _MODEL, _STRATEGY = range(5)


def _stream(seed: int, which: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, which]))


# ---------------------------------------------------------------------- policy registries
def _random_selector(params: dict[str, Any], cfg: Config) -> TrainSelector:
    from felix.strategies.selection.random import RandomSelector

    if params:
        raise ConfigError(f"selector 'random' takes no params, got {sorted(params)}")
    return RandomSelector()


def _fedavg(cfg: Config) -> Aggregator:
    from felix.strategies.aggregation.fedavg import FedAvgAggregator

    a = cfg.aggregator
    return FedAvgAggregator(a.server_lr, a.normalize, a.clip_norm, **a.params)


def _fedbuff(cfg: Config) -> Aggregator:
    from felix.strategies.aggregation.fedavg import FedBuffAggregator

    a = cfg.aggregator
    return FedBuffAggregator(a.server_lr, a.normalize, a.clip_norm, **a.params)


def _oort_params(params: dict[str, Any]) -> Any:
    """``base`` picks Oort's own defaults, the FeLiX authors' numbers or FedScale's; other keys override fields."""
    from dataclasses import replace

    from felix.strategies.selection.oort import OortParams

    params = dict(params)
    base = params.pop("base", "felix_authors")
    bases = {"oort": OortParams, "felix_authors": OortParams.felix_authors, "fedscale": OortParams.fedscale}
    if base not in bases:
        raise ConfigError(f"selector.params.base must be one of {sorted(bases)}, not {base!r}")
    return replace(bases[base](), **params)


def _oort_selector(params: dict[str, Any], cfg: Config) -> TrainSelector:
    from felix.strategies.selection.oort import OortSelector

    params = dict(params)
    reward_cap = params.pop("reward_cap", None)
    if reward_cap is None and cfg.client.max_steps is not None:
        reward_cap = cfg.client.max_steps * cfg.client.batch_size
    return OortSelector(_oort_params(params), reward_cap=reward_cap)


def _refl_selector(params: dict[str, Any], cfg: Config) -> TrainSelector:
    from felix.strategies.selection.refl import ReflIPSParams, ReflIPSSelector

    params = dict(params)
    inner = params.pop("oort", None)
    oort = None if inner is None else _oort_selector(inner, cfg)
    return ReflIPSSelector(ReflIPSParams(**params), oort)


def _tierselect_eval(params: dict[str, Any], cfg: Config) -> EvalSelector:
    from felix.strategies.selection.tierselect import TierSelectEval, TierSelectEvalParams

    return TierSelectEval(cfg.orchestrator.agg_goal, TierSelectEvalParams(**params))


def _tierfuse(cfg: Config) -> Aggregator:
    from felix.strategies.aggregation.tierfuse import TierFuseAggregator, TierFuseParams

    a = cfg.aggregator
    return TierFuseAggregator(TierFuseParams(**a.params), a.server_lr, a.normalize, a.clip_norm)


def _refl_saa(cfg: Config) -> Aggregator:
    from felix.strategies.aggregation.refl_saa import ReflSAAAggregator, ReflSAAParams

    a = cfg.aggregator
    return ReflSAAAggregator(ReflSAAParams(**a.params), a.server_lr, a.clip_norm)


def _qffl(cfg: Config) -> Aggregator:
    """q-FFL reads each client's loss at the received model from aux ``qffl_loss`` when a client
    sends it, else the mean local training loss (biased low; see QFFLAggregator)."""
    from felix.strategies.aggregation.qffl import QFFLAggregator

    params = {"lipschitz": 1.0 / cfg.client.lr, **cfg.aggregator.params}
    return QFFLAggregator(**params)


SELECTORS: dict[str, Callable[[dict[str, Any], Config], TrainSelector]] = {
    "random": _random_selector,
    "oort": _oort_selector,
    "refl_ips": _refl_selector,
}
EVAL_SELECTORS: dict[str, Callable[[dict[str, Any], Config], EvalSelector]] = {
    "none": lambda params, cfg: EvalSelector(),
    "tierselect": _tierselect_eval,
}
AGGREGATORS: dict[str, Callable[[Config], Aggregator]] = {
    "fedavg": _fedavg,
    "fedbuff": _fedbuff,
    "tierfuse": _tierfuse,
    "refl_saa": _refl_saa,
    "qffl": _qffl,
}


def _make(registry: dict[str, Callable[..., Any]], kind: str, name: str, *args: Any) -> Any:
    if name not in registry:
        raise ConfigError(f"{kind}.name: unknown {kind} {name!r}; choose one of {sorted(registry)}")
    try:
        return registry[name](*args)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{kind} {name!r}: {exc}") from None


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
        return load_mobiperf(trace_file(t.path), t.series)  # type: ignore[arg-type]
    return load_fedscale(trace_file(t.path))  # type: ignore[arg-type]


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


def _root(root: str | None, download: bool) -> str | None:
    """``dataset.root`` as found (a relative one under $FELIX_DATA); a missing one is an error unless
    the dataset may be downloaded."""
    if root is None:
        return None
    try:
        return str(dataset_root(root))
    except DatasetError:
        if download:
            return root
        raise


def build_population(cfg: Config) -> Population:
    d = cfg.dataset
    train, test = _dataset(d.name, _root(d.root, d.download), d.download, d.per_class_limit, d.num_classes)
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
    c = cfg.client
    params = dict(c.objective_params)
    if c.objective == "scaffold":
        params.setdefault("num_clients", cfg.partition.num_clients)  # SCAFFOLD's N
    try:
        return make_objective(c.objective, **params)
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


def build_orchestrator(cfg: Config, weights: np.ndarray, trace: AvailabilityTrace | None) -> Orchestrator:
    o = cfg.orchestrator
    ocfg = OrchestratorConfig(
        mode=o.mode, agg_goal=o.agg_goal, concurrency=o.concurrency, overcommit=o.overcommit,
        deadline_s=o.deadline_s, cancel_stragglers=o.cancel_stragglers, task_timeout_s=o.task_timeout_s,
        accept_late=o.accept_late, max_staleness=o.max_staleness, knowledge=Knowledge(o.knowledge),
    )
    selector = _make(SELECTORS, "selector", cfg.selector.name, dict(cfg.selector.params), cfg)
    eval_selector = _make(EVAL_SELECTORS, "eval_selector", cfg.eval_selector.name, dict(cfg.eval_selector.params), cfg)
    aggregator = _make(AGGREGATORS, "aggregator", cfg.aggregator.name, cfg)
    if cfg.aggregator.robust != "none":
        from felix.strategies.aggregation.robust import RobustAggregator

        aggregator = RobustAggregator(aggregator, cfg.aggregator.robust, cfg.aggregator.trim_fraction)
    validator = build_validator(cfg, aggregator, int(weights.size))
    if ocfg.knowledge is Knowledge.ORACLE and trace is None:
        raise ConfigError("orchestrator.knowledge 'oracle' needs an availability trace")
    oracle = trace if ocfg.knowledge is Knowledge.ORACLE else None
    return Orchestrator(ocfg, weights, selector, aggregator, _stream(cfg.seed, _STRATEGY), eval_selector, oracle,
                        validator)


def build_validator(cfg: Config, aggregator: Aggregator, num_params: int) -> UpdateValidator:
    """Update validation with the aux entries the configured objective and aggregator declare."""
    try:
        objective = OBJECTIVES[cfg.client.objective]
    except KeyError:
        raise ConfigError(f"client.objective: unknown objective {cfg.client.objective!r}; "
                          f"choose one of {sorted(OBJECTIVES)}") from None
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
    data_plan = prepare_data_plan(cfg, pop.client_data, pop.train.num_classes, runtimes)
    if data_plan is not None:
        orch.set_data_plan(data_plan.rows)
    devices = make_devices(pop.client_data, runtimes, trace.for_client)
    r = cfg.run
    settings = SimSettings(seed=cfg.seed, max_time_s=r.max_time_s, max_aggregations=r.max_aggregations,
                           stop_at_target=r.stop_at_target, eval_fraction=cfg.runtime.eval_fraction,
                           cohort_size=cohort_size, min_cohort=min_cohort)
    sim = Simulation(orch, devices, trainer, recorder, settings,
                     augment=None if data_plan is None else data_plan.applier, cohort=executor)
    return Built(cfg, sim, orch, recorder, trace, pop, data_plan)
