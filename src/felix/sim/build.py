"""Assemble a simulation from a config: the run's plan (felix.engine.plan) and its server and
client sides (felix.engine.setup), shared with the MQTT deployment, and what only the simulator
has: every client's data gathered at once, the cohort executor, the simulated devices and the
virtual-clock shell around the orchestrator.

``build`` takes a prepared population and trace as well as a config (the Python API, felix.api,
passes them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

from felix.client.cohort import CohortTrainer
from felix.client.trainer import ClientData
from felix.config import Config
from felix.core.orchestrator import Orchestrator
from felix.engine.controller import RunController
from felix.engine.plan import RunPlan, plan_run
from felix.engine.setup import build_client_side, build_server_side
from felix.engine.trainers import Cohorts
from felix.metrics.freshness import FreshnessTracker
from felix.metrics.recorder import Recorder
from felix.privacy.setup import device_mechanism
from felix.scenario.build import ClientDatasets, Population
from felix.scenario.models import ModelFactory
from felix.scenario.traces import AvailabilityTrace
from felix.sim.engine import CohortExecutor, SimSettings, Simulation, make_devices
from felix.strategies.dataplans.plans import DataPlanRun
from felix.strategies.dataplans.policy import PlannedDataPlan
from felix.stream.model import StreamModel

log = logging.getLogger("felix.sim.build")


def build_executor(
    cfg: Config, cohort: CohortTrainer | None, datas: list[ClientData]
) -> CohortExecutor | None:
    """``run.executor``: the cohort trainer itself (local), or Ray actors training its cohorts."""
    if cfg.run.executor == "local" or cohort is None:
        if cfg.run.executor == "ray":
            log.warning(
                "run.executor ray: this run trains one client at a time (run.cohort), so no actors start"
            )
        return cohort
    from felix.sim.ray_cohorts import RayCohortExecutor

    return RayCohortExecutor(cohort, datas, cfg.run.ray_actors, cfg.run.ray_address, cfg.run.threads)


@dataclass
class Built:
    """A simulation ready to run (``sim.run()``) and the parts it was built from."""

    cfg: Config
    sim: Simulation
    orch: Orchestrator
    recorder: Recorder
    trace: AvailabilityTrace
    population: Population
    data_plan: DataPlanRun | None = None
    controller: RunController | None = None
    stream: StreamModel | None = None
    freshness: FreshnessTracker | None = None
    plan: RunPlan | None = None


def build(
    cfg: Config,
    population: Population | ClientDatasets | None = None,
    model: nn.Module | ModelFactory | None = None,
    trace: AvailabilityTrace | None = None,
) -> Built:
    """A ready simulation of ``cfg``. ``population``: a built ``Population`` (its model included)
    or prepared ``ClientDatasets`` (with ``model``, or ``cfg.model``), instead of the configured
    dataset and partition; ``partition.num_clients`` becomes its size (``Built.cfg`` is the config
    that ran). ``trace`` replaces the configured one (``trace.offset_s`` is not applied to it).

    The run's plan (``felix.engine.plan``) and its server side and client side come from the
    shared setup, as the MQTT server's and clients' do; what is the simulator's own is added here:
    every client's data gathered at once, the cohorts and their executor, the simulated devices
    and the virtual-clock shell."""
    plan = plan_run(cfg, population, model, trace)
    cfg = plan.cfg
    pop = plan.gathered()
    server = build_server_side(plan)
    planned = server.orch.data_plan
    clients = build_client_side(plan, planned if isinstance(planned, PlannedDataPlan) else None)
    trainer = clients.trainer
    if plan.stream is None:
        cohorts = plan.trainers.cohorts(trainer, max(plan.sizes))
    else:  # every task trains on new data, which a cohort's data pool would keep: one at a time
        cohorts = Cohorts()
    executor = build_executor(cfg, cohorts.trainer, pop.client_data)
    devices = make_devices(pop.client_data, plan.runtimes, plan.trace.for_client)
    if cfg.client.flower_app is not None:
        from felix.flower.trainer import CLIENT_KEY

        for dev in devices:  # the Flower trainer addresses each task's app context by client
            dev.state[CLIENT_KEY] = dev.cid
    for dev in devices:
        dev.feed = clients.feed(dev.cid)
    settings = SimSettings(
        seed=cfg.seed,
        eval_fraction=cfg.runtime.eval_fraction,
        cohort_size=cohorts.size,
        min_cohort=cohorts.min_size,
    )
    sim = Simulation(
        server.orch,
        devices,
        trainer,
        server.controller,
        settings,
        augment=clients.plan_applier,
        privacy=device_mechanism(cfg),
        cohort=executor,
        registration=None if plan.stream is None else plan.stream.registration,
    )
    return Built(
        cfg,
        sim,
        server.orch,
        server.recorder,
        plan.trace,
        pop,
        clients.data_plan,
        server.controller,
        plan.stream,
        server.freshness,
        plan,
    )
