"""Turn a validated ``Config`` into a run's parts: data, population, traces, runtimes, trainer,
policies. Shared by the simulator (``felix.sim.build`` assembles a simulation from these) and the
MQTT deployment, so nothing here imports either shell.

The population comes from the config (a registered or imported dataset, split by a partitioner)
or prepared by the caller (``ClientDatasets``: each client's samples and a test set; see
docs/python-api.md).

The scenario's random streams (partition, traces, runtimes, model init) are derived from the
seed independently of the strategy's stream, so every strategy of a comparison sees exactly the
same clients, data and availability.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from felix import cpu_kernels
from felix.client.trainer import ClientData, LocalTrainer, TrainConfig, autocast, one_thread, thread_invariant
from felix.client.weights import ModelWeights, model_vector, weights_for
from felix.config import Config, ConfigError, OrchestratorCfg, deep_merge, validate
from felix.core.admission import AdmissionConfig
from felix.core.availability import AVAILABILITY
from felix.core.orchestrator import Orchestrator, OrchestratorConfig
from felix.core.policies import AGGREGATORS, EVAL_SELECTORS, TRAIN_SELECTORS, Aggregator
from felix.core.registry import Registry, RegistryError
from felix.core.rounds import ROUND_POLICIES
from felix.core.types import Tier
from felix.core.validation import UpdateValidator, ValidationConfig
from felix.metrics.per_client import PerClientSetup, make_per_client_eval
from felix.metrics.recorder import Recorder
from felix.scenario.datasets import ArrayDataset, DatasetError, check_dataset, first_classes, load_dataset
from felix.scenario.locations import dataset_root
from felix.scenario.long_tail import long_tail_indices
from felix.scenario.models import ModelFactory, check_model, check_model_fits, make_model, model_ref
from felix.scenario.partition import partition
from felix.scenario.profiles import FELIX_HALFNORMAL_SCALE, halfnormal_runtimes, uniform_runtimes
from felix.scenario.random_access import ram_probabilities
from felix.scenario.traces import AvailabilityTrace, make_trace
from felix.strategies.dataplans.plans import build_data_plan
from felix.strategies.objectives import OBJECTIVES, Objective, objective_class

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
def _dataset(
    name: str,
    root: str | None,
    download: bool,
    limit: int | None,
    num_classes: int | None = None,
    params: str = "{}",
) -> tuple[ArrayDataset, ArrayDataset | None]:
    """Load (cached: a comparison's runs share one copy); ``params`` is ``dataset.params`` as JSON."""
    train, test = load_dataset(name, root, download, limit, json.loads(params))
    if num_classes is not None:
        if num_classes > train.num_classes:
            raise ConfigError(
                f"dataset.num_classes is {num_classes} but {name} has {train.num_classes} classes"
            )
        train = first_classes(train, num_classes)
        test = None if test is None else first_classes(test, num_classes)
    return train, test


def partition_indices(
    cfg: Config, labels: np.ndarray, num_classes: int, groups: np.ndarray | None = None
) -> list[np.ndarray]:
    """Each client's training-set indices, from the configured partitioner and the partition
    stream; ``groups``: each sample's speaker, for the partitioners that split by it."""
    p = cfg.partition
    rng = _stream(cfg.seed, _PARTITION)
    if p.imbalance == 1:
        return partition(p, labels, num_classes, rng, groups)
    # A long tail first (partition.imbalance): the split is of the kept subset.
    head = p.head_per_class or int(np.bincount(labels, minlength=num_classes).max())
    try:
        keep, _ = long_tail_indices(labels, num_classes, head, p.imbalance, rng)
    except ValueError as exc:
        raise ConfigError(f"partition: {exc}") from None
    kept_groups = None if groups is None else groups[keep]
    return [keep[ix] for ix in partition(p, labels[keep], num_classes, rng, kept_groups)]


def build_trace(cfg: Config, population: Population | None = None) -> AvailabilityTrace:
    """The scenario's availability, from ``trace.offset_s`` seconds into it; with the population,
    a builder that asks for them gets the clients' class counts (felix.scenario.traces)."""
    counts = None
    if population is not None:
        c = population.train.num_classes
        counts = np.stack([d.class_counts(c).numpy() for d in population.client_data])
    return make_trace(cfg.trace, cfg.partition.num_clients, _stream(cfg.seed, _TRACE), counts)


def participation_shares(
    cfg: Config, trace: AvailabilityTrace, class_counts: np.ndarray, samples: int = 200
) -> np.ndarray:
    """Per client, how likely it is to take part: the RAM's p_i under ``trace.kind: ram``, else
    the share of ``samples`` evenly spaced instants of the run at which its trace lets it train."""
    if cfg.trace.kind == "ram":
        return ram_probabilities(cfg.trace, len(class_counts), _stream(cfg.seed, _TRACE), class_counts)
    end = min(cfg.run.max_time_s, cfg.trace.horizon_s)
    instants = (np.arange(samples) + 0.5) * end / samples
    return np.array(
        [
            np.mean([trace.for_client(c).tier_at(float(t)) is Tier.AVL_TRAIN for t in instants])
            for c in range(len(class_counts))
        ]
    )


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


def make_evaluator(
    model: torch.nn.Module,
    test: ArrayDataset | None,
    device: str,
    batch_size: int = 1000,
    autocast_dtype: torch.dtype | None = None,
) -> Callable[[np.ndarray], tuple[float, float]]:
    """The global model's test accuracy and loss. The test set is copied to ``device`` once; the
    sums stay there, one transfer per evaluation. ``model`` must carry its factory's buffers: a
    parameters-only vector (``client.buffers: local``) is evaluated with them. Without a test set,
    the evaluator raises ``ConfigError`` when called.

    A model whose single-client work stays on one thread (:func:`thread_invariant`) is evaluated on
    one thread as well: MKL rounds the test set's ``[N, 784] x [784, 64]`` product differently on
    two threads, and a last-bit change of a logit can flip a tied prediction and so the time to a
    target; on one thread the evaluation gives the same bits at any ``run.threads``."""
    if test is None:

        def no_test_set(weights: np.ndarray) -> tuple[float, float]:
            raise ConfigError(
                "the dataset has no test set, but the run evaluates the global model: give the "
                "loader or the population a test set"
            )

        return no_test_set
    model = model.to(device)
    layouts: dict[int, ModelWeights] = {}
    x, y = test.x.to(device), test.y.to(device)
    single_thread = thread_invariant(model, device)

    @torch.no_grad()
    def evaluate(weights: np.ndarray) -> tuple[float, float]:
        with one_thread(single_thread):
            return _evaluate(weights)

    def _evaluate(weights: np.ndarray) -> tuple[float, float]:
        size = int(np.asarray(weights).size)
        if size not in layouts:
            layouts[size] = weights_for(model, size)
        layout = layouts[size]
        layout.load(torch.from_numpy(np.array(weights, dtype=np.float32)).to(device))
        layout.set_kept(None)
        model.eval()
        correct = torch.zeros((), dtype=torch.long, device=device)
        loss = torch.zeros((), device=device)
        for s in range(0, len(test), batch_size):
            xb, yb = x[s : s + batch_size], y[s : s + batch_size]
            with autocast(device, autocast_dtype):
                logits = model(xb).float()
            loss += F.cross_entropy(logits, yb, reduction="sum")
            correct += (logits.argmax(1) == yb).sum()
        return int(correct.cpu()) / len(test), float(loss.cpu()) / len(test)

    return evaluate


def apply_run_settings(cfg: Config) -> None:
    """``run.threads`` for this process, and ``run.device`` checked (runs, ``felix compare``
    workers and benchmarks all build through here, before any data is loaded): results and speed
    must not depend on the machine's core count, and a device torch cannot use here is a
    ``ConfigError`` at once. Also a warning if torch does not use the CPU kernels felix pins
    (:mod:`felix.cpu_kernels`)."""
    cpu_kernels.check()
    if cfg.run.threads is not None and torch.get_num_threads() != cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    check_device(cfg.run.device)


def check_device(device: str) -> None:
    """A ``ConfigError`` naming ``run.device`` when torch cannot allocate on it here (no CUDA build,
    no GPU visible, an index beyond the GPUs there are)."""
    dev = torch.device(device)  # the config validated the spelling
    if dev.type == "cpu":
        return
    try:
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"run.device {device!r} is not usable here: {reason}") from None


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
    """The scenario side of a run, shared by the simulator and the deployment's server/clients.
    ``initial_weights`` is the model's vector as it travels (``client.buffers``); ``test`` is None
    for a dataset without a test set; ``model`` keeps its factory's buffers."""

    train: ArrayDataset
    test: ArrayDataset | None
    client_data: list[ClientData]
    initial_weights: np.ndarray
    model: torch.nn.Module


@dataclass
class ClientDatasets:
    """A prepared population's data: each client's samples, the test set (None: none) and the
    class names. Build one with :meth:`from_arrays`, which checks it."""

    clients: list[ClientData]
    test: ArrayDataset | None
    classes: list[str]

    @classmethod
    def from_arrays(
        cls, clients: Sequence[Any], test: Any = None, classes: int | Sequence[str] | None = None
    ) -> ClientDatasets:
        """``clients``: one ``(x, y)`` pair (tensors or numpy arrays), ``ClientData`` or
        ``ArrayDataset`` per client, x of shape N x (sample shape), y integer labels; ``test``
        likewise, or None. ``classes``: their names, their number, or None (max label + 1).
        ``DatasetError`` says what does not fit."""
        if not clients:
            raise DatasetError("a population needs at least one client")
        pairs = [_pair(c, f"client {k}") for k, c in enumerate(clients)]
        test_pair = None if test is None else _pair(test, "test set")
        if classes is None:
            classes = 1 + max(
                int(y.max()) for _, y in pairs + ([test_pair] if test_pair else []) if y.numel()
            )
        names = [str(c) for c in range(classes)] if isinstance(classes, int) else [str(c) for c in classes]
        shape = tuple(pairs[0][0].shape[1:])
        for k, (x, y) in enumerate(pairs):
            check_dataset(ArrayDataset(x, y, names), f"client {k}")
            if tuple(x.shape[1:]) != shape:
                raise DatasetError(
                    f"client {k}: samples of shape {tuple(x.shape[1:])}, client 0's are {shape}"
                )
        test_set = None
        if test_pair is not None:
            test_set = ArrayDataset(test_pair[0], test_pair[1], names)
            check_dataset(test_set, "test set")
            if test_set.sample_shape != shape:
                raise DatasetError(
                    f"test set: samples of shape {test_set.sample_shape}, the clients' are {shape}"
                )
        return cls([ClientData(x, y) for x, y in pairs], test_set, names)


def _pair(d: Any, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(d, (ClientData, ArrayDataset)):
        x, y = d.x, d.y
    elif isinstance(d, (tuple, list)) and len(d) == 2:
        x, y = d
    else:
        raise DatasetError(
            f"{what}: expected an (x, y) pair, ClientData or ArrayDataset, got {type(d).__name__}"
        )
    try:
        xt = torch.as_tensor(x, dtype=torch.float32)
        yt = torch.as_tensor(y)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise DatasetError(f"{what}: x and y must be arrays or tensors ({exc})") from None
    if yt.is_floating_point() or yt.dtype == torch.bool:
        raise DatasetError(f"{what}: labels must be integers, got {yt.dtype}")
    return xt, yt.to(torch.int64)


def fit_config(cfg: Config, num_clients: int) -> Config:
    """``cfg`` with ``partition.num_clients`` set to a prepared population's size (runtimes, traces
    and the summary count clients from it); the config written with the run says what ran."""
    if cfg.partition.num_clients == num_clients:
        return cfg
    log.info(
        "partition.num_clients %d -> %d: the size of the prepared population",
        cfg.partition.num_clients,
        num_clients,
    )
    return validate(
        deep_merge(cfg.model_dump(), {"partition": {"num_clients": num_clients}}), "prepared population"
    )


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


def build_population(
    cfg: Config, data: ClientDatasets | None = None, model: nn.Module | ModelFactory | None = None
) -> Population:
    """The clients' data, the test set and the initial model. ``data`` replaces the configured
    dataset and partition (``dataset.test_limit`` still applies); ``model`` replaces ``cfg.model``:
    a factory (seeded by the run's model stream, as the registered ones) or a module, whose current
    weights are then the initial ones."""
    d = cfg.dataset
    if data is None:
        train, test = _dataset(
            d.name,
            _root(d.root, d.download),
            d.download,
            d.per_class_limit,
            d.num_classes,
            json.dumps(d.params, sort_keys=True, default=str),
        )
        groups = None if train.groups is None else train.groups.numpy()
        parts = partition_indices(cfg, train.y.numpy(), train.num_classes, groups)
        # One gather into client order; each client's data is a row slice of it, so a cohort
        # trainer's data pool adopts the whole without copying it again (cohort.DataPool).
        order = torch.as_tensor(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))
        xs, ys = train.x.index_select(0, order), train.y.index_select(0, order)
        ends = np.cumsum([len(ix) for ix in parts]).tolist()
        datas = [ClientData(xs[a:b], ys[a:b]) for a, b in zip([0, *ends[:-1]], ends)]
    else:
        datas, test = data.clients, data.test
        train = ArrayDataset(torch.cat([c.x for c in datas]), torch.cat([c.y for c in datas]), data.classes)
    if test is not None and d.test_limit is not None and d.test_limit < len(test):
        # Folder datasets list the test set class by class: take a class-balanced subset, not a prefix.
        per_class = -(-d.test_limit // test.num_classes)
        y = test.y.numpy()
        keep = np.sort(np.concatenate([np.flatnonzero(y == c)[:per_class] for c in range(test.num_classes)]))
        test = test.subset(keep[: d.test_limit] if len(keep) > d.test_limit else keep)
    if isinstance(model, nn.Module):
        ref = type(model).__name__
        check_model(model, ref)
        net = copy.deepcopy(model)
    else:
        ref = model_ref(cfg.model if model is None else model)
        seed = int(_stream(cfg.seed, _MODEL).integers(2**31))
        net = make_model(
            cfg.model if model is None else model,
            train.sample_shape,
            train.num_classes,
            seed=seed,
            params=cfg.model_params,
        )
    check_model_fits(net, train.x[:2], train.num_classes, ref)
    return Population(train, test, datas, model_vector(net, cfg.client.buffers), net)


def build_objective(cfg: Config) -> Objective:
    """The client objective from its registry (``OBJECTIVES``), its ``objective_params`` validated
    by the objective's own typed parameters: a misspelt key fails with its dotted path."""
    c = cfg.client
    try:
        return OBJECTIVES.create(c.objective, c.objective_params, ctx=cfg, where="client.objective_params")
    except RegistryError as exc:
        raise ConfigError(str(exc)) from None


def build_trainer(cfg: Config, pop: Population) -> LocalTrainer:
    apply_run_settings(cfg)
    c = cfg.client
    try:
        tcfg = TrainConfig.of(c)
    except ValueError as exc:
        raise ConfigError(f"client: {exc}") from None
    w = ModelWeights(pop.model, c.buffers)
    objective = build_objective(cfg)
    if w.size != w.num_params and objective.parameters_only:
        raise ConfigError(
            f"client.objective {c.objective!r} keeps state of the parameters only: with a "
            "model that has buffers, set client.buffers: local"
        )
    if objective.fixed_batch and not tcfg.drop_last:
        tcfg = dataclasses.replace(tcfg, drop_last=True)  # FedeRage's model mini-batch b is fixed
    return LocalTrainer(
        copy.deepcopy(pop.model), objective, tcfg, pop.train.num_classes, cfg.run.device, apply_precision(cfg)
    )


def orchestrator_config(o: OrchestratorCfg) -> OrchestratorConfig:
    """The orchestrator's settings from the config's ``orchestrator`` section, field by field by
    name (``tests/test_extending.py`` checks the two declare the same fields): a new knob is
    declared in the config and in ``OrchestratorConfig``, and nothing copies it by hand."""
    settings = {k: getattr(o, k) for k in type(o).model_fields if k != "admission"}
    return OrchestratorConfig(**settings, admission=AdmissionConfig(**o.admission.model_dump()))


def build_orchestrator(
    cfg: Config,
    weights: np.ndarray,
    trace: AvailabilityTrace | Callable[[], AvailabilityTrace] | None,
    plan_errors: str = "raise",
) -> Orchestrator:
    """The orchestrator with the config's policies, each looked up in its registry by name (or
    import path) with its parameters validated. ``trace`` (or a function making it, called only
    then) is the oracle of an availability policy that reads one; ``plan_errors`` as
    ``PlanSetup.on_error``."""
    o = cfg.orchestrator
    try:
        ocfg = orchestrator_config(o)
        rounds = ROUND_POLICIES.create(o.mode, o.mode_params, ocfg, where="orchestrator.mode_params")
        availability = AVAILABILITY.create(
            o.knowledge, o.knowledge_params, ocfg, where="orchestrator.knowledge_params"
        )
    except RegistryError as exc:
        raise ConfigError(str(exc)) from None
    except ValueError as exc:
        raise ConfigError(f"orchestrator: {exc}") from None
    selector = _create(TRAIN_SELECTORS, cfg.selector.name, cfg.selector.params, "selector.params", cfg)
    eval_selector = _create(
        EVAL_SELECTORS, cfg.eval_selector.name, cfg.eval_selector.params, "eval_selector.params", cfg
    )
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
    return Orchestrator(
        ocfg,
        weights,
        selector,
        aggregator,
        _stream(cfg.seed, _STRATEGY),
        eval_selector,
        oracle,
        validator,
        build_data_plan(cfg, plan_errors),
        rounds,
        availability,
    )


def build_validator(cfg: Config, aggregator: Aggregator, num_params: int) -> UpdateValidator:
    """Update validation with the aux entries the configured objective and aggregator declare."""
    try:
        objective = objective_class(cfg.client.objective)
    except ValueError as exc:
        raise ConfigError(f"client.objective: {exc}") from None
    v = cfg.validation
    try:
        c = cfg.client
        vcfg = ValidationConfig(
            v.max_samples_factor,
            v.norm_policy,
            v.norm_factor,
            v.norm_window,
            v.norm_min_history,
            v.warmup_factor,
            v.norm_floor,
            c.batch_size,
            c.epochs,
            c.max_steps,
        )
    except ValueError as exc:
        raise ConfigError(f"validation: {exc}") from None
    spec = {**objective.declared_aux(num_params), **aggregator.declared_aux(num_params)}
    return UpdateValidator(vcfg, spec)


def per_client_setup(cfg: Config, trace: AvailabilityTrace, class_counts: np.ndarray) -> PerClientSetup:
    """The federation facts ``run.per_client_eval`` reports against: participation (rare clients)
    and the tail classes (under ``partition.kind: rare_clients`` the rare clients' classes, else
    the rarest 30% of classes by global training count)."""
    totals = class_counts.sum(axis=0)
    n_tail = (
        cfg.partition.rare_classes if cfg.partition.kind == "rare_clients" else max(1, len(totals) * 3 // 10)
    )
    tail = np.sort(np.argsort(totals, kind="stable")[:n_tail])
    return PerClientSetup(class_counts, participation_shares(cfg, trace, class_counts), tail, cfg.run.rare_p)


def attach_run_measures(
    cfg: Config,
    recorder: Recorder,
    pop: Population,
    trace: AvailabilityTrace,
    autocast_dtype: torch.dtype | None = None,
) -> None:
    """The run measures a config may switch on, on ``recorder`` (any shell): ``run.per_client_eval``
    (felix.metrics.per_client) and ``run.converge_threshold`` (the DAFL paper's stop rule)."""
    if cfg.run.per_client_eval:
        if pop.test is None:
            raise ConfigError("run.per_client_eval needs a test set")
        counts = np.stack([d.class_counts(pop.train.num_classes).numpy() for d in pop.client_data])
        recorder.per_client = make_per_client_eval(
            copy.deepcopy(pop.model),
            pop.test,
            cfg.run.device,
            per_client_setup(cfg, trace, counts),
            autocast_dtype,
        )
    if cfg.run.converge_threshold is not None:
        recorder.converge = (cfg.run.converge_threshold, cfg.run.converge_patience)
