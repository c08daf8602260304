"""A run's stream from its config, for either shell: the stream model over the training pool,
each device's feed, and the freshness measure on the recorder."""

from __future__ import annotations

from typing import Protocol

from felix.config import Config, ConfigError
from felix.core.types import Tier
from felix.metrics.freshness import FreshnessTracker
from felix.metrics.recorder import Recorder
from felix.metrics.test_pass import TestPass
from felix.scenario.build import Population, PopulationPlan
from felix.scenario.datasets import ArrayDataset
from felix.scenario.traces import DeviceTrace
from felix.stream.drift import check_classes
from felix.stream.feed import StreamFeed
from felix.stream.model import StreamModel


def check_stream(cfg: Config, num_classes: int) -> None:
    """One clear line for the settings that do not combine with streaming data."""
    check_classes(cfg.stream.drift, num_classes)
    if cfg.data_plan != "none":
        raise ConfigError(
            f"data_plan {cfg.data_plan!r} plans over fixed client datasets: it does not run on streams "
            "(stream.enabled)"
        )
    if cfg.run.per_client_eval:
        raise ConfigError("run.per_client_eval measures fixed client datasets: it does not run on streams")
    if cfg.runtime.kind == "per_sample":
        raise ConfigError(
            "runtime.kind 'per_sample' needs fixed client sizes: use another runtime on streams"
        )
    if cfg.run.cohort not in ("auto", 1):
        raise ConfigError(
            f"run.cohort {cfg.run.cohort}: a stream gives every task new data, which a cohort's data "
            "pool would keep; use run.cohort auto or 1 on streams"
        )


class ClientTraces(Protocol):
    """The clients' availability (an ``AvailabilityTrace``, or an MQTT process's share of it)."""

    def for_client(self, cid: int) -> DeviceTrace: ...


def build_stream(cfg: Config, pop: Population | PopulationPlan, trace: ClientTraces | None) -> StreamModel:
    """The run's stream model over ``pop``'s training pool; ``trace`` for availability-tied
    arrivals (read only when a client's samples are drawn; None where none are)."""
    check_stream(cfg, pop.train.num_classes)

    def in_train_tier(cid: int, t: float) -> bool:
        assert trace is not None
        return trace.for_client(cid).tier_at(t) is Tier.AVL_TRAIN

    return StreamModel(
        cfg.stream,
        pop.train.y.numpy(),
        pop.train.num_classes,
        cfg.partition.num_clients,
        cfg.seed,
        None if trace is None else in_train_tier,
    )


def feed_for(stream: StreamModel, pool: ArrayDataset, cid: int) -> StreamFeed:
    """Client ``cid``'s feed of samples from the training ``pool``."""
    return StreamFeed(stream.client(cid), pool.x)


def attach_freshness(
    cfg: Config, recorder: Recorder, test_pass: TestPass | None, stream: StreamModel
) -> FreshnessTracker:
    """Judge the recorder's evaluations on the current distribution (felix.metrics.freshness),
    from the run's test pass."""
    if test_pass is None:
        raise ConfigError(
            "streams are judged on the test set reweighted over time: the dataset needs a test set"
        )
    s = cfg.stream
    tracker = FreshnessTracker(
        test_pass.per_class,
        stream.population_mix,
        stream.shifts(),
        s.recovery_tolerance,
        s.recovery_before_s,
        s.grid_s,
    )
    recorder.evaluate_at = tracker.evaluate_at
    recorder.aggregation_hooks.append(tracker.on_aggregation)
    return tracker
