"""The sans-I/O orchestrator driven by hand-written event sequences."""

from __future__ import annotations

import numpy as np
import pytest

from felix.core.commands import CancelTask, DispatchTrain, NewModelVersion, UpdateRejected
from felix.core.events import ClientRegistered, TaskFailed, TaskFinished, Tick, TierChanged
from felix.core.orchestrator import AvailabilityName, Orchestrator, OrchestratorConfig
from felix.core.refusals import Refusal
from felix.core.types import ClientUpdate, TaskKind, Tier
from felix.core.validation import AuxDecl
from felix.strategies.aggregation.fedavg import FedAvgAggregator, FedBuffAggregator
from felix.strategies.selection.random import RandomSelector

DIM = 4


def make(mode: str = "async", knowledge: AvailabilityName = AvailabilityName.NONE, **kw) -> Orchestrator:
    cfg = OrchestratorConfig(mode=mode, knowledge=knowledge, **kw)
    agg = FedBuffAggregator() if mode == "async" else FedAvgAggregator()
    return Orchestrator(cfg, np.zeros(DIM, np.float32), RandomSelector(), agg, np.random.default_rng(0))


def register(o: Orchestrator, n: int, tier: Tier = Tier.AVL_TRAIN, t: float = 0.0) -> list:
    out = []
    for c in range(n):
        out += o.handle(ClientRegistered(t, c, num_samples=100 * (c + 1), tier=tier))
    return out


def upd(value: float = 1.0, n: int = 10, utility: float = 1.0) -> ClientUpdate:
    return ClientUpdate(
        num_samples=n, stat_utility=utility, loss=0.5, duration=5.0, delta=np.full(DIM, value, np.float32)
    )


def dispatched(cmds: list) -> list[DispatchTrain]:
    return [c for c in cmds if isinstance(c, DispatchTrain)]


def test_async_keeps_concurrency_topped_up_and_aggregates_at_goal():
    o = make(concurrency=3, agg_goal=2)
    cmds = register(o, 5)
    tasks = dispatched(cmds)
    assert len(tasks) == 3  # concurrency reached as soon as three clients exist
    out = o.handle(TaskFinished(1.0, tasks[0].client_id, tasks[0].task_id, upd(1.0)))
    assert len(dispatched(out)) == 1  # the freed slot is refilled at once
    out = o.handle(TaskFinished(2.0, tasks[1].client_id, tasks[1].task_id, upd(3.0)))
    versions = [c for c in out if isinstance(c, NewModelVersion)]
    assert len(versions) == 1 and versions[0].version == 1
    # FedBuff, both fresh: weights 1 and 1 normalised -> mean delta 2.0
    np.testing.assert_allclose(versions[0].weights, np.full(DIM, 2.0))
    assert o.stats.updates_applied == 2


def test_staleness_is_versions_since_dispatch_and_fedbuff_downweights():
    o = make(concurrency=2, agg_goal=1)
    tasks = dispatched(register(o, 2))
    o.handle(TaskFinished(1.0, tasks[0].client_id, tasks[0].task_id, upd(1.0)))  # version 1
    out = o.handle(TaskFinished(2.0, tasks[1].client_id, tasks[1].task_id, upd(1.0)))  # base 0 -> T=1
    v = next(c for c in out if isinstance(c, NewModelVersion))
    assert v.report.staleness == (1,)
    assert o.stats.staleness == [0, 1]


def test_sync_overcommits_and_cancels_stragglers():
    o = make(mode="sync", agg_goal=2, overcommit=1.5, task_timeout_s=None)
    tasks = dispatched(register(o, 10))
    assert len(tasks) == 3  # ceil(2 * 1.5)
    o.handle(TaskFinished(1.0, tasks[0].client_id, tasks[0].task_id, upd(1.0, n=10)))
    out = o.handle(TaskFinished(2.0, tasks[1].client_id, tasks[1].task_id, upd(4.0, n=30)))
    cancels = [c for c in out if isinstance(c, CancelTask)]
    assert [c.task_id for c in cancels] == [tasks[2].task_id]
    v = next(c for c in out if isinstance(c, NewModelVersion))
    # FedAvg by samples: (10*1 + 30*4) / 40 = 3.25
    np.testing.assert_allclose(v.weights, np.full(DIM, 3.25))
    assert len(dispatched(out)) == 3  # the next round starts in the same step
    late = o.handle(TaskFinished(3.0, tasks[2].client_id, tasks[2].task_id, upd()))
    assert [c.reason for c in late if isinstance(c, UpdateRejected)] == ["result for a cancelled task"]


def test_the_ledger_refuses_a_result_of_another_kind_or_version():
    """A result states its kind and model version (a deployment's wire carries both); the ledger
    checks them against the task it answers, and the task stays open for the right result."""
    o = make(concurrency=1, agg_goal=1)
    (task,) = dispatched(register(o, 1))
    cid, tid, v = task.client_id, task.task_id, task.version
    wrong_kind = o.handle(TaskFinished(1.0, cid, tid, upd(), TaskKind.EVAL, v))
    wrong_version = o.handle(TaskFinished(2.0, cid, tid, upd(), TaskKind.TRAIN, v + 1))
    refused = [c for c in wrong_kind + wrong_version if isinstance(c, UpdateRejected)]
    assert [(c.kind, c.reason) for c in refused] == [
        (Refusal.WRONG_KIND, "eval result for a train task"),
        (Refusal.WRONG_VERSION, f"result computed on version {v + 1}, task was dispatched with version {v}"),
    ]
    assert tid in o.ledger and o.stats.updates_applied == 0
    o.handle(TaskFinished(3.0, cid, tid, upd(), TaskKind.TRAIN, v))
    assert tid not in o.ledger and o.stats.updates_applied == 1


def test_sync_without_deadline_or_timeout_stalls():
    o = make(mode="sync", agg_goal=2, overcommit=1.0, task_timeout_s=None)
    tasks = dispatched(register(o, 4))
    o.handle(TaskFinished(1.0, tasks[0].client_id, tasks[0].task_id, upd()))
    for t in (10.0, 1e4, 1e6):
        assert o.handle(Tick(t)) == []
    assert o.version == 0 and o.next_wakeup() is None


def test_sync_deadline_aggregates_what_arrived():
    o = make(mode="sync", agg_goal=3, overcommit=1.0, deadline_s=50.0, task_timeout_s=None)
    tasks = dispatched(register(o, 5))
    o.handle(TaskFinished(10.0, tasks[0].client_id, tasks[0].task_id, upd(2.0)))
    assert o.next_wakeup() == 50.0
    out = o.handle(Tick(50.0))
    assert o.version == 1
    assert {c.task_id for c in out if isinstance(c, CancelTask)} == {tasks[1].task_id, tasks[2].task_id}


def test_timeout_frees_slot_and_late_update_is_still_applied():
    o = make(concurrency=1, agg_goal=1, task_timeout_s=90.0)
    t0 = dispatched(register(o, 2))[0]
    assert o.next_wakeup() == 90.0
    out = o.handle(Tick(90.0))
    t1 = dispatched(out)
    assert len(t1) == 1 and t1[0].client_id != t0.client_id
    assert o.stats.train_dropped == 1
    out = o.handle(TaskFinished(200.0, t0.client_id, t0.task_id, upd()))
    assert o.version == 1 and not [c for c in out if isinstance(c, UpdateRejected)]


def test_tiertrack_frees_slot_on_unavailable_and_blocks_rejoin_in_same_round():
    o = make(concurrency=1, agg_goal=5, knowledge=AvailabilityName.TIERTRACK)
    t0 = dispatched(register(o, 2))[0]
    other = 1 - t0.client_id
    out = o.handle(TierChanged(5.0, t0.client_id, Tier.UN_AVL))
    assert [d.client_id for d in dispatched(out)] == [other]
    o.handle(TaskFinished(6.0, other, dispatched(out)[0].task_id, upd()))
    # The dropped client is back in the same round (version 0): it must not be picked again.
    out = o.handle(TierChanged(7.0, t0.client_id, Tier.AVL_TRAIN))
    assert t0.client_id not in [d.client_id for d in dispatched(out)]
    assert o.clients[t0.client_id].blocked_round == 0


def test_tiertrack_train_to_eval_frees_slot_but_oracle_does_not():
    for knowledge, freed in ((AvailabilityName.TIERTRACK, True), (AvailabilityName.ORACLE, False)):
        o = make(concurrency=1, agg_goal=5, knowledge=knowledge)
        t0 = dispatched(register(o, 1))[0]
        o.handle(TierChanged(5.0, t0.client_id, Tier.AVL_EVAL))
        assert (o.clients[t0.client_id].in_flight is None) is freed


def test_oracle_and_tiertrack_select_only_avl_train_none_selects_all():
    for knowledge, expect in (
        (AvailabilityName.NONE, 4),
        (AvailabilityName.ORACLE, 2),
        (AvailabilityName.TIERTRACK, 2),
    ):
        o = make(concurrency=10, agg_goal=5, knowledge=knowledge)
        cmds = []
        for c, tier in enumerate([Tier.AVL_TRAIN, Tier.UN_AVL, Tier.AVL_EVAL, Tier.AVL_TRAIN]):
            cmds += o.handle(ClientRegistered(0.0, c, 10, tier))
        assert len(dispatched(cmds)) == expect, knowledge


def test_tiertrack_timeout_marks_client_unavailable_until_it_replies():
    o = make(concurrency=1, agg_goal=5, knowledge=AvailabilityName.TIERTRACK)
    t0 = dispatched(register(o, 1))[0]
    o.handle(Tick(90.0))
    assert o.clients[0].tier is Tier.UN_AVL
    o.handle(TaskFinished(95.0, 0, t0.task_id, upd()))
    assert o.clients[0].tier is Tier.AVL_TRAIN  # the late reply proves it alive


@pytest.mark.parametrize(
    "bad, reason",
    [
        (ClientUpdate(10, 1.0, 0.5, 1.0, np.zeros(DIM + 1, np.float32)), "model update of shape"),
        (ClientUpdate(10, 1.0, 0.5, 1.0, np.array([0, np.nan, 0, 0], np.float32)), "non-finite values"),
        (ClientUpdate(10, float("inf"), 0.5, 1.0, np.zeros(DIM, np.float32)), "non-finite loss"),
        (ClientUpdate(10, 1.0, 0.5, 1.0, np.zeros(DIM, np.float64)), "float32"),
        (ClientUpdate(10, 1.0, 0.5, 1.0, None), "without a model update"),
        (ClientUpdate(0, 1.0, 0.5, 1.0, np.zeros(DIM, np.float32)), "over no samples"),
    ],
)
def test_malformed_results_are_rejected_and_not_applied(bad, reason):
    o = make(concurrency=1, agg_goal=1)
    t0 = dispatched(register(o, 1))[0]
    out = o.handle(TaskFinished(1.0, 0, t0.task_id, bad))
    rej = [c for c in out if isinstance(c, UpdateRejected)]
    assert len(rej) == 1 and reason in rej[0].reason
    assert o.version == 0 and o.stats.rejected == 1
    # the task is still open: a correct reply is applied
    o.handle(TaskFinished(2.0, 0, t0.task_id, upd()))
    assert o.version == 1


def test_forged_replayed_and_unknown_results_are_rejected():
    o = make(concurrency=2, agg_goal=1)
    a, b = dispatched(register(o, 2))
    out = o.handle(TaskFinished(1.0, b.client_id, a.task_id, upd()))
    assert "assigned to another client" in out[0].reason
    o.handle(TaskFinished(2.0, a.client_id, a.task_id, upd()))
    out = o.handle(TaskFinished(3.0, a.client_id, a.task_id, upd()))
    assert any(isinstance(c, UpdateRejected) and "already applied" in c.reason for c in out)
    out = o.handle(TaskFinished(4.0, 99, 12345, upd()))
    assert "unknown client" in out[0].reason
    assert o.stats.updates_applied == 1


def test_failed_task_frees_slot_and_time_cannot_go_back():
    o = make(concurrency=1, agg_goal=1)
    t0 = dispatched(register(o, 2))[0]
    out = o.handle(TaskFailed(1.0, t0.client_id, t0.task_id, "device error"))
    assert len(dispatched(out)) == 1
    with pytest.raises(ValueError):
        o.handle(Tick(0.5))


def test_max_staleness_discards():
    o = make(concurrency=2, agg_goal=1, max_staleness=0)
    a, b = dispatched(register(o, 2))
    o.handle(TaskFinished(1.0, a.client_id, a.task_id, upd()))
    o.handle(TaskFinished(2.0, b.client_id, b.task_id, upd()))  # staleness 1 > 0
    assert o.stats.updates_discarded == 1 and o.version == 1


def test_aux_is_reduced_with_model_weights():
    o = make(concurrency=2, agg_goal=2)
    o.validator.aux_spec["beta"] = AuxDecl((), "<f8")  # as an objective declares its aux
    a, b = dispatched(register(o, 2))
    ua, ub = upd(), upd()
    ua.aux["beta"] = np.array(1.0)
    ub.aux["beta"] = np.array(3.0)
    o.handle(TaskFinished(1.0, a.client_id, a.task_id, ua))
    out = o.handle(TaskFinished(2.0, b.client_id, b.task_id, ub))
    assert float(o.aux["beta"]) == pytest.approx(2.0)
    nxt = dispatched(out)  # slots refilled after the aggregation, in the same step
    assert nxt and float(nxt[0].aux["beta"]) == pytest.approx(2.0)  # the reduced aux travels out


def test_each_rejection_carries_its_kind():
    """The orchestrator's rejections are typed (the kind the summary and the wire count them by)."""
    o = make(concurrency=2, agg_goal=1)
    a, b = dispatched(register(o, 2))
    kinds = []
    for ev in (
        ClientRegistered(0.0, 0, num_samples=5, tier=Tier.AVL_TRAIN),  # registered twice
        TierChanged(0.0, 42, Tier.AVL_TRAIN),  # never registered
        TaskFinished(1.0, b.client_id, a.task_id, upd()),  # another client's task
        TaskFinished(1.0, a.client_id, a.task_id, upd(n=0)),  # over no samples
        TaskFinished(1.0, a.client_id, a.task_id, upd(utility=-1.0)),  # outside the reported ranges
        TaskFinished(2.0, a.client_id, a.task_id, upd()),  # applied
        TaskFinished(3.0, a.client_id, a.task_id, upd()),  # ... so a replay
        TaskFinished(4.0, a.client_id, 12345, upd()),  # never assigned
        TaskFailed(5.0, a.client_id, b.task_id, "oom"),  # another client's task
    ):
        kinds += [c.kind for c in o.handle(ev) if isinstance(c, UpdateRejected)]
    assert kinds == [
        Refusal.BAD_REGISTRATION,
        Refusal.UNKNOWN_CLIENT,
        Refusal.NOT_HOLDER,
        Refusal.MALFORMED_UPDATE,
        Refusal.INVALID_UPDATE,
        Refusal.TASK_CLOSED,
        Refusal.UNKNOWN_TASK,
        Refusal.NOT_HOLDER,
    ]
