"""Every number a client reports has a declared finite range, checked at decode; the orchestrator's
arithmetic cannot raise on what is accepted; an aggregation that fails at any step is undone whole.

The attack these reproduce: two logins report ``stat_utility`` = 1.7e308 (finite, so it was
accepted); Oort exploits them, and its pacer's ``math.fsum`` raised ``OverflowError`` inside
``Orchestrator.aggregate`` after the version had moved on, so every later aggregation changed the
model without a version, report or checkpoint.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from felix.core.commands import Command, DispatchEval, DispatchTrain, NewModelVersion, UpdateRejected
from felix.core.events import ClientRegistered, TaskFinished
from felix.core.orchestrator import Orchestrator, OrchestratorConfig
from felix.core.refusals import Refusal
from felix.core.types import ClientUpdate, TaskKind, Tier
from felix.deploy import wire
from felix.metrics.report import write_run
from felix.strategies.aggregation.fedavg import FedBuffAggregator
from felix.strategies.selection.oort import OortParams, OortSelector

DIM = 4
CLIENTS = 4
EXTREME_FLOATS = [1.7e308, -1.7e308, 1e300, 1e36, 1e30, 1e15, 5e-324, -0.0, 0.0, 1.0]
EXTREME_INTS = [0, 1, 2**31, 2**40, 2**40 + 1, 2**53 + 1, 2**62, 2**63, 2**70]
floats = st.one_of(st.sampled_from(EXTREME_FLOATS), st.floats(allow_nan=False, allow_infinity=False))
ints = st.one_of(st.sampled_from(EXTREME_INTS), st.integers(0, 2**70))


def oort_orchestrator() -> Orchestrator:
    """Oort that exploits from the start (no exploration), a version per update."""
    cfg = OrchestratorConfig(mode="async", agg_goal=1, concurrency=2, knowledge="tiertrack")
    params = OortParams(exploration_factor=0.0, exploration_min=0.0, rounding="stochastic", pacer_step=1)
    o = Orchestrator(
        cfg, np.zeros(DIM, np.float32), OortSelector(params), FedBuffAggregator(), np.random.default_rng(0)
    )
    return o


def decoded(task: DispatchTrain | DispatchEval, fields: dict[str, Any]) -> ClientUpdate | None:
    """The update as the MQTT shell would hand it over (None: refused at decode)."""
    train = isinstance(task, DispatchTrain)
    msg = wire.Result(
        run="r",
        msg_id="i-1",
        sent_at=fields["sent"],
        client=task.client_id,
        incarnation="i",
        task=fields["task"] if fields["forge_task"] else task.task_id,
        kind=TaskKind.TRAIN if train else TaskKind.EVAL,
        version=fields["version"],
        update=ClientUpdate(
            num_samples=fields["num_samples"],
            stat_utility=fields["stat_utility"],
            loss=fields["loss"],
            duration=fields["duration"],
            delta=np.full(DIM, 1e-3, np.float32) if train else None,
        ),
    )
    try:
        got = wire.decode(wire.encode(msg))
    except wire.MessageError:
        return None
    assert isinstance(got, wire.Result)
    upd = got.update
    for name in ("stat_utility", "loss", "duration"):
        assert math.isfinite(getattr(upd, name)) and abs(getattr(upd, name)) <= 1e36
    assert 0 <= upd.num_samples <= 2**40 and 0 <= got.sent_at <= 1e11
    assert max(got.task, got.version, got.client) <= 2**62
    return upd


def drive(o: Orchestrator, answers: list[dict[str, Any]]) -> tuple[list[Command], int]:
    """Register the clients, then answer each task in turn with the next drawn fields."""
    out: list[Command] = []
    for cid in range(CLIENTS):
        out += o.handle(ClientRegistered(0.0, cid, 100, Tier.AVL_TRAIN))
    pending = [c for c in out if isinstance(c, (DispatchTrain, DispatchEval))]
    t, refused = 0.0, 0
    for fields in answers:
        if not pending:
            break
        task = pending.pop(0)
        upd = decoded(task, fields)
        if upd is None:
            refused += 1
            continue  # the task stays open until its timer (not reached here)
        t += 1.0
        cmds = o.handle(TaskFinished(t, task.client_id, task.task_id, upd))
        out += cmds
        pending += [c for c in cmds if isinstance(c, (DispatchTrain, DispatchEval))]
    return out, refused


answer = st.fixed_dictionaries(
    {
        "sent": floats,
        "task": ints,
        "forge_task": st.booleans(),
        "version": ints,
        "num_samples": ints,
        "stat_utility": floats,
        "loss": floats,
        "duration": floats,
    }
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(answer, min_size=4, max_size=30))
def test_extreme_finite_values_in_every_field_cannot_break_aggregation(answers: list[dict[str, Any]]) -> None:
    """Whatever finite values a client reports, in any field: decode refuses what is outside its
    declared range, the orchestrator never raises on the rest, and every model change is a
    version with its report (versions == NewModelVersion commands, applied == reported)."""
    o = oort_orchestrator()
    out, _ = drive(o, answers)
    versions = [c for c in out if isinstance(c, NewModelVersion)]
    assert o.version == len(versions) == len(o.stats.aggregation_times)
    assert o.stats.updates_applied == sum(len(v.report.client_ids) for v in versions)
    if not versions:
        assert np.array_equal(o.weights, np.zeros(DIM, np.float32))
    assert all(math.isfinite(h) for h in o.selector.exploit_history)  # type: ignore[attr-defined]


def test_two_logins_reporting_utility_1_7e308_are_refused_and_the_run_goes_on() -> None:
    """The attack: refused at decode, and refused by the orchestrator too (a shell that skipped
    decoding, or the simulator, is held to the same ranges); honest versions keep coming."""
    huge = {"sent": 1.0, "task": 0, "forge_task": False, "version": 0, "num_samples": 10}
    huge |= {"stat_utility": 1.7e308, "loss": 0.5, "duration": 1.0}
    o = oort_orchestrator()
    out = [c for cid in range(CLIENTS) for c in o.handle(ClientRegistered(0.0, cid, 100, Tier.AVL_TRAIN))]
    task = next(c for c in out if isinstance(c, DispatchTrain))
    assert decoded(task, huge) is None
    upd = ClientUpdate(10, 1.7e308, 0.5, 1.0, np.full(DIM, 1e-3, np.float32))
    cmds = o.handle(TaskFinished(1.0, task.client_id, task.task_id, upd))
    assert [c.reason for c in cmds if isinstance(c, UpdateRejected)] == [
        "stat_utility outside its declared range (|value| <= 1e+36)"
    ]
    honest = {**huge, "stat_utility": 3.0}
    done, _ = drive(oort_orchestrator(), [honest] * 12)
    assert sum(isinstance(c, NewModelVersion) for c in done) >= 10


class FailingPacer(OortSelector):
    """A selector whose round-end step raises once armed (any policy arithmetic that fails)."""

    armed = False

    def on_round_end(self, round_: int, ctx: Any) -> None:
        super().on_round_end(round_, ctx)
        if self.armed:
            raise OverflowError("intermediate overflow in fsum")


def test_an_aggregation_that_fails_at_any_step_is_rolled_back_whole() -> None:
    """The failure comes after the version, model, stats and the selector's state have moved: all
    of it is put back, the buffered update is rejected (not applied), and the next aggregation
    makes the next version, as if the failed one had never begun."""
    cfg = OrchestratorConfig(mode="async", agg_goal=1, concurrency=2, knowledge="tiertrack")
    sel = FailingPacer(OortParams(exploration_factor=0.0, exploration_min=0.0, rounding="stochastic"))
    o = Orchestrator(cfg, np.zeros(DIM, np.float32), sel, FedBuffAggregator(), np.random.default_rng(0))
    out = [c for cid in range(CLIENTS) for c in o.handle(ClientRegistered(0.0, cid, 100, Tier.AVL_TRAIN))]
    tasks = [c for c in out if isinstance(c, DispatchTrain)]
    upd = ClientUpdate(10, 2.0, 0.5, 1.0, np.full(DIM, 1e-3, np.float32))
    first = o.handle(TaskFinished(1.0, tasks[0].client_id, tasks[0].task_id, upd))
    assert [c.version for c in first if isinstance(c, NewModelVersion)] == [1]
    before = (o.version, o.round, o.weights.copy(), o.stats.mark(), sel.state_dict(), o.model_path.total)
    sel.armed = True
    failed = o.handle(TaskFinished(2.0, tasks[1].client_id, tasks[1].task_id, upd))
    assert not any(isinstance(c, NewModelVersion) for c in failed)
    rejected = [c for c in failed if isinstance(c, UpdateRejected)]
    assert len(rejected) == 1 and rejected[0].reason.startswith("aggregation failed and was rolled back")
    assert (o.version, o.round) == before[:2]
    assert np.array_equal(o.weights, before[2])
    aggregation_stats = ("updates_applied", "aggregation_times", "staleness", "agg_weights")
    assert {k: o.stats.mark()[k] for k in aggregation_stats} == {k: before[3][k] for k in aggregation_stats}
    assert o.stats.rejected == before[3]["rejected"] + 1
    after = sel.state_dict()  # (the same event then selects: its pending picks move on)
    for key in ("exploit_history", "round_threshold", "exploration", "exploit_replied"):
        assert np.array_equal(np.asarray(after[key]), np.asarray(before[4][key])), key
    assert o.model_path.total == before[5]
    assert o.buffered == 0
    sel.armed = False
    nxt = next(c for c in failed if isinstance(c, DispatchTrain))
    again = o.handle(TaskFinished(3.0, nxt.client_id, nxt.task_id, upd))
    assert [c.version for c in again if isinstance(c, NewModelVersion)] == [2]


@pytest.mark.parametrize("sent", [-1.7e308, 1.7e308, float("inf"), float("nan"), -1.0])
def test_a_state_message_sent_at_an_absurd_time_is_refused(sent: float) -> None:
    """``sent`` = -1.7e308 made the server's delivery delay infinite: now it is outside the
    declared range of a Unix time and refused at decode."""
    msg = wire.State(run="r", msg_id="i-1", sent_at=0.0, client=1, incarnation="i", tier=Tier.AVL_TRAIN)
    raw = wire.encode(msg)
    hlen = wire._PREFIX.unpack_from(raw, 0)[2]
    header = json.loads(raw[wire.PREFIX_BYTES : wire.PREFIX_BYTES + hlen])
    header["sent"] = sent
    text = json.dumps(header).encode()
    data = wire._PREFIX.pack(wire.MAGIC, wire.FORMAT_VERSION, len(text)) + text
    with pytest.raises(wire.MessageError) as err:
        wire.decode(data)
    assert err.value.code is Refusal.BAD_FIELD and "'sent'" in str(err.value)


def test_summary_json_is_strict_json_whatever_was_measured(tmp_path: Path) -> None:
    summ = {
        "strategy": "x",
        "target_accuracy": 0.5,
        "transport": {"latency_p50_ms": math.inf, "latency_p95_ms": -math.inf},
        "final_accuracy": float("nan"),
        "curve": [1.0, np.float64("inf")],
    }
    write_run(tmp_path, summ, [], plots=False)
    back = json.loads((tmp_path / "summary.json").read_text(), parse_constant=_refuse)
    assert back["transport"] == {"latency_p50_ms": None, "latency_p95_ms": None}
    assert back["final_accuracy"] is None and back["curve"] == [1.0, None]


def _refuse(name: str) -> None:
    raise ValueError(f"summary.json holds {name}, which is not JSON")
