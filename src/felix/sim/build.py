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
from felix.client.cohort_split import SplitCohort
from felix.client.trainer import ClientData, LocalTrainer
from felix.client.trainer_pool import TrainerPool
from felix.client.workers import Workers
from felix.config import Config, ConfigError
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
from felix.sim.simulation import CohortExecutor, SimSettings, Simulation, make_devices
from felix.strategies.dataplans.plans import DataPlanRun
from felix.strategies.dataplans.policy import PlannedDataPlan
from felix.stream.model import StreamModel

log = logging.getLogger("felix.sim.build")


def build_workers(cfg: Config, stream: bool) -> Workers | None:
    """``run.workers`` above 1: the run's workers (None where the run trains in one place: a Ray
    executor's actors, a stream's fresh data per task, a Flower app's messages)."""
    n = cfg.run.workers
    if n == 1:
        return None
    if cfg.run.executor != "local":
        raise ConfigError(f"run.workers {n} needs run.executor local (Ray actors are the run's workers)")
    if stream or cfg.client.flower_app is not None:
        log.warning("run.workers %d: this run trains one task at a time in order (stream, Flower app)", n)
        return None
    return Workers(n)


def over_workers(
    plan: RunPlan, workers: Workers, trainer: LocalTrainer, cohorts: Cohorts
) -> tuple[CohortExecutor, int, int]:
    """The cohort executor on ``workers`` with its cohort size and smallest cohort: the live cohort
    split in one share per worker (each share's trainer from the run's trainer factory), or, where
    clients train one at a time, a trainer per worker taking groups of the tasks due next (the
    smallest group one, so that every task trains on a worker's one thread)."""
    if cohorts.trainer is not None:
        largest = max(plan.sizes)
        more = [plan.trainers.cohorts(trainer, largest).trainer for _ in range(workers.n - 1)]
        shares = [cohorts.trainer, *(c for c in more if c is not None)]
        return SplitCohort(shares, workers), cohorts.size, cohorts.min_size
    pool = TrainerPool([plan.trainers.trainer() for _ in range(workers.n)], workers)
    return pool, pool.group_size, 1


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
    cohort_size, min_cohort = cohorts.size, cohorts.min_size
    workers = build_workers(cfg, plan.stream is not None)
    if workers is not None:
        executor, cohort_size, min_cohort = over_workers(plan, workers, trainer, cohorts)
        if plan.test_pass is not None:  # the global evaluation's batches on the workers too
            plan.test_pass.spread(workers)
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
        cohort_size=cohort_size,
        min_cohort=min_cohort,
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
