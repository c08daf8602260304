"""One registry class for every component kind, one registration style: the strategy policies,
the scenario parts and the transports are all ``felix.core.registry.Registry`` instances, and a
lookup that fails is a ``ConfigError`` (one line naming the key)."""

from __future__ import annotations

import numpy as np
import pytest

from felix.config import ConfigError, validate
from felix.core.aggregation import AGGREGATORS
from felix.core.availability import AVAILABILITY
from felix.core.dataplan import DATA_PLANS
from felix.core.eval_selection import EVAL_SELECTORS
from felix.core.registry import Registry, RegistryError
from felix.core.rounds import ROUND_POLICIES
from felix.core.selection import TRAIN_SELECTORS
from felix.deploy.transport import TRANSPORTS
from felix.scenario.datasets import DATASETS
from felix.scenario.models import MODELS
from felix.scenario.partition import PARTITIONERS
from felix.scenario.profiles import RUNTIMES
from felix.scenario.traces import TRACES, AvailabilityTrace
from felix.strategies.objectives import OBJECTIVES

ALL = (
    TRAIN_SELECTORS,
    EVAL_SELECTORS,
    AGGREGATORS,
    ROUND_POLICIES,
    AVAILABILITY,
    DATA_PLANS,
    OBJECTIVES,
    MODELS,
    DATASETS,
    PARTITIONERS,
    TRACES,
    RUNTIMES,
    TRANSPORTS,
)


def test_every_component_kind_has_a_registry_of_the_one_class() -> None:
    assert {type(r) for r in ALL} == {Registry}
    assert all(r.names() for r in ALL)  # each has its built-ins, imported on the first lookup
    assert issubclass(RegistryError, ConfigError)


def test_a_scenario_part_registers_and_validates_like_any_component(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trace builder registered with the same decorator as a selector: its parameters are its
    signature's keywords after those felix passes, checked when the config is read. (Registered
    into a copy of the registry's entries, restored afterwards: other tests list the built-ins.)"""
    TRACES.names()  # the built-ins first
    monkeypatch.setattr(TRACES, "_entries", dict(TRACES._entries))

    @TRACES.register("test-registries-flat")
    def flat(
        cfg: object, num_clients: int, rng: np.random.Generator, level: float = 1.0
    ) -> AvailabilityTrace:
        raise AssertionError("not built here")

    assert TRACES.resolve("test-registries-flat") is flat
    assert (
        validate({"trace": {"kind": "test-registries-flat", "params": {"level": 0.5}}}).trace.kind
        == "test-registries-flat"
    )
    with pytest.raises(ConfigError, match=r"trace\.params\.levle: unknown key \(did you mean `level`\?\)"):
        validate({"trace": {"kind": "test-registries-flat", "params": {"levle": 0.5}}})
    with pytest.raises(
        RegistryError, match="unknown trace 'no-such-trace'; registered: .*test-registries-flat"
    ):
        TRACES.resolve("no-such-trace")
    with pytest.raises(ValueError, match="without ':'"):
        TRACES.register("a:b")
