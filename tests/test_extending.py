"""Extending felix without editing it: a selector, an aggregator, a round policy, an availability
policy, an objective, a dataset and a trace format, each defined and registered in this file only, run through a config by name (and one by
import path), with typed parameters that fail by key.

This is the worked example of docs/architecture.md ("Policies"): each new policy is one class (or
factory) plus its registration next to it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from mqtt_support import Background
from pydantic import BaseModel, ConfigDict

from felix.client.conformance import check_objective
from felix.config import ConfigError, deep_merge, validate
from felix.core.availability import AVAILABILITY, AvailabilityPolicy
from felix.core.client_map import ClientMap
from felix.core.commands import Command, NewModelVersion
from felix.core.events import ClientRegistered, TaskFinished, Tick
from felix.core.orchestrator import Orchestrator, OrchestratorConfig
from felix.core.policies import AGGREGATORS, TRAIN_SELECTORS, Aggregator, SelectionContext, TrainSelector
from felix.core.rounds import ROUND_POLICIES, RoundPolicy
from felix.core.run_facts import RunFacts
from felix.core.types import BufferedUpdate, ClientUpdate, Task, Tier
from felix.deploy.channels import Channel
from felix.deploy.client import ClientHost, ClientOptions
from felix.deploy.memory_transport import InMemoryTransport, MemoryOptions
from felix.deploy.server import ServeOptions, Server
from felix.deploy.transport import TRANSPORTS, Ack, ClientLink, ClientLinkArgs, ServerLink, ServerLinkArgs
from felix.engine.components import build_objective, build_orchestrator
from felix.engine.setup import resolve_config
from felix.scenario.build import build_runtimes
from felix.scenario.datasets import DATASETS, ArrayDataset
from felix.scenario.profiles import RUNTIMES
from felix.scenario.traces import TRACES, AvailabilityTrace, DeviceTrace
from felix.sim.run import run_config
from felix.strategies.objectives import Objective


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------------- a selector
class FewestUpdatesParams(_Params):
    tie_break: str = "lowest_id"


class FewestUpdates(TrainSelector):
    """Pick the clients that contributed least so far (a fairness baseline)."""

    name = "fewest_updates"

    def __init__(self) -> None:
        self.calls = 0

    def select(self, candidates: Sequence[int] | np.ndarray, k: int, ctx: SelectionContext) -> list[int]:
        self.calls += 1
        ids = np.asarray(candidates, dtype=np.int64)
        done = ctx.clients.column("times_updated")[ctx.clients.rows_of(ids)]
        return [int(c) for c in ids[np.lexsort((ids, done))][:k]]


@TRAIN_SELECTORS.register("fewest_updates", params=FewestUpdatesParams)
def make_fewest_updates(params: FewestUpdatesParams, cfg: Any) -> FewestUpdates:
    return FewestUpdates()


# ---------------------------------------------------------------------- an aggregator
class PowerParams(_Params):
    power: float = 0.5


class SamplePowerAggregator(Aggregator):
    """Weight an update by ``num_samples ** power``: between FedAvg (1) and uniform (0)."""

    name = "sample_power"

    def __init__(self, power: float, server_lr: float) -> None:
        super().__init__(server_lr=server_lr)
        self.power = power

    def weight(self, item: BufferedUpdate) -> float:
        return float(item.update.num_samples) ** self.power


@AGGREGATORS.register("sample_power", params=PowerParams)
def make_sample_power(params: PowerParams, ctx: RunFacts) -> SamplePowerAggregator:
    return SamplePowerAggregator(params.power, ctx.server_lr)


# ---------------------------------------------------------------------- a round policy
class SemiAsyncParams(_Params):
    period_s: float = 30.0
    min_updates: int = 1


@ROUND_POLICIES.register("semi_async", params=SemiAsyncParams)
class SemiAsyncRounds(RoundPolicy):
    """Async dispatch (``concurrency`` in flight), but the buffer closes at ``agg_goal`` updates or
    every ``period_s`` seconds with at least ``min_updates`` in it, whichever comes first."""

    name = "semi_async"

    def __init__(self, params: SemiAsyncParams, cfg: OrchestratorConfig) -> None:
        super().__init__(cfg)
        self.params = params
        self.next_close: float | None = None
        self.closed_by_timer = 0

    def need(self, orch: Orchestrator) -> int:
        if self.next_close is None:
            self.next_close = orch.now + self.params.period_s
        return self.cfg.concurrency - orch.train_in_flight

    def on_buffered(self, orch: Orchestrator, task: Task, out: list[Command]) -> None:
        if orch.buffered >= self.cfg.agg_goal:
            orch.aggregate(out)

    def on_aggregated(self, orch: Orchestrator) -> None:
        orch.start_round(orch.version)
        self.next_close = orch.now + self.params.period_s

    def on_timers(self, orch: Orchestrator, out: list[Command]) -> None:
        if self.next_close is None or orch.now < self.next_close:
            return
        if orch.buffered >= self.params.min_updates:
            self.closed_by_timer += 1
            orch.aggregate(out)  # on_aggregated moves the next close
        else:
            self.next_close = orch.now + self.params.period_s

    def wakeup(self) -> float | None:
        return self.next_close

    def state_dict(self) -> dict[str, Any]:
        return {"next_close": self.next_close, "closed_by_timer": self.closed_by_timer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_close = state["next_close"]
        self.closed_by_timer = int(state["closed_by_timer"])


# ---------------------------------------------------------------------- an availability policy
class CooldownParams(_Params):
    cooldown_s: float = 120.0


@AVAILABILITY.register("cooldown", params=CooldownParams)
class TimeoutCooldown(AvailabilityPolicy):
    """A small availability predictor: trust reported tiers (as the oracle baselines do), and
    predict that a client that timed out stays away for ``cooldown_s`` seconds."""

    name = "cooldown"

    def __init__(self, params: CooldownParams, cfg: OrchestratorConfig) -> None:
        super().__init__(cfg)
        self.cooldown_s = params.cooldown_s
        self.until: dict[int, float] = {}

    def train_rows(self, clients: ClientMap, now: float) -> np.ndarray:
        rows = clients.idle_rows(Tier.AVL_TRAIN)
        away = [c for c, t in self.until.items() if t > now]
        return rows if not away else rows[~np.isin(clients.ids_of(rows), away)]

    def on_timeout(self, orch: Orchestrator, task: Task) -> None:
        self.until[task.client_id] = orch.now + self.cooldown_s

    def state_dict(self) -> dict[str, Any]:
        return {
            "client": np.fromiter(self.until, dtype=np.int64),
            "until": np.array(list(self.until.values())),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.until = dict(zip(state["client"].tolist(), state["until"].tolist(), strict=True))


# ---------------------------------------------------------------------- an objective (by import path)
class ScaledCE(Objective):
    """Cross-entropy times ``scale``: its constructor's keywords are its typed parameters. It
    overrides one hook, ``loss``, written once for both training paths."""

    name = "scaled_ce"

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def loss(
        self, per: torch.Tensor, mask: torch.Tensor | None, y: torch.Tensor, extra: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        loss, stat = super().loss(per, mask, y, extra)
        return self.scale * loss, stat


def test_an_objective_by_import_path_with_typed_parameters() -> None:
    over = {"client": {"objective": "test_extending:ScaledCE", "objective_params": {"scale": "2.5"}}}
    objective = build_objective(resolve_config(None, None, deep_merge(TINY, over)))
    assert isinstance(objective, ScaledCE) and objective.scale == 2.5
    over["client"]["objective_params"] = {"scale": 1.0, "shift": 1.0}
    with pytest.raises(ConfigError, match=r"client\.objective_params\.shift: unknown key"):
        build_objective(resolve_config(None, None, deep_merge(TINY, over)))


def test_an_objective_that_overrides_one_hook_trains_the_same_alone_and_in_cohorts() -> None:
    """``ScaledCE`` writes ``loss`` only, once: the cohort path trains its rule, not the inherited
    cross-entropy. Update by update (the conformance check users run) and over a whole run,
    ``run.cohort`` 1 and 8 agree to the last bits of fp32, and the model is not plain CE's."""
    report = check_objective(ScaledCE(2.5))
    assert report.cohort and report.tasks == 10 and report.largest["delta"] < 1e-6

    def final(objective: str, cohort: int) -> np.ndarray:
        over = {
            "client": {
                "objective": objective,
                "objective_params": {"scale": 2.5} if ":" in objective else {},
            },
            "run": {"cohort": cohort, "max_aggregations": 4, "stop_at_target": False},
        }
        res = run_config(resolve_config(None, "fedbuff", deep_merge(TINY_DATA, over)), None, plots=False)
        return res.built.orch.weights

    alone, stacked = final("test_extending:ScaledCE", 1), final("test_extending:ScaledCE", 8)
    np.testing.assert_allclose(alone, stacked, rtol=0, atol=1e-5)
    assert np.abs(alone - final("ce", 8)).max() > 1e-3


# ---------------------------------------------------------------------- runs
TINY_DATA: dict[str, Any] = {
    "model": "mlp",
    "dataset": {"name": "digits"},
    "partition": {"num_clients": 12, "alpha": 0.5},
    "trace": {"kind": "always"},
}
TINY: dict[str, Any] = {
    "model": "mlp",
    "dataset": {"name": "digits"},
    "partition": {"num_clients": 12, "alpha": 0.5},
    "trace": {"kind": "slotted", "unavailable_fraction": 0.3, "slot_s": 40.0},
    "runtime": {"kind": "uniform", "low_s": 5.0, "high_s": 60.0},
    "orchestrator": {
        "mode": "semi_async",
        "mode_params": {"period_s": 20.0},
        "knowledge": "cooldown",
        "knowledge_params": {"cooldown_s": 50.0},
        "agg_goal": 4,
        "concurrency": 5,
        "task_timeout_s": 30.0,
    },
    "selector": {"name": "fewest_updates", "params": {}},
    "aggregator": {"name": "test_extending:make_sample_power", "server_lr": 1.0, "params": {"power": 0.5}},
    "eval_selector": {"name": "none"},
    "run": {"max_aggregations": 6, "stop_at_target": False},
}


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_new_policies_run_through_a_config() -> None:
    res = run_config(resolve_config(None, None, TINY), None, plots=False)
    orch = res.built.orch
    assert isinstance(orch.selector, FewestUpdates) and orch.selector.calls > 0
    assert isinstance(orch.aggregator, SamplePowerAggregator) and orch.aggregator.power == 0.5
    assert isinstance(orch.rounds, SemiAsyncRounds) and isinstance(orch.availability, TimeoutCooldown)
    assert res.summary["aggregations"] == 6 and np.isfinite(res.summary["final_accuracy"])
    # The period closed some buffers before agg_goal updates arrived, and the timeouts fed the predictor.
    assert orch.rounds.closed_by_timer > 0 and orch.availability.until
    assert res.summary["updates_applied"] < 6 * 4
    # Fewest-updates spreads the work: every client that ever became available contributed.
    assert (orch.clients.column("times_updated") > 0).sum() >= 8
    again = run_config(resolve_config(None, None, TINY), None, plots=False).summary
    assert {k: v for k, v in again.items() if k not in ("wall_time_s", "provenance")} == {
        k: v for k, v in res.summary.items() if k not in ("wall_time_s", "provenance")
    }


def test_policy_state_is_checkpointed() -> None:
    res = run_config(
        resolve_config(None, None, deep_merge(TINY, {"run": {"max_aggregations": 3}})), None, plots=False
    )
    state = res.built.orch.state_dict()
    assert state["round_policy"]["closed_by_timer"] == res.built.orch.rounds.closed_by_timer
    cfg = res.built.orch.cfg
    fresh = Orchestrator(
        cfg,
        np.zeros_like(res.built.orch.weights),
        FewestUpdates(),
        SamplePowerAggregator(0.5, 1.0),
        np.random.default_rng(0),
    )
    fresh.load_state_dict(state)
    assert (
        isinstance(fresh.rounds, SemiAsyncRounds)
        and fresh.rounds.next_close == res.built.orch.rounds.next_close
    )
    assert isinstance(fresh.availability, TimeoutCooldown)
    assert fresh.availability.until == res.built.orch.availability.until


def test_semi_async_closes_a_partial_buffer_on_its_period() -> None:
    cfg = OrchestratorConfig(
        mode="semi_async", agg_goal=3, concurrency=2, task_timeout_s=None, mode_params={"period_s": 10.0}
    )
    o = Orchestrator(
        cfg,
        np.zeros(2, np.float32),
        FewestUpdates(),
        SamplePowerAggregator(1.0, 1.0),
        np.random.default_rng(0),
    )
    out = o.handle(ClientRegistered(0.0, 0, 10)) + o.handle(ClientRegistered(0.0, 1, 10))
    tasks = [c for c in out if c.__class__.__name__ == "DispatchTrain"]
    assert len(tasks) == 2 and o.next_wakeup() == 10.0
    update = ClientUpdate(10, 1.0, 0.5, 1.0, np.ones(2, np.float32))
    assert not [
        c for c in o.handle(TaskFinished(4.0, 0, tasks[0].task_id, update)) if isinstance(c, NewModelVersion)
    ]
    versions = [c for c in o.handle(Tick(10.0)) if isinstance(c, NewModelVersion)]
    assert len(versions) == 1 and versions[0].report.client_ids == (0,)  # one update, below agg_goal
    assert o.next_wakeup() == 20.0


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"selector": {"name": "fewest_updates", "params": {"foo": 1}}}, "selector.params.foo: unknown key"),
        ({"aggregator": {"name": "sample_power", "params": {"power": "strong"}}}, "aggregator.params.power"),
        (
            {"orchestrator": {"mode_params": {"period": 1}}},
            "orchestrator.round_policy_params.period: unknown key",
        ),
        ({"orchestrator": {"knowledge": "psychic"}}, "unknown availability policy 'psychic'"),
        (
            {"orchestrator": {"mode": "no_such_module:rounds"}},
            "cannot import module 'no_such_module' for 'no_such_module:rounds'",
        ),
        ({"selector": {"name": "oort", "params": {"bse": "fedscale"}}}, "selector.params.bse: unknown key"),
        (
            {"selector": {"name": "refl_ips", "params": {"oort": {"cut_off": 1}}}},
            "selector.params.oort.cut_off",
        ),
        (
            {"client": {"objective": "fedprox", "objective_params": {"nu": 1}}},
            "client.objective_params.nu: unknown key",
        ),
    ],
)
def test_bad_policy_parameters_name_the_key(over: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("(", r"\(")):
        run_config(resolve_config(None, None, deep_merge(TINY, over)), None, plots=False)


@pytest.mark.parametrize(
    ("mode", "setting", "value"),
    [("sync", "concurrency", 5), ("async", "overcommit", 2.0), ("async", "deadline_s", 60.0)],
)
def test_a_round_setting_the_policy_does_not_read_is_named(
    mode: str, setting: str, value: float, caplog: pytest.LogCaptureFixture
) -> None:
    """Each round policy declares the shared settings it reads: one it would ignore is named when
    the config is read (a warning: one ``--set`` may serve several strategies of a comparison);
    at its default it changes nothing and is not named, nor under a policy that declares nothing."""
    with caplog.at_level("WARNING", logger="felix.config"):
        validate({"orchestrator": {"mode": mode, setting: value}})
    assert f"round policy '{mode}' does not use orchestrator.{setting}" in caplog.text
    caplog.clear()
    default = OrchestratorConfig.model_fields[setting].get_default()
    with caplog.at_level("WARNING", logger="felix.config"):
        validate({"orchestrator": {"mode": mode, setting: default}})
        semi = {"mode": "semi_async", "mode_params": {"period_s": 1.0}, setting: value}  # declares no reads
        validate({"orchestrator": semi})
    assert "does not use" not in caplog.text


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        (
            {"client": {"objective": "fedprox", "objective_params": {"mu": "strong"}}},
            "objective 'fedprox': client.objective_params.mu: Input should be a valid number",
        ),
        (
            {"client": {"objective": "test_extending:ScaledCE", "objective_params": {"shift": 1}}},
            "objective 'test_extending:ScaledCE': client.objective_params.shift: unknown key",
        ),
        ({"selector": {"name": "oort", "params": {"bse": "fedscale"}}}, "selector.params.bse: unknown key"),
        ({"data_plan": "dafl_v2"}, "data_plan: unknown data plan 'dafl_v2'"),
        ({"client": {"objective": "nope"}}, "client.objective: unknown objective 'nope'"),
    ],
)
def test_the_config_checks_each_component_by_its_own_parameters(over: dict[str, Any], needle: str) -> None:
    """When the config is read, before anything is built: one line naming the component and key."""
    with pytest.raises(ConfigError) as err:
        resolve_config(None, None, deep_merge(TINY, over))
    assert needle in str(err.value)
    assert len(str(err.value).splitlines()) == 1


def test_data_plan_is_any_registered_plan() -> None:
    from felix.core.dataplan import DATA_PLANS

    for name in DATA_PLANS.names():
        assert resolve_config(None, None, deep_merge(TINY, {"data_plan": name})).data_plan == name


def test_each_setting_is_declared_once() -> None:
    """The orchestrator's, admission's and validation's settings are one model each, which the
    config holds as its section and the core reads as it is: no twin whose default, bound or field
    could drift. A setting given in a config arrives, and the trainer's settings come from the
    client section."""
    from felix.client.trainer import TrainConfig
    from felix.config import Config
    from felix.core.admission import AdmissionConfig
    from felix.core.validation import ValidationConfig

    assert Config.model_fields["orchestrator"].annotation is OrchestratorConfig
    assert Config.model_fields["validation"].annotation is ValidationConfig
    assert OrchestratorConfig.model_fields["admission"].annotation is AdmissionConfig
    cfg = resolve_config(
        None, None, deep_merge(TINY, {"orchestrator": {"overcommit": 1.7, "max_staleness": 4}})
    )
    o = build_orchestrator(cfg, np.zeros(4, np.float32), None)
    assert o.cfg is cfg.orchestrator
    assert (o.cfg.overcommit, o.cfg.max_staleness, o.cfg.round_policy_params) == (1.7, 4, {"period_s": 20.0})
    assert o.validator.config is cfg.validation
    t = TrainConfig.of(cfg.client.model_copy(update={"momentum": 0.5, "probe_loss": True}))
    assert (t.momentum, t.probe_loss_key) == (0.5, "qffl_loss")


def test_factories_get_the_run_facts_not_the_config() -> None:
    """A strategy factory's ``ctx`` is the run's few facts (``RunFacts``), filled from the config;
    Oort's reward cap comes from the client's step cap and batch size there."""
    from felix.engine.components import run_facts

    seen: list[Any] = []

    @TRAIN_SELECTORS.register("facts_probe", params=FewestUpdatesParams)
    def _probe(params: FewestUpdatesParams, ctx: Any) -> FewestUpdates:
        seen.append(ctx)
        return FewestUpdates()

    over = {"selector": {"name": "facts_probe"}, "client": {"max_steps": 3, "batch_size": 4}}
    cfg = resolve_config(None, None, deep_merge(TINY, over))
    build_orchestrator(cfg, np.zeros(4, np.float32), None)
    assert seen == [run_facts(cfg)] and isinstance(seen[0], RunFacts)
    assert (seen[0].num_clients, seen[0].max_steps, seen[0].batch_size, seen[0].agg_goal) == (12, 3, 4, 4)
    oort = resolve_config(
        None, None, deep_merge(TINY, {"selector": {"name": "oort"}, "client": over["client"]})
    )
    assert build_orchestrator(oort, np.zeros(4, np.float32), None).selector.reward_cap == 12


def test_shared_settings_are_not_redeclared() -> None:
    """Where two models hold the same settings (the client section and the trainer's; the dafl
    section and the planner's), both derive from one model and neither redeclares a field: a
    default, a bound or a description of one cannot differ from the other's."""
    from felix.client.settings import TrainSettings, buffers_field
    from felix.client.trainer import TrainConfig
    from felix.config import ClientCfg, DaflCfg, DaflPlannerCfg
    from felix.strategies.dataplans.dafl import DaflParams

    for base, subs in ((TrainSettings, (ClientCfg, TrainConfig)), (DaflPlannerCfg, (DaflCfg, DaflParams))):
        for sub in subs:
            assert issubclass(sub, base)
            for name, info in base.model_fields.items():
                assert repr(sub.model_fields[name]) == repr(info), (sub.__name__, name)
    assert repr(ClientCfg.model_fields["buffers"]) == repr(TrainConfig.model_fields["buffers"])
    assert ClientCfg().buffers == TrainConfig().buffers == buffers_field().default  # type: ignore[attr-defined]
    assert TrainConfig().lr == ClientCfg().lr == 0.05


# ---------------------------------------------------------------------- a dataset and a trace format
@DATASETS.register("test_blobs")
def blobs(root: str | None, download: bool, n: int = 600, dim: int = 8) -> tuple[ArrayDataset, ArrayDataset]:
    """Three Gaussian blobs in ``dim`` dimensions, made here (no file): a dataset is one loader."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(3, dim, generator=g) * 3

    def split(count: int) -> ArrayDataset:
        y = torch.arange(count) % 3
        x = centres[y] + torch.randn(count, dim, generator=g)
        return ArrayDataset(x.view(count, 1, 1, dim).float(), y.long(), ["a", "b", "c"])

    return split(n), split(n // 3)


@TRACES.register("test_alternating")
def alternating(
    cfg: Any, num_clients: int, rng: np.random.Generator, period_s: float = 50.0
) -> AvailabilityTrace:
    """Even clients available in the first half of every period, odd ones in the second: a trace
    format is one builder."""
    half = period_s / 2
    devs = []
    for c in range(num_clients):
        first, second = (Tier.AVL_TRAIN, Tier.UN_AVL) if c % 2 == 0 else (Tier.UN_AVL, Tier.AVL_TRAIN)
        devs.append(DeviceTrace.from_events([(0.0, first), (half, second)], period=period_s, initial=first))
    return AvailabilityTrace(tuple(devs), "test_alternating")


def test_a_dataset_and_a_trace_format_defined_here_run_through_a_config() -> None:
    cfg = resolve_config(
        None,
        "fedbuff",
        {
            "model": "mlp",
            "dataset": {"name": "test_blobs", "params": {"dim": 8}},
            "partition": {"num_clients": 10, "alpha": 1.0},
            "trace": {"kind": "test_alternating", "params": {"period_s": 40.0}},
            "runtime": {"kind": "uniform", "low_s": 2.0, "high_s": 8.0},
            "orchestrator": {"agg_goal": 2, "concurrency": 4},
            "run": {"max_aggregations": 8, "stop_at_target": False},
        },
    )
    res = run_config(cfg, None, plots=False)
    assert res.summary["aggregations"] == 8
    # The blobs are separable: the model learns them; the trace's halves both trained.
    assert res.summary["final_accuracy"] > 0.6
    trained = res.built.orch.clients.column("times_updated") > 0
    assert trained[0::2].any() and trained[1::2].any()


class _TappedServer:
    """A server link that records what it sends, then hands it to the in-memory link it wraps."""

    def __init__(self, link: ServerLink, seen: list[tuple[Channel, int | None]]) -> None:
        self.link, self.seen = link, seen

    @property
    def connected(self) -> bool:
        return self.link.connected

    def start(self, fresh: bool, stop: threading.Event | None = None) -> None:
        self.link.start(fresh, stop)

    def ready(self) -> bool:
        return self.link.ready()

    def send(self, channel: Channel, client: int | None, payload: bytes) -> None:
        self.seen.append((channel, client))
        self.link.send(channel, client, payload)

    def ack(self, acks: list[Ack]) -> None:
        self.link.ack(acks)

    def close(self, timeout: float = 5.0) -> None:
        self.link.close(timeout)


class _TappedClient:
    """A client link that records what it sends (channel and its own id), likewise."""

    def __init__(self, link: ClientLink, client: int, seen: list[tuple[Channel, int | None]]) -> None:
        self.link, self.client, self.seen = link, client, seen

    @property
    def connected(self) -> bool:
        return self.link.connected

    def set_will(self, channel: Channel, builder: Callable[[int], bytes], delay_s: int) -> None:
        self.link.set_will(channel, builder, delay_s)

    def start(self, fresh: bool) -> None:
        self.link.start(fresh)

    def send(self, channel: Channel, payload: bytes) -> None:
        self.seen.append((channel, self.client))
        self.link.send(channel, payload)

    def close(self, timeout: float = 5.0) -> None:
        self.link.close(timeout)


class TappedMemory:
    """A transport defined here: the in-memory one with a tap that records each message's channel
    and client (a stand-in for what a new transport adds: a log, a proxy, another carrier)."""

    options = MemoryOptions  # its options model: the in-memory one's

    def __init__(self) -> None:
        self.inner = InMemoryTransport()  # its own broker object, shared by both ends
        self.seen: list[tuple[Channel, int | None]] = []

    def server_link(self, args: ServerLinkArgs) -> ServerLink:
        return _TappedServer(self.inner.server_link(args), self.seen)

    def client_link(self, args: ClientLinkArgs) -> ClientLink:
        return _TappedClient(self.inner.client_link(args), args.client, self.seen)


TAPPED = TappedMemory()
TRANSPORTS.register("tapped-memory")(TAPPED)


def test_a_transport_defined_here_carries_a_deployment(tmp_path: Path) -> None:
    """A server and two client hosts in threads, over the transport registered above by name."""
    cfg = resolve_config(
        None,
        "fedbuff",
        {
            "model": "mlp",
            "partition": {"num_clients": 2},
            "trace": {"kind": "always"},
            "runtime": {"kind": "constant", "constant_s": 10.0},
            "orchestrator": {"agg_goal": 1, "concurrency": 1},
            "run": {"max_aggregations": 2, "target_accuracy": 1.0, "max_time_s": 20000.0},
        },
    )
    opts = ServeOptions(
        MemoryOptions(),
        run_id="ext",
        out_dir=tmp_path,
        time_scale=0.02,
        status_every_s=1e9,
        transport="tapped-memory",
    )
    server = Server(cfg, opts)
    serving = Background(server.run, "server")
    serving.start()
    copts = ClientOptions(
        MemoryOptions(), run_id="ext", time_scale=0.02, max_wall_s=60.0, transport="tapped-memory"
    )
    hosts = [ClientHost(cfg, [cid], copts, lambda cid: (None, None)) for cid in (0, 1)]
    threads = [Background(h.run, f"client-{i}") for i, h in enumerate(hosts)]
    try:
        for t in threads:
            t.start()
        summ = serving.result(60)
        for t in threads:
            t.result(20)
    finally:
        server.stop_requested.set()
        for h in hosts:
            h.stop_requested.set()
    assert summ["stop_reason"] == "max_aggregations" and summ["updates_applied"] == 2
    channels = {ch for ch, _ in TAPPED.seen}
    assert {Channel.REGISTER, Channel.TASK, Channel.RESULT, Channel.STATUS} <= channels
    assert {cid for ch, cid in TAPPED.seen if ch is Channel.REGISTER} == {0, 1}


@RUNTIMES.register("test_by_index")
def by_index(cfg: Any, num_clients: int, rng: np.random.Generator, sizes: list[int] | None) -> np.ndarray:
    """Client i trains for ``constant_s`` times (i + 1) seconds."""
    return cfg.constant_s * (np.arange(num_clients) + 1.0)


def test_a_runtime_profile_defined_here_gives_the_runtimes_and_a_misspelt_one_fails_on_read() -> None:
    cfg = validate({"partition": {"num_clients": 3}, "runtime": {"kind": "test_by_index", "constant_s": 2.0}})
    assert build_runtimes(cfg).tolist() == [2.0, 4.0, 6.0]
    with pytest.raises(ConfigError, match="runtime.kind: unknown runtime profile 'halfnormale'"):
        validate({"runtime": {"kind": "halfnormale"}})


def test_a_misspelt_trace_parameter_fails_when_the_config_is_read() -> None:
    """A registered builder's keyword parameters are its typed parameters (from its signature)."""
    with pytest.raises(
        ConfigError, match=r"^config: trace.params.perod_s: unknown key \(did you mean `period_s`\?\)$"
    ):
        validate({"trace": {"kind": "test_alternating", "params": {"perod_s": 40.0}}})
    with pytest.raises(ConfigError, match=r"^config: trace.params.period_s: unknown key$"):
        validate({"trace": {"kind": "slotted", "params": {"period_s": 40.0}}})
