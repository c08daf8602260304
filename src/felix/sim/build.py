"""Assemble a simulation from a config: the scenario's inputs (felix.scenario.build), the run's
server and client sides (felix.engine.setup, shared with the MQTT deployment), and what only the
simulator has: the cohort trainer and its executor, the simulated devices and the virtual-clock
shell around the orchestrator.

``build`` takes a prepared population and trace as well as a config (the Python API, felix.api,
passes them).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

from torch import nn

from felix.client.cohort import CohortTrainer, resolve_cohort
from felix.client.cohort_split import SplitCohort
from felix.client.trainer import ClientData, LocalTrainer
from felix.client.trainer_pool import TrainerPool
from felix.client.workers import Workers
from felix.config import Config, ConfigError
from felix.core.orchestrator import Orchestrator
from felix.engine.components import apply_run_settings, build_objective
from felix.engine.controller import RunController
from felix.engine.setup import build_client_side, build_server_side, check_population
from felix.metrics.freshness import FreshnessTracker
from felix.metrics.recorder import Recorder
from felix.scenario.build import ClientDatasets, Population, build_population, build_trace, fit_config
from felix.scenario.models import ModelFactory
from felix.scenario.traces import AvailabilityTrace
from felix.sim.engine import CohortExecutor, SimSettings, Simulation, make_devices
from felix.strategies.dataplans.plans import DataPlanRun
from felix.strategies.dataplans.policy import PlannedDataPlan
from felix.stream.model import StreamModel
from felix.stream.setup import build_stream

log = logging.getLogger("felix.sim.build")


def build_cohort(
    cfg: Config, trainer: LocalTrainer, sample_shape: tuple[int, ...], largest_client: int
) -> tuple[CohortTrainer | None, int, int]:
    """The cohort trainer ``run.cohort`` asks for (None: sequential), its size and smallest cohort.

    A cohort pads every client's batches to ``client.batch_size`` rows. With a batch size above
    the largest client's data, every batch of every client is short, so a stack would be mostly
    padding: 60,000-row batches of Fashion-MNIST clients of a few hundred samples took 8 GB and
    20x the sequential time. ``auto`` then trains sequentially; an explicit size is refused."""
    size, min_k = resolve_cohort(
        cfg.run.cohort, trainer.model, trainer.objective, cfg.run.device, sample_shape
    )
    if size == 1 or cfg.client.probe_loss:  # the received-model loss is measured by the sequential trainer
        return None, 1, 1
    if cfg.client.flower_app is not None:  # a Flower app trains one message at a time
        return None, 1, 1
    bs = cfg.client.batch_size
    if bs > largest_client:
        why = (
            f"client.batch_size {bs} is more than the largest client's {largest_client} samples, "
            "and a cohort pads every batch to the batch size"
        )
        if cfg.run.cohort != "auto":
            raise ConfigError(f"run.cohort {cfg.run.cohort}: {why}; use run.cohort auto or 1")
        log.info("run.cohort=auto: sequential training (%s)", why)
        return None, 1, 1
    # Its own objective instance: the sequential trainer's keeps per-task attributes.
    objective = build_objective(cfg)
    cohort = CohortTrainer(
        copy.deepcopy(trainer.model),
        objective,
        trainer.cfg,
        trainer.num_classes,
        cfg.run.device,
        trainer.autocast_dtype,
        sample_shape,
    )
    return cohort, size, min_k


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
    cfg: Config,
    workers: Workers,
    trainer: LocalTrainer,
    cohort: CohortTrainer | None,
    sizes: tuple[int, int],
) -> tuple[CohortExecutor, int, int]:
    """The cohort executor on ``workers`` with its cohort size and smallest cohort: the live cohort
    split in one share per worker, or, where clients train one at a time, a trainer per worker
    taking groups of the tasks due next (the smallest group one, so that every task trains on a
    worker's one thread)."""
    if cohort is not None:
        more = [
            CohortTrainer(
                copy.deepcopy(trainer.model),
                build_objective(cfg),
                cohort.cfg,
                cohort.num_classes,
                cfg.run.device,
                cohort.autocast,
                cohort.sample_shape,
            )
            for _ in range(workers.n - 1)
        ]
        return SplitCohort([cohort, *more], workers), *sizes
    trainers = [
        LocalTrainer(
            copy.deepcopy(trainer.model),
            build_objective(cfg),
            trainer.cfg,
            trainer.num_classes,
            cfg.run.device,
            trainer.autocast_dtype,
        )
        for _ in range(workers.n)
    ]
    pool = TrainerPool(trainers, workers)
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

    The run's server side and client side come from ``felix.engine.setup``, as the MQTT server's
    and clients' do; what is the simulator's own is added here: the cohorts and their executor,
    the simulated devices and the virtual-clock shell."""
    apply_run_settings(cfg)
    if isinstance(population, Population):
        if model is not None:
            raise ConfigError(
                "build: pass model with ClientDatasets, not with a built Population (it has its model)"
            )
        pop = population
        cfg = fit_config(cfg, len(pop.client_data))
    else:
        if population is not None:
            cfg = fit_config(cfg, len(population.clients))
        pop = build_population(cfg, population, model)
    check_population(cfg, pop)
    if trace is not None and not isinstance(trace, AvailabilityTrace):
        raise ConfigError(f"build: trace must be a felix AvailabilityTrace, not {type(trace).__name__}")
    trace = build_trace(cfg, pop) if trace is None else trace
    stream = build_stream(cfg, pop, trace) if cfg.stream.enabled else None
    workers = build_workers(cfg, stream is not None)
    server = build_server_side(cfg, pop, trace, stream, workers=workers)
    planned = server.orch.data_plan
    clients = build_client_side(cfg, pop, stream, planned if isinstance(planned, PlannedDataPlan) else None)
    if cfg.client.flower_app is not None:
        from felix.flower.trainer import build_flower_trainer

        clients.trainer = build_flower_trainer(cfg, clients.trainer)
    trainer = clients.trainer
    if stream is None:
        cohort, cohort_size, min_cohort = build_cohort(
            cfg, trainer, tuple(pop.train.sample_shape), max(len(d) for d in pop.client_data)
        )
    else:  # every task trains on new data, which a cohort's data pool would keep: one at a time
        cohort, cohort_size, min_cohort = None, 1, 1
    executor = build_executor(cfg, cohort, pop.client_data)
    if workers is not None:
        executor, cohort_size, min_cohort = over_workers(
            cfg, workers, trainer, cohort, (cohort_size, min_cohort)
        )
    devices = make_devices(pop.client_data, clients.runtimes, trace.for_client)
    if cfg.client.flower_app is not None:
        from felix.flower.trainer import CLIENT_KEY

        for dev in devices:  # the Flower trainer addresses each task's app context by client
            dev.state[CLIENT_KEY] = dev.cid
    for dev in devices:
        dev.feed = clients.feed(dev.cid)
    settings = SimSettings(
        seed=cfg.seed, eval_fraction=cfg.runtime.eval_fraction, cohort_size=cohort_size, min_cohort=min_cohort
    )
    sim = Simulation(
        server.orch,
        devices,
        trainer,
        server.controller,
        settings,
        augment=clients.plan_applier,
        cohort=executor,
        registration=None if stream is None else stream.registration,
    )
    return Built(
        cfg,
        sim,
        server.orch,
        server.recorder,
        trace,
        pop,
        clients.data_plan,
        server.controller,
        stream,
        server.freshness,
    )
