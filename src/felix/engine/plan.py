"""A run's plan, built once from its config and consumed by every shell: the simulator
(``felix.sim.build``), the MQTT server (``felix.deploy.server``) and each MQTT client process
(``felix.deploy.client``).

The plan holds the scenario's facts (the config that runs, the training pool and each client's
rows of it, the test set, the initial model, the clients' sizes and class counts) and builds the
rest lazily, at most once: the clients' gathered data (the simulator's), the availability trace,
the stream model, the run's trainers and its test-set pass. A shell takes what it uses: the
simulator every client's data; the server the facts, the trace only if a part reads it, and no
client's samples; a client process only its own clients' rows. Before the plan each shell built
population, trace and stream in its own way, and every client process gathered the whole
population to use its own row.

Building a plan applies the run's process-wide torch settings (``run.threads``, ``run.device``,
``run.precision``) once: nothing else in a run applies them.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from felix.client.trainer import ClientData
from felix.config import Config, ConfigError
from felix.engine.components import apply_run_settings
from felix.engine.trainers import TrainerFactory
from felix.metrics.test_pass import TestPass
from felix.scenario.build import (
    ClientDatasets,
    Population,
    PopulationPlan,
    build_runtimes,
    build_trace,
    fit_config,
    plan_population,
)
from felix.scenario.datasets import ArrayDataset, LazyDataset
from felix.scenario.models import ModelFactory
from felix.scenario.shards import Shards
from felix.scenario.traces import AvailabilityTrace, DeviceTrace
from felix.stream.feed import StreamFeed
from felix.stream.model import StreamModel
from felix.stream.setup import ClientTraces, build_stream, feed_for

__all__ = ["RunPlan", "plan_run"]


@dataclass(eq=False)
class RunPlan:
    """One run's facts and lazily built parts (see the module docstring). ``client_traces``: the
    availability the clients replay, where a shell has its own (an MQTT process's share of the
    trace); by default the plan's trace."""

    cfg: Config
    population: PopulationPlan
    autocast_dtype: torch.dtype | None
    given_trace: AvailabilityTrace | None = None
    client_traces: ClientTraces | None = None
    _gathered: Population | None = field(default=None, init=False, repr=False)

    # ------------------------------------------------------------------ facts
    @property
    def train(self) -> ArrayDataset | LazyDataset:
        """The training pool, each client's rows a shard of it (read on demand in a client
        process, where the dataset can)."""
        return self.population.train

    @property
    def test(self) -> ArrayDataset | None:
        return self.population.test

    @property
    def model(self) -> nn.Module:
        """The initial model with its factory's buffers (copied by whoever trains or evaluates)."""
        return self.population.model

    @property
    def initial_weights(self) -> np.ndarray:
        return self.population.initial_weights

    @property
    def num_classes(self) -> int:
        return self.train.num_classes

    @property
    def sizes(self) -> list[int]:
        """Each client's number of training samples."""
        return self.population.shards.sizes

    def class_counts(self) -> np.ndarray:
        """Clients x classes: each client's training samples per class (from the labels alone)."""
        return self.population.class_counts()

    # ------------------------------------------------------------------ the clients' data
    def gathered(self) -> Population:
        """The population with every client's data held (the simulator's), gathered once."""
        if self._gathered is None:
            self._gathered = self.population.gather()
        return self._gathered

    def client_data(self, cid: int) -> ClientData:
        """Client ``cid``'s data: its row of the gathered population, or its own shard alone."""
        if self._gathered is not None:
            return self._gathered.client_data[cid]
        return self.population.shards.client(cid)

    @functools.cached_property
    def runtimes(self) -> np.ndarray:
        """Every client's task runtime from the runtime profile (its stream draws for all)."""
        return build_runtimes(self.cfg, self.sizes)

    # ------------------------------------------------------------------ lazily built, once
    @functools.cached_property
    def trace(self) -> AvailabilityTrace:
        """The scenario's availability (the given one, or built with the clients' class counts)."""
        return self.given_trace if self.given_trace is not None else build_trace(self.cfg, self.population)

    def trace_for(self, cid: int) -> DeviceTrace:
        """Client ``cid``'s availability as the clients replay it."""
        if self.client_traces is not None:
            return self.client_traces.for_client(cid)
        return self.trace.for_client(cid)

    @functools.cached_property
    def stream(self) -> StreamModel | None:
        """The run's stream model (None without ``stream.enabled``). Availability-tied arrivals
        read the clients' traces, built only when a client's samples are drawn."""
        if not self.cfg.stream.enabled:
            return None
        return build_stream(self.cfg, self.population, _PlanTraces(self))

    def feed(self, cid: int) -> StreamFeed | None:
        """Client ``cid``'s stream feed from the training pool (None without a stream)."""
        if self.stream is None:
            return None
        assert isinstance(self.train, ArrayDataset)  # a stream's plan holds its pool (plan_run)
        return feed_for(self.stream, self.train, cid)

    @functools.cached_property
    def trainers(self) -> TrainerFactory:
        """The factory of the run's trainers (sequential, Flower, cohort) from one objective spec."""
        shape = tuple(self.train.sample_shape)
        return TrainerFactory(self.cfg, self.model, self.num_classes, shape, self.autocast_dtype)

    @functools.cached_property
    def test_pass(self) -> TestPass | None:
        """The run's one pass over the test set per evaluated model (None without a test set)."""
        if self.test is None:
            return None
        return TestPass(
            copy.deepcopy(self.model), self.test, self.cfg.run.device, autocast_dtype=self.autocast_dtype
        )


class _PlanTraces:
    """The plan's client traces for the stream model, read only when a tied arrival is drawn."""

    def __init__(self, plan: RunPlan) -> None:
        self.plan = plan

    def for_client(self, cid: int) -> DeviceTrace:
        return self.plan.trace_for(cid)


def plan_run(
    cfg: Config,
    population: Population | ClientDatasets | None = None,
    model: nn.Module | ModelFactory | None = None,
    trace: AvailabilityTrace | None = None,
    client_traces: ClientTraces | None = None,
    shards_only: bool = False,
) -> RunPlan:
    """The plan of a run of ``cfg``, its torch settings applied. ``population``: a built
    ``Population`` (its model included) or prepared ``ClientDatasets`` (with ``model``, or
    ``cfg.model``), instead of the configured dataset and partition; ``partition.num_clients``
    becomes its size (``RunPlan.cfg`` is the config that runs). ``trace`` replaces the configured
    one (``trace.offset_s`` is not applied to it); ``client_traces``: the clients' own replay of
    it (an MQTT process's share). ``shards_only`` (a deployed client process, which evaluates
    nothing and gathers only its own clients): the training samples are read only for the shards
    gathered, where the dataset can, and no test set is loaded; a stream keeps its pool (its
    clients draw from all of it)."""
    autocast_dtype = apply_run_settings(cfg)
    if trace is not None and not isinstance(trace, AvailabilityTrace):
        raise ConfigError(f"build: trace must be a felix AvailabilityTrace, not {type(trace).__name__}")
    gathered = None
    if isinstance(population, Population):
        if model is not None:
            raise ConfigError(
                "build: pass model with ClientDatasets, not with a built Population (it has its model)"
            )
        cfg = fit_config(cfg, len(population.client_data))
        pop_plan = _of_population(population)
        gathered = population
    else:
        if population is not None:
            cfg = fit_config(cfg, len(population.clients))
        on_demand = shards_only and not cfg.stream.enabled
        pop_plan = plan_population(cfg, population, model, on_demand=on_demand)
    plan = RunPlan(cfg, pop_plan, autocast_dtype, trace, client_traces)
    plan._gathered = gathered
    if not shards_only:
        check_plan(plan)
    return plan


def _of_population(pop: Population) -> PopulationPlan:
    """A built population as a plan (its clients already held)."""
    return PopulationPlan(
        pop.train, pop.test, Shards.of_held(pop.train, pop.client_data), pop.initial_weights, pop.model
    )


def check_plan(plan: RunPlan) -> None:
    """Settings the population cannot serve, as one clear line before anything is built."""
    cfg = plan.cfg
    if plan.test is None and cfg.run.eval_every > 0:
        raise ConfigError(
            f"the dataset has no test set, but run.eval_every is {cfg.run.eval_every}: give it a "
            "test set, or set run.eval_every: 0"
        )
