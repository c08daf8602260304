"""Per-client admission control in the orchestrator core (``felix.core.admission``): a client that
flips its tier cannot make the server send it a task per flip, and its task budget bounds what it
is sent per unit of time. The same rules run in the simulator and in ``felix serve``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from felix.cli import main
from felix.core.admission import DEPLOY_DROP_RATE, Admission, AdmissionConfig
from felix.core.commands import CancelTask, Command, DispatchEval, DispatchTrain
from felix.core.events import ClientRegistered, TaskFinished, Tick, TierChanged
from felix.core.orchestrator import Orchestrator, OrchestratorConfig
from felix.core.types import ClientUpdate, Tier
from felix.strategies.aggregation.fedavg import FedBuffAggregator
from felix.strategies.selection.random import RandomSelector

DIM = 4
ATTACKER = 0
HONEST = 8
OFF = AdmissionConfig(flap_limit=None, task_rate=None, drop_rate=None)


def make(admission: AdmissionConfig) -> Orchestrator:
    cfg = OrchestratorConfig(
        mode="async",
        agg_goal=1,
        concurrency=HONEST + 1,
        knowledge="tiertrack",
        one_late_task_per_client=True,  # as felix serve sets it
        admission=admission,
    )
    return Orchestrator(
        cfg, np.zeros(DIM, np.float32), RandomSelector(), FedBuffAggregator(), np.random.default_rng(0)
    )


def answer(task: DispatchTrain) -> ClientUpdate:
    return ClientUpdate(
        num_samples=10, stat_utility=1.0, loss=0.5, duration=1.0, delta=np.full(DIM, 1e-3, np.float32)
    )


def attack(
    o: Orchestrator, flips: int, every_s: float, t0: float = 0.0, pending: list[DispatchTrain] | None = None
) -> tuple[int, float]:
    """Honest clients answer each training task 0.01 s later (each answer is a new version); the
    attacker flips AVL_TRAIN/UN_AVL every ``every_s`` seconds. Returns the tasks and cancels sent
    to the attacker and the time of the last flip; ``pending`` collects the honest clients' tasks
    not answered yet."""
    pending = [] if pending is None else pending
    to_attacker = 0

    def take(cmds: list[Command]) -> None:
        nonlocal to_attacker
        for c in cmds:
            if isinstance(c, (DispatchTrain, DispatchEval, CancelTask)) and c.client_id == ATTACKER:
                to_attacker += 1
            elif isinstance(c, DispatchTrain):
                pending.append(c)

    if t0 == 0.0:
        for cid in range(HONEST + 1):
            take(o.handle(ClientRegistered(0.0, cid, 100, Tier.AVL_TRAIN)))
    t = t0
    for i in range(flips):
        t = t0 + (i + 1) * every_s
        tier = Tier.UN_AVL if i % 2 == 0 else Tier.AVL_TRAIN
        take(o.handle(TierChanged(t, ATTACKER, tier)))
        for task in [p for p in pending]:
            pending.remove(task)
            take(o.handle(TaskFinished(t + 0.001, task.client_id, task.task_id, answer(task))))
    return to_attacker, t


def test_a_flapping_client_without_admission_control_is_sent_a_task_per_flip() -> None:
    """The issue's attack, on the core: every flip back to AVL_TRAIN wins a new task (the version
    moved on), and every flip away from it a cancel or a lost slot."""
    sent, _ = attack(make(OFF), 200, 0.1)
    assert sent >= 150


def test_flap_damping_makes_a_flapping_client_unavailable_until_it_is_stable() -> None:
    cfg = AdmissionConfig()  # the defaults
    o = make(cfg)
    sent, last = attack(o, 200, 0.1)  # 10 changes per second, against 100 per minute
    assert o.admission.stats.damped == 1
    assert o.admission.is_damped(ATTACKER)
    # It was given at most one task and one cancel per flip until it was damped, and nothing after.
    assert sent <= 2 * (cfg.flap_limit or 0) + 2
    assert o.clients[ATTACKER].tier is Tier.UN_AVL
    # Still damped just before the hold ends; its last report (AVL_TRAIN) applies after it.
    o.handle(Tick(last + cfg.flap_hold_s - 1))
    assert o.admission.is_damped(ATTACKER)
    wake = o.next_wakeup()
    assert wake is not None and wake <= last + cfg.flap_hold_s
    out = o.handle(Tick(last + cfg.flap_hold_s))
    assert not o.admission.is_damped(ATTACKER)
    assert o.clients[ATTACKER].tier is Tier.AVL_TRAIN
    assert any(isinstance(c, DispatchTrain) and c.client_id == ATTACKER for c in out)


def test_a_change_during_the_hold_restarts_it() -> None:
    cfg = AdmissionConfig(flap_limit=3, flap_window_s=10.0, flap_hold_s=100.0)
    o = make(cfg)
    _, last = attack(o, 5, 1.0)
    assert o.admission.is_damped(ATTACKER)
    o.handle(TierChanged(last + 50, ATTACKER, Tier.AVL_TRAIN))  # it was UN_AVL: a change
    o.handle(TierChanged(last + 60, ATTACKER, Tier.AVL_TRAIN))  # a repeat, not a change
    o.handle(Tick(last + 120))  # 100 s after the first hold began, 70 after the last change
    assert o.admission.is_damped(ATTACKER)
    o.handle(Tick(last + 150))
    assert not o.admission.is_damped(ATTACKER)
    assert o.clients[ATTACKER].tier is Tier.AVL_TRAIN  # its last report


def test_changes_spread_over_the_window_are_not_damped() -> None:
    """The busiest MobiPerf device changes tier 24 times in a minute: far from the default 100."""
    o = make(AdmissionConfig())
    attack(o, 300, 2.5)  # 24 changes a minute for 12.5 minutes
    assert o.admission.stats.damped == 0


def test_a_slow_flipper_under_the_flap_limit_cannot_amplify() -> None:
    """200 flips at 26 changes a minute (under the flap limit of 100): without the drop budget each
    flip back wins a model download and each flip away a cancel; with it (felix serve's), the tasks
    it leaves are bounded by ``drop_burst + drop_rate * T`` whatever the spacing, and so are the
    cancels. An honest client that answers its tasks never spends a drop token."""
    every = 60.0 / 26
    unbounded, _ = attack(make(AdmissionConfig()), 200, every)  # the simulator's default: off
    cfg = AdmissionConfig(drop_rate=DEPLOY_DROP_RATE)  # felix serve's
    o = make(cfg)
    sent, last = attack(o, 200, every)
    assert o.admission.stats.damped == 0  # the flap limit never saw it
    assert cfg.drop_rate is not None
    bound = cfg.drop_burst + cfg.drop_rate * last + 1  # + the task it may hold at the end
    assert sent <= 2 * bound, (sent, bound)
    assert unbounded >= 10 * sent, (unbounded, sent)
    assert o.admission.stats.drops_throttled >= 1
    # The honest clients answered every task: none of them was ever held back.
    assert set(o.admission.excluded_ids().tolist()) <= {ATTACKER}
    assert o.version >= 150


def test_the_task_budget_bounds_tasks_and_cancels_per_client() -> None:
    """Without damping, the budget alone bounds what a flapping client is sent: over T seconds at
    most burst + rate * T tasks, and as many cancels plus those of tasks held at the start."""
    cfg = AdmissionConfig(flap_limit=None, task_rate=0.5, task_burst=5.0)
    o = make(cfg)
    sent, last = attack(o, 400, 0.1)  # 40 s of 10 flips a second
    assert o.admission.stats.throttled >= 1
    assert sent <= 2 * (cfg.task_burst + cfg.task_rate * last) + 2
    unbounded, _ = attack(make(OFF), 400, 0.1)
    assert sent < unbounded / 4


def test_a_throttled_client_is_selected_again_once_its_budget_refills() -> None:
    """A lone client that answers each task at once is given the next at once: after its burst it
    waits for its budget, and a wakeup brings it back without any other event."""
    cfg = AdmissionConfig(flap_limit=None, task_rate=0.1, task_burst=3.0)
    o = make(cfg)
    out = o.handle(ClientRegistered(0.0, ATTACKER, 100, Tier.AVL_TRAIN))
    t, got = 0.0, 0
    while tasks := [c for c in out if isinstance(c, DispatchTrain)]:
        got += 1
        t += 0.01
        out = o.handle(TaskFinished(t, ATTACKER, tasks[0].task_id, answer(tasks[0])))
    assert got == 3 and ATTACKER in o.admission.excluded_ids()
    wake = o.next_wakeup()
    assert wake is not None and wake == pytest.approx(t + 1.0 / cfg.task_rate, abs=0.1)
    out = o.handle(Tick(wake))  # released, and at once given a task (which spends the token again)
    assert any(isinstance(c, DispatchTrain) and c.client_id == ATTACKER for c in out)


def test_admission_state_survives_a_checkpoint() -> None:
    cfg = AdmissionConfig(flap_limit=3, flap_window_s=10.0, flap_hold_s=100.0, task_rate=0.5, task_burst=4)
    o = make(cfg)
    _, last = attack(o, 6, 1.0)
    state = o.admission.state_dict()
    fresh = Admission(cfg)
    fresh.load_state_dict(state)
    assert fresh.is_damped(ATTACKER)
    assert fresh.excluded_ids().tolist() == o.admission.excluded_ids().tolist()
    assert fresh.next_wakeup() == pytest.approx(o.admission.next_wakeup())
    assert fresh.stats == o.admission.stats
    assert fresh.due(last + 100) == [ATTACKER]


def test_allowed_matches_the_excluded_set_for_any_ids() -> None:
    """``allowed`` (a table lookup) agrees with a set membership test for ids inside, beyond and
    below the table, sparse and extreme ids, and after the excluded set changes."""
    rng = np.random.default_rng(0)
    extremes = np.array([-(2**63), -1, 0, 1, 2**22 - 1, 2**22, 2**40, 2**63 - 1], dtype=np.int64)
    a = Admission(OFF)
    for excluded in ([], [0], [3, 7, 399], [5, 2**22 + 9], [-4, 12], [2**63 - 1]):
        for cid in list(a._held):
            a.hold(cid, False)
        for cid in excluded:
            a.hold(cid, True)
        for _ in range(5):
            ids = np.sort(
                np.concatenate([rng.integers(-3, 500, 300), extremes, np.asarray(excluded, np.int64)])
            )
            want = np.array([int(i) not in set(excluded) for i in ids])
            assert a.allowed(ids).tolist() == want.tolist(), excluded
    assert a.allowed(np.empty(0, np.int64)).size == 0


@pytest.mark.parametrize(
    "bad",
    [{"flap_limit": 0}, {"flap_window_s": 0.0}, {"task_rate": -1.0}, {"task_burst": 0.5}],
)
def test_bad_admission_settings_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        AdmissionConfig(**bad)  # type: ignore[arg-type]


def test_serve_names_a_bad_message_budget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The server's per-client message budget is checked at start-up (port 1: nothing listens)."""
    base = ["serve", "--username", "u", "--password", "p", "--broker", "127.0.0.1:1"]
    base += ["--out", str(tmp_path / "o")]
    assert main([*base, "--client-msg-rate", "-1"]) == 2
    assert main([*base, "--client-msg-burst", "0.5"]) == 2
    assert main([*base, "--set", "orchestrator.admission.flap_limit=0"]) == 2
    err = capsys.readouterr().err
    assert "client message rate must be positive, not -1.0" in err
    assert "client message burst must be at least 1, not 0.5" in err
    assert "orchestrator.admission.flap_limit" in err
    assert "Traceback" not in err
