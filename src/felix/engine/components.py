"""A run's components from a validated ``Config``: the orchestrator with its policies, the
client objective, the update validator, the global evaluator and the run measures (the trainers
are ``felix.engine.trainers``'s).

The scenario (``felix.scenario.build``) gives a run its inputs: the population, the availability
trace, the runtimes and the initial model. What trains, judges and orchestrates is built here, once
for every shell: ``felix.engine.setup`` puts these parts together into a run's server side and
client side, which the simulator and the MQTT server and clients consume alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from felix import cpu_kernels
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
from felix.metrics.test_pass import TestPass
from felix.privacy.setup import install as install_privacy
from felix.scenario.build import participation_shares, strategy_stream
from felix.scenario.traces import AvailabilityTrace
from felix.secagg.setup import install as install_secagg
from felix.strategies.dataplans.plans import build_data_plan
from felix.strategies.objectives import OBJECTIVES, Objective, objective_class


# ---------------------------------------------------------------------- policies
def _create(registry: Registry[Any], name: str, params: Any, where: str, ctx: Any) -> Any:
    """A policy from its registry (``felix.core.registry``), its errors as ``ConfigError``."""
    try:
        return registry.create(name, params, ctx, where=where)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def make_evaluator(test_pass: TestPass | None) -> Callable[[np.ndarray], tuple[float, float]]:
    """The global model's test accuracy and loss, from the run's test pass (one forward pass per
    evaluated version, shared with the other measures: ``felix.metrics.test_pass``). Without a
    test set, the evaluator raises ``ConfigError`` when called."""
    if test_pass is None:

        def no_test_set(weights: np.ndarray) -> tuple[float, float]:
            raise ConfigError(
                "the dataset has no test set, but the run evaluates the global model: give the "
                "loader or the population a test set"
            )

        return no_test_set
    return test_pass.accuracy_loss


def apply_run_settings(cfg: Config) -> torch.dtype | None:
    """The process-wide torch settings of a run, applied once per run by its plan
    (``felix.engine.plan``): ``run.threads`` for this process, ``run.device`` checked (a device
    torch cannot use here is a ``ConfigError`` at once), and ``run.precision`` (TF32 matmuls on
    CUDA; returns the bf16 autocast dtype, None for fp32). Results and speed must not depend on the
    machine's core count. Also a warning if torch does not use the CPU kernels felix pins
    (:mod:`felix.cpu_kernels`)."""
    cpu_kernels.check()
    if cfg.run.threads is not None and torch.get_num_threads() != cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    check_device(cfg.run.device)
    if str(cfg.run.device).startswith("cuda"):
        tf32 = cfg.run.precision == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    return torch.bfloat16 if cfg.run.precision == "bf16" else None


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
        rounds = ROUND_POLICIES.create(
            o.round_policy, o.round_policy_params, o, where="orchestrator.round_policy_params"
        )
        availability = AVAILABILITY.create(
            o.availability, o.availability_params, o, where="orchestrator.availability_params"
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
            raise ConfigError(f"orchestrator.availability {o.availability!r} needs an availability trace")
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
    install_secagg(cfg, orch)
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
    test_pass: TestPass | None,
    class_counts: np.ndarray,
    trace: AvailabilityTrace | Callable[[], AvailabilityTrace],
) -> None:
    """The run measures a config may switch on, on ``recorder`` (any shell): ``run.per_client_eval``
    (felix.metrics.per_client, read from the run's test pass) and ``run.converge_threshold`` (the
    DAFL paper's stop rule). ``trace``, or a function making it, is read by the per-client measure
    only."""
    if cfg.run.per_client_eval:
        if test_pass is None:
            raise ConfigError("run.per_client_eval needs a test set")
        recorder.per_client = make_per_client_eval(
            test_pass, per_client_setup(cfg, trace() if callable(trace) else trace, class_counts)
        )
    if cfg.run.converge_threshold is not None:
        recorder.converge = (cfg.run.converge_threshold, cfg.run.converge_patience)
