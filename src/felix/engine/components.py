"""A run's components from a validated ``Config``: the orchestrator with its policies, the
client objective and trainer, the update validator, the global evaluator and the run measures.

The scenario (``felix.scenario.build``) gives a run its inputs: the population, the availability
trace, the runtimes and the initial model. What trains, judges and orchestrates is built here, once
for every shell: ``felix.engine.setup`` puts these parts together into a run's server side and
client side, which the simulator and the MQTT server and clients consume alike.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from felix import cpu_kernels
from felix.client.trainer import LocalTrainer, TrainConfig, autocast, one_thread, thread_invariant
from felix.client.weights import ModelWeights, weights_for
from felix.client.workers import Workers
from felix.config import Config, ConfigError
from felix.core.availability import AVAILABILITY
from felix.core.orchestrator import Orchestrator
from felix.core.policies import AGGREGATORS, EVAL_SELECTORS, TRAIN_SELECTORS, Aggregator
from felix.core.registry import Registry, RegistryError
from felix.core.rounds import ROUND_POLICIES
from felix.core.run_facts import RunFacts
from felix.core.server_optim import SERVER_OPTIMIZERS
from felix.core.validation import LocalSteps, UpdateValidator
from felix.metrics.per_client import PerClientSetup, make_per_client_eval
from felix.metrics.recorder import Recorder
from felix.privacy.setup import install as install_privacy
from felix.scenario.build import Population, participation_shares, strategy_stream
from felix.scenario.datasets import ArrayDataset
from felix.scenario.traces import AvailabilityTrace
from felix.strategies.dataplans.plans import build_data_plan
from felix.strategies.objectives import OBJECTIVES, Objective, objective_class


# ---------------------------------------------------------------------- policies
def _create(registry: Registry[Any], name: str, params: Any, where: str, ctx: Any) -> Any:
    """A policy from its registry (``felix.core.registry``), its errors as ``ConfigError``."""
    try:
        return registry.create(name, params, ctx, where=where)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def make_evaluator(
    model: torch.nn.Module,
    test: ArrayDataset | None,
    device: str,
    batch_size: int = 1000,
    autocast_dtype: torch.dtype | None = None,
    workers: Workers | None = None,
) -> Callable[[np.ndarray], tuple[float, float]]:
    """The global model's test accuracy and loss. The test set is copied to ``device`` once; the
    sums stay there, one transfer per evaluation. ``model`` must carry its factory's buffers: a
    parameters-only vector (``client.buffers: local``) is evaluated with them. Without a test set,
    the evaluator raises ``ConfigError`` when called.

    A model whose single-client work stays on one thread (:func:`thread_invariant`) is evaluated on
    one thread as well: MKL rounds the test set's ``[N, 784] x [784, 64]`` product differently on
    two threads, and a last-bit change of a logit can flip a tied prediction and so the time to a
    target; on one thread the evaluation gives the same bits at any ``run.threads``. With
    ``workers`` the batches are spread over them, each on one thread, and their sums added in the
    batches' order: the bits of the evaluation on one thread."""
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

    @torch.no_grad()
    def batch(_: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed loss and the correct predictions of the batch that starts at sample ``s``."""
        xb, yb = x[s : s + batch_size], y[s : s + batch_size]
        with autocast(device, autocast_dtype):
            logits = model(xb).float()
        return F.cross_entropy(logits, yb, reduction="sum"), (logits.argmax(1) == yb).sum()

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
        starts = range(0, len(test), batch_size)
        sums = workers.map(batch, starts) if workers is not None else (batch(0, s) for s in starts)
        for batch_loss, batch_correct in sums:
            loss += batch_loss
            correct += batch_correct
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


def build_objective(cfg: Config) -> Objective:
    """The client objective from its registry (``OBJECTIVES``), its ``objective_params`` validated
    by the objective's own typed parameters: a misspelt key fails with its dotted path."""
    c = cfg.client
    try:
        return OBJECTIVES.create(
            c.objective, c.objective_params, ctx=run_facts(cfg), where="client.objective_params"
        )
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
        tcfg = tcfg.model_copy(update={"drop_last": True})  # FedeRage's model mini-batch b is fixed
    return LocalTrainer(
        copy.deepcopy(pop.model), objective, tcfg, pop.train.num_classes, cfg.run.device, apply_precision(cfg)
    )


def run_facts(cfg: Config) -> RunFacts:
    """What the strategy factories may read of a run (``felix.core.run_facts``), from its config."""
    c, a = cfg.client, cfg.aggregator
    return RunFacts(
        num_clients=cfg.partition.num_clients,
        seed=cfg.seed,
        agg_goal=cfg.orchestrator.agg_goal,
        client_lr=c.lr,
        batch_size=c.batch_size,
        max_steps=c.max_steps,
        server_lr=a.server_lr,
        normalize=a.normalize,
        clip_norm=a.clip_norm,
    )


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
    o = cfg.orchestrator  # the core's own settings model: read as it is
    try:
        rounds = ROUND_POLICIES.create(o.mode, o.mode_params, o, where="orchestrator.mode_params")
        availability = AVAILABILITY.create(
            o.knowledge, o.knowledge_params, o, where="orchestrator.knowledge_params"
        )
    except RegistryError as exc:
        raise ConfigError(str(exc)) from None
    except ValueError as exc:
        raise ConfigError(f"orchestrator: {exc}") from None
    facts = run_facts(cfg)
    selector = _create(TRAIN_SELECTORS, cfg.selector.name, cfg.selector.params, "selector.params", facts)
    eval_selector = _create(
        EVAL_SELECTORS, cfg.eval_selector.name, cfg.eval_selector.params, "eval_selector.params", facts
    )
    a = cfg.aggregator
    aggregator = _create(AGGREGATORS, a.name, a.params, "aggregator.params", facts)
    aggregator.optimizer = _create(
        SERVER_OPTIMIZERS,
        a.server_optimizer,
        a.server_optimizer_params,
        "aggregator.server_optimizer_params",
        facts,
    )
    if a.robust != "none":
        from felix.strategies.aggregation.robust import RobustAggregator

        aggregator = RobustAggregator(aggregator, a.robust, a.trim_fraction)
    validator = build_validator(cfg, aggregator, int(weights.size))
    oracle = None
    if availability.needs_oracle:
        oracle = trace() if callable(trace) else trace
        if oracle is None:
            raise ConfigError(f"orchestrator.knowledge {o.knowledge!r} needs an availability trace")
    orch = Orchestrator(
        o,
        weights,
        selector,
        aggregator,
        strategy_stream(cfg.seed),
        eval_selector,
        oracle,
        validator,
        build_data_plan(cfg, plan_errors),
        rounds,
        availability,
    )
    install_privacy(cfg, orch)
    return orch


def build_validator(cfg: Config, aggregator: Aggregator, num_params: int) -> UpdateValidator:
    """Update validation with the aux entries the configured objective and aggregator declare."""
    try:
        objective = objective_class(cfg.client.objective)
    except ValueError as exc:
        raise ConfigError(f"client.objective: {exc}") from None
    c = cfg.client
    # The config's validation section is the validator's own settings model; the client's local
    # schedule counts an update's steps.
    steps = LocalSteps(batch_size=c.batch_size, epochs=c.epochs, max_steps=c.max_steps)
    spec = {**objective.declared_aux(num_params), **aggregator.declared_aux(num_params)}
    return UpdateValidator(cfg.validation, spec, steps)


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
    trace: AvailabilityTrace | Callable[[], AvailabilityTrace],
    autocast_dtype: torch.dtype | None = None,
) -> None:
    """The run measures a config may switch on, on ``recorder`` (any shell): ``run.per_client_eval``
    (felix.metrics.per_client) and ``run.converge_threshold`` (the DAFL paper's stop rule).
    ``trace``, or a function making it, is read by the per-client measure only."""
    if cfg.run.per_client_eval:
        if pop.test is None:
            raise ConfigError("run.per_client_eval needs a test set")
        counts = np.stack([d.class_counts(pop.train.num_classes).numpy() for d in pop.client_data])
        recorder.per_client = make_per_client_eval(
            copy.deepcopy(pop.model),
            pop.test,
            cfg.run.device,
            per_client_setup(cfg, trace() if callable(trace) else trace, counts),
            autocast_dtype,
        )
    if cfg.run.converge_threshold is not None:
        recorder.converge = (cfg.run.converge_threshold, cfg.run.converge_patience)
