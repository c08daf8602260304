"""A run set up once from its config, for every shell: the config from its sources, the server
side (orchestrator, evaluator, recorder, run controller, the stream's freshness measure) and the
client side (each client's data, the trainer, the runtime profile, the data plan's applier, the
stream feeds).

The simulator (``felix.sim.build``), the MQTT server (``felix.deploy.server``) and the MQTT
clients (``felix.deploy.client``) all build their parts here, so a setting means the same thing in
every shell: when each shell wrote its own setup, they drifted (the server's evaluator ran without
the configured autocast). The shells add only what is theirs: the virtual clock, devices and
cohorts of the simulator; the wall clock, MQTT and checkpoints of the deployment. Nothing here
imports a shell.

One config's way through a run: ``resolve_config`` -> ``felix.scenario.build`` (population,
trace) -> ``felix.stream.setup.build_stream`` (streams only) -> ``build_server_side`` ->
``build_client_side`` -> the shell.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from felix.client.trainer import ClientData, LocalTrainer
from felix.client.workers import Workers
from felix.config import Config, ConfigError, deep_merge, read_yaml, validate
from felix.core.orchestrator import Orchestrator
from felix.engine.components import (
    apply_precision,
    apply_run_settings,
    attach_run_measures,
    build_orchestrator,
    build_trainer,
    make_evaluator,
)
from felix.engine.controller import EvalSink, RunController
from felix.metrics.freshness import FreshnessTracker
from felix.metrics.recorder import Recorder
from felix.presets import scenario_preset, strategy_preset
from felix.scenario.build import Population, build_runtimes
from felix.scenario.traces import AvailabilityTrace
from felix.strategies.dataplans.plans import DataPlanRun, PlanApplier, prepare_data_plan
from felix.strategies.dataplans.policy import PlannedDataPlan
from felix.stream.feed import StreamFeed
from felix.stream.model import StreamModel
from felix.stream.setup import attach_freshness, feed_for

TraceSource = AvailabilityTrace | Callable[[], AvailabilityTrace]


def resolve_config(
    config_path: str | None, preset: str | None, sets: dict[str, Any], scenario: str | None = None
) -> Config:
    """defaults <- scenario (the embedded default when no file is given) <- file <- strategy preset <- --set."""
    raw: dict[str, Any] = {}
    if config_path is None or scenario is not None:
        raw = deep_merge(raw, scenario_preset(scenario or "default"))
    if config_path is not None:
        raw = deep_merge(raw, read_yaml(config_path))
    strategy = preset or sets.get("strategy") or raw.get("strategy")
    if strategy and strategy != "custom":
        raw = deep_merge(raw, strategy_preset(strategy))
        raw["strategy"] = strategy
    raw = deep_merge(raw, sets)
    return validate(raw, config_path or f"scenario {scenario or 'default'}")


def check_population(cfg: Config, pop: Population) -> None:
    """Settings the population cannot serve, as one clear line before anything is built."""
    if pop.test is None and cfg.run.eval_every > 0:
        raise ConfigError(
            f"the dataset has no test set, but run.eval_every is {cfg.run.eval_every}: give it a "
            "test set, or set run.eval_every: 0"
        )


def once(trace: TraceSource) -> TraceSource:
    """``trace`` as given, or its maker called at most once (a deployment's server builds the
    trace only if a part asks for it: an oracle, the per-client measure, availability-tied
    arrivals)."""
    return trace if isinstance(trace, AvailabilityTrace) else functools.cache(trace)


@dataclass
class ServerSide:
    """What a run's server holds: the orchestrator and the run controller that drives it (stop
    rules, bytes, summary), the recorder with the global evaluator and the run measures, and the
    freshness measure of a stream."""

    cfg: Config
    orch: Orchestrator
    recorder: Recorder
    controller: RunController
    freshness: FreshnessTracker | None = None


def build_server_side(
    cfg: Config,
    pop: Population,
    trace: TraceSource,
    stream: StreamModel | None = None,
    *,
    plan_errors: str = "raise",
    sink: EvalSink | None = None,
    measure_wire: bool = False,
    workers: Workers | None = None,
) -> ServerSide:
    """The server side of ``cfg`` over ``pop``. ``trace``: the availability, or a function making
    it (called once, and only if a part reads it); ``stream``: the run's stream model, whose
    population mix judges the model; ``plan_errors``: ``PlanSetup.on_error`` of the data plan;
    ``sink`` and ``measure_wire`` as ``RunController``'s; ``workers``: the evaluation's batches are
    spread over them (``make_evaluator``)."""
    apply_run_settings(cfg)
    check_population(cfg, pop)
    trace = once(trace)
    autocast_dtype = apply_precision(cfg)
    r = cfg.run
    evaluate = make_evaluator(
        copy.deepcopy(pop.model), pop.test, r.device, autocast_dtype=autocast_dtype, workers=workers
    )
    recorder = Recorder(evaluate, r.target_accuracy, r.target_window, r.eval_every)
    attach_run_measures(cfg, recorder, pop, trace, autocast_dtype)
    freshness = None
    if stream is not None:
        freshness = attach_freshness(cfg, recorder, pop, stream, autocast_dtype)
    orch = build_orchestrator(cfg, pop.initial_weights, trace, plan_errors)
    controller = RunController(cfg, orch, recorder, sink, measure_wire=measure_wire)
    return ServerSide(cfg, orch, recorder, controller, freshness)


@dataclass
class ClientSide:
    """What a run's clients hold: each client's data (the population's, held once), the local
    trainer, the runtime profile, the clients' side of a data plan and the stream they draw from.
    A shell takes the clients it runs: the simulator all of them, an MQTT process its share."""

    pop: Population
    trainer: LocalTrainer
    runtimes: np.ndarray
    data_plan: DataPlanRun | None = None
    stream: StreamModel | None = None

    @property
    def data(self) -> list[ClientData]:
        return self.pop.client_data

    @property
    def plan_applier(self) -> PlanApplier | None:
        """The data plan's row applier (augmentation and its time charge), if the run plans."""
        return None if self.data_plan is None else self.data_plan.applier

    def feed(self, cid: int) -> StreamFeed | None:
        """Client ``cid``'s stream feed (None without a stream: it trains on its fixed data)."""
        return None if self.stream is None else feed_for(self.stream, self.pop, cid)


def build_client_side(
    cfg: Config,
    pop: Population,
    stream: StreamModel | None = None,
    planned: PlannedDataPlan | None = None,
) -> ClientSide:
    """The client side of ``cfg`` over ``pop``: the trainer, the runtimes, and the data plan
    beside the server's ``planned`` policy (the simulator shares its orchestrator's; a deployed
    client's is its own). A Flower app (``client.flower_app``) wraps the trainer in the simulator,
    the only shell that runs one."""
    apply_run_settings(cfg)
    runtimes = build_runtimes(cfg, [len(d) for d in pop.client_data])
    trainer = build_trainer(cfg, pop)
    data_plan = prepare_data_plan(cfg, pop.client_data, pop.train.num_classes, runtimes, planned)
    return ClientSide(pop, trainer, runtimes, data_plan, stream)
