"""The data plan as a server-side policy in the core, driven by registrations (no shell, no torch)."""

from __future__ import annotations

import numpy as np
import pytest

from felix.config import ConfigError, DaflCfg
from felix.core.commands import DispatchTrain, NewModelVersion
from felix.core.dataplan import DATA_PLANS
from felix.core.events import ClientRegistered, TaskFinished, Tick, TierChanged
from felix.core.orchestrator import Orchestrator, OrchestratorConfig
from felix.core.types import ClientUpdate, Tier
from felix.strategies.aggregation.fedavg import FedBuffAggregator
from felix.strategies.dataplans.dafl import plan_local_balancing
from felix.strategies.dataplans.policy import PlannedDataPlan, PlanSetup
from felix.strategies.selection.random import RandomSelector

COUNTS = [[6, 1, 1], [1, 5, 2], [2, 2, 4]]


def make(on_error: str = "raise", **kw) -> Orchestrator:
    policy = DATA_PLANS.create("lb", DaflCfg(), PlanSetup(3, on_error))  # type: ignore[arg-type]
    cfg = OrchestratorConfig(
        **{"mode": "async", "agg_goal": 1, "concurrency": 2, "task_timeout_s": 30.0, **kw}
    )
    return Orchestrator(
        cfg,
        np.zeros(2, np.float32),
        RandomSelector(),
        FedBuffAggregator(),
        np.random.default_rng(0),
        data_plan=policy,
    )


def register(o: Orchestrator, cid: int, t: float, counts: list[int]) -> list:
    return o.handle(ClientRegistered(t, cid, sum(counts), class_counts=tuple(counts)))


def test_training_waits_for_the_plan_then_carries_the_rows() -> None:
    o = make()
    assert isinstance(o.data_plan, PlannedDataPlan) and o.data_plan.pending
    assert not [c for c in register(o, 0, 0.0, COUNTS[0]) if isinstance(c, DispatchTrain)]
    assert not [c for c in register(o, 1, 5.0, COUNTS[1]) if isinstance(c, DispatchTrain)]
    assert o.train_in_flight == 2 and o.next_wakeup() is None  # assigned, held: no timeout runs yet
    out = register(o, 2, 8.0, COUNTS[2])
    sent = [c for c in out if isinstance(c, DispatchTrain)]
    rows = {k: tuple(r) for k, r in enumerate(plan_local_balancing(np.array(COUNTS)).A.tolist())}
    assert o.plans == rows and not o.data_plan.pending
    assert len(sent) == 2 and all(c.plan == rows[c.client_id] for c in sent)
    assert o.next_wakeup() == 8.0 + 30.0  # the held tasks' timeouts start when they are sent
    info = o.data_plan.info()
    assert info["method"] == "lb" and info["added"] == sum(map(sum, rows.values()))
    # Later tasks carry the rows too (a client that restarts still gets its row).
    done = sent[0]
    out = o.handle(
        TaskFinished(
            9.0, done.client_id, done.task_id, ClientUpdate(8, 1.0, 0.5, 1.0, np.ones(2, np.float32))
        )
    )
    assert [c for c in out if isinstance(c, NewModelVersion)]
    again = [c for c in out if isinstance(c, DispatchTrain)]
    assert again and all(c.plan == rows[c.client_id] and c.version == 1 for c in again)


def test_state_dict_keeps_the_plan_and_the_held_tasks() -> None:
    o = make()
    register(o, 0, 0.0, COUNTS[0])
    state = o.state_dict()
    restored = make()
    restored.load_state_dict(state)
    assert restored.data_plan.pending and restored.train_in_flight == o.train_in_flight
    restored.handle(Tick(1.0))
    register(restored, 1, 2.0, COUNTS[1])
    sent = [c for c in register(restored, 2, 3.0, COUNTS[2]) if isinstance(c, DispatchTrain)]
    assert sorted(c.client_id for c in sent) == [0, 1]  # the held task of client 0 survived the restore
    after = make()
    after.load_state_dict(restored.state_dict())
    assert not after.data_plan.pending and after.plans == restored.plans
    assert after.data_plan.info() == restored.data_plan.info()


def test_an_impossible_plan_raises_or_trains_without_rows() -> None:
    bad = [[0, 3, 3], *COUNTS[1:]]  # LB: client 0 holds no sample of class 0
    o = make("raise")
    register(o, 0, 0.0, bad[0])
    register(o, 1, 0.0, bad[1])
    with pytest.raises(ConfigError, match="data_plan 'lb': client 0 has no samples of class 0"):
        register(o, 2, 0.0, bad[2])
    o = make("skip")
    register(o, 0, 0.0, bad[0])
    register(o, 1, 0.0, bad[1])
    sent = [c for c in register(o, 2, 0.0, bad[2]) if isinstance(c, DispatchTrain)]
    assert len(sent) == 2 and all(c.plan == () for c in sent)  # the held tasks go out, without a plan
    assert "no samples of class 0" in o.data_plan.info()["error"] and o.plans == {}


def test_no_plan_holds_nothing() -> None:
    o = Orchestrator(
        OrchestratorConfig(concurrency=1, agg_goal=1),
        np.zeros(2, np.float32),
        RandomSelector(),
        FedBuffAggregator(),
        np.random.default_rng(0),
    )
    assert not o.data_plan.pending and o.data_plan.info() == {}
    sent = [c for c in register(o, 0, 0.0, COUNTS[0]) if isinstance(c, DispatchTrain)]
    assert len(sent) == 1 and sent[0].plan == ()


def test_a_held_task_whose_client_leaves_is_never_sent() -> None:
    o = make(knowledge="tiertrack")
    register(o, 0, 0.0, COUNTS[0])
    (held,) = (t for t in o.tasks() if t.client_id == 0)
    o.handle(TierChanged(1.0, 0, Tier.UN_AVL))  # TierTrack frees its slot at once
    register(o, 1, 2.0, COUNTS[1])
    sent = [c for c in register(o, 2, 3.0, COUNTS[2]) if isinstance(c, DispatchTrain)]
    assert held.task_id not in {c.task_id for c in sent} and sent
    assert held.task_id not in {t.task_id for t in o.tasks()}  # closed, not left open forever


def test_the_policies_state_survives_a_checkpoint_file(tmp_path) -> None:
    from felix.deploy.checkpoint import load_checkpoint, save_checkpoint

    o = make(mode="sync", overcommit=1.0, agg_goal=2)
    for c in range(3):
        register(o, c, float(c), COUNTS[c])
    save_checkpoint(tmp_path / "ck.safetensors", o.state_dict())
    restored = make(mode="sync", overcommit=1.0, agg_goal=2)
    restored.load_state_dict(load_checkpoint(tmp_path / "ck.safetensors"))
    assert restored.plans == o.plans and restored.data_plan.info() == o.data_plan.info()
    assert (
        restored.rounds.state_dict() == o.rounds.state_dict() and restored.rounds.state_dict()["round_active"]
    )


def test_the_core_and_its_registered_policies_import_no_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys\nfrom felix.core.dataplan import DATA_PLANS\nfrom felix.core.orchestrator import Orchestrator\n"
        "from felix.core.policies import AGGREGATORS, EVAL_SELECTORS, TRAIN_SELECTORS\n"
        "for r in (DATA_PLANS, AGGREGATORS, EVAL_SELECTORS, TRAIN_SELECTORS): r.names()\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "False", out.stderr
