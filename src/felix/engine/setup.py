"""A run set up once from its config, for every shell: the config from its sources, and from
the run's plan (``felix.engine.plan``) the server side (orchestrator, evaluator, recorder, run
controller, the stream's freshness measure) and the client side (the trainer, the data plan's
applier, each client's data, runtime and stream feed).

The simulator (``felix.sim.build``), the MQTT server (``felix.deploy.server``) and the MQTT
clients (``felix.deploy.client``) all build their parts here, so a setting means the same thing in
every shell: when each shell wrote its own setup, they drifted (the server's evaluator ran without
the configured autocast). The shells add only what is theirs: the virtual clock, devices and
cohorts of the simulator; the wall clock, MQTT and checkpoints of the deployment. Nothing here
imports a shell.

One config's way through a run: ``resolve_config`` -> ``felix.engine.plan.plan_run`` (the
scenario's facts, lazy shards, trace and stream; the torch settings applied) ->
``build_server_side`` / ``build_client_side`` -> the shell.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from felix.client.trainer import ClientData, LocalTrainer
from felix.config import Config, deep_merge, read_yaml, validate
from felix.core.orchestrator import Orchestrator
from felix.engine.components import attach_run_measures, build_orchestrator, make_evaluator
from felix.engine.controller import EvalSink, RunController
from felix.engine.plan import RunPlan
from felix.metrics.freshness import FreshnessTracker
from felix.metrics.recorder import Recorder
from felix.presets import scenario_preset, strategy_preset
from felix.scenario.traces import AvailabilityTrace
from felix.strategies.dataplans.plans import DataPlanRun, PlanApplier, prepare_data_plan
from felix.strategies.dataplans.policy import PlannedDataPlan
from felix.stream.feed import StreamFeed
from felix.stream.model import StreamModel
from felix.stream.setup import attach_freshness


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
    plan: RunPlan,
    *,
    plan_errors: str = "raise",
    sink: EvalSink | None = None,
    measure_wire: bool = False,
) -> ServerSide:
    """The server side of ``plan``: the trace is built only if a part reads it, no client's data
    is gathered. ``plan_errors``: ``PlanSetup.on_error`` of the data plan; ``sink`` and
    ``measure_wire`` as ``RunController``'s."""
    cfg = plan.cfg
    r = cfg.run

    def trace() -> AvailabilityTrace:  # the plan builds it once, if a part reads it
        return plan.trace

    recorder = Recorder(make_evaluator(plan.test_pass), r.target_accuracy, r.target_window, r.eval_every)
    attach_run_measures(cfg, recorder, plan.test_pass, plan.class_counts(), trace)
    freshness = None
    if plan.stream is not None:
        freshness = attach_freshness(cfg, recorder, plan.test_pass, plan.stream)
    orch = build_orchestrator(cfg, plan.initial_weights, trace, plan_errors)
    controller = RunController(cfg, orch, recorder, sink, measure_wire=measure_wire)
    return ServerSide(cfg, orch, recorder, controller, freshness)


@dataclass
class ClientSide:
    """What a run's clients hold: the plan (each client's data, the stream they draw from), the
    local trainer, the runtime profile and the clients' side of a data plan. A shell takes the
    clients it runs: the simulator all of them, an MQTT process its share."""

    plan: RunPlan
    trainer: LocalTrainer
    data_plan: DataPlanRun | None = None

    @property
    def runtimes(self) -> np.ndarray:
        return self.plan.runtimes

    @property
    def stream(self) -> StreamModel | None:
        return self.plan.stream

    @property
    def plan_applier(self) -> PlanApplier | None:
        """The data plan's row applier (augmentation and its time charge), if the run plans."""
        return None if self.data_plan is None else self.data_plan.applier

    def data(self, cid: int) -> ClientData:
        """Client ``cid``'s training data (its shard alone where the others are not gathered)."""
        return self.plan.client_data(cid)

    def feed(self, cid: int) -> StreamFeed | None:
        """Client ``cid``'s stream feed (None without a stream: it trains on its fixed data)."""
        return self.plan.feed(cid)


def build_client_side(plan: RunPlan, planned: PlannedDataPlan | None = None) -> ClientSide:
    """The client side of ``plan``: the trainer (felix's, or the configured Flower app around it),
    and the data plan beside the server's ``planned`` policy (the simulator shares its
    orchestrator's; a deployed client's is its own)."""
    cfg = plan.cfg
    trainer = plan.trainers.trainer()
    data_plan = prepare_data_plan(cfg, plan.class_counts(), plan.runtimes, planned)
    return ClientSide(plan, trainer, data_plan)
