"""The per-login download budget (``felix.deploy.download_budget``): a login that flips its tier
slowly, under the flap limit, and never answers, is sent at most ``download_ratio`` times the
bytes it sent (1, ``felix serve``'s default) plus one task, whatever the spacing of its flips; honest clients that answer are
never held.

The server here is driven in-process (no broker): its inbound messages are handed to
``handle_inbound``, its outbound ones captured, its config clock set by the test.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from mqtt_support import At, load_config, write_config

from felix.core.types import ClientUpdate, TaskKind, Tier
from felix.deploy import wire
from felix.deploy.download_budget import DownloadBudget
from felix.deploy.link import BrokerOptions
from felix.deploy.server import ServeOptions, Server
from felix.deploy.transport import Ack, Delivery
from felix.scenario.build import build_population

ATTACKER = 0
CLIENTS = 4


class Driven:
    """A server whose clock the test sets, its sends captured; honest clients 1-3 answer each
    task at once with a zero update, client 0 is the attacker (its bytes counted both ways)."""

    def __init__(self, tmp_path: Path, download_ratio: float | None) -> None:
        path = write_config(
            tmp_path / "cfg.yaml",
            partition={"num_clients": CLIENTS},
            orchestrator={"agg_goal": 1},
            run={"eval_every": 1000},
        )
        cfg = load_config(path, {"strategy": "fedbuff"})
        self.counts = [
            np.bincount(d.y.numpy(), minlength=10).tolist() for d in build_population(cfg).client_data
        ]
        opts = ServeOptions(
            BrokerOptions("127.0.0.1", 1), run_id="t", time_scale=1.0, download_ratio=download_ratio
        )
        self.server = s = Server(cfg, opts)
        self.clock = 0.0
        s.now = lambda: self.clock  # type: ignore[method-assign]
        self.sent: list[tuple[int | None, bytes]] = []
        s.link.send = lambda channel, client, payload: self.sent.append((client, payload))  # type: ignore[method-assign]
        s.ctl.start()
        self.seq = 0
        self.up = self.down = self.largest = 0

    def inbound(self, cid: int, msg: wire.Message, address: object) -> None:
        payload = wire.encode(msg)
        if cid == ATTACKER:
            self.up += len(payload)
        self.seq += 1
        self.server.handle_inbound(Delivery(address, payload, Ack(self.seq, 1, 0), "test"))  # type: ignore[arg-type]
        self.drain()

    def env(self, cid: int) -> dict[str, object]:
        self.seq += 1
        return {"run": "t", "msg_id": f"c{cid}-{self.seq}", "sent_at": time.time()}

    def register(self, cid: int) -> None:
        counts = tuple(self.counts[cid])
        reg = wire.Register(
            **self.env(cid),
            client=cid,
            incarnation=f"c{cid}",
            num_samples=sum(counts),
            tier=Tier.AVL_TRAIN,
            class_counts=counts,
        )
        self.inbound(cid, reg, At.register(cid))

    def flip(self, tier: Tier) -> None:
        msg = wire.State(**self.env(ATTACKER), client=ATTACKER, incarnation=f"c{ATTACKER}", tier=tier)
        self.inbound(ATTACKER, msg, At.state(ATTACKER))

    def drain(self) -> None:
        """Count what went to the attacker; answer the honest clients' tasks."""
        while self.sent:
            cid, payload = self.sent.pop(0)
            if cid is None:
                continue
            msg = wire.decode(payload)
            if cid == ATTACKER:
                self.down += len(payload)
                self.largest = max(self.largest, len(payload))
                continue
            if isinstance(msg, (wire.TrainTask, wire.EvalTask)):
                train = isinstance(msg, wire.TrainTask)
                upd = ClientUpdate(
                    num_samples=sum(self.counts[cid]),
                    stat_utility=1.0,
                    loss=0.5,
                    duration=1.0,
                    delta=np.zeros(msg.weights.size, np.float32) if train else None,
                )
                res = wire.Result(
                    **self.env(cid),
                    client=cid,
                    incarnation=f"c{cid}",
                    task=msg.task,
                    kind=TaskKind.TRAIN if train else TaskKind.EVAL,
                    version=msg.version,
                    update=upd,
                )
                self.inbound(cid, res, At.result(cid))

    def advance(self, seconds: float) -> None:
        from felix.core.events import Tick

        self.clock += seconds
        wake = self.server.orch.next_wakeup()
        if wake is not None and wake <= self.clock:
            self.server._deliver(Tick(self.clock), from_client=False)
            self.drain()


def slow_flipper(tmp_path: Path, flips: int, every_s: float, download_ratio: float | None) -> Driven:
    d = Driven(tmp_path, download_ratio)
    for cid in range(CLIENTS):
        d.register(cid)
    for i in range(flips):
        d.advance(every_s)
        d.flip(Tier.UN_AVL if i % 2 == 0 else Tier.AVL_TRAIN)
    return d


@pytest.mark.parametrize("every_s", [60.0 / 26, 20.0])
def test_a_slow_flipper_is_sent_at_most_the_ratio_of_what_it_sent(tmp_path: Path, every_s: float) -> None:
    """26 flips a config minute (the issue's spacing) and one per 20 s: bytes down <= bytes up
    plus one task, while the honest clients train on."""
    flips = 200 if every_s < 10 else 60
    d = slow_flipper(tmp_path, flips, every_s, download_ratio=1.0)
    assert d.down <= d.up + d.largest, (d.down, d.up, d.largest)
    assert d.server.protocol.downloads is not None and d.server.protocol.downloads.stats.held >= 1
    assert d.server.orch.version >= 20  # the honest clients trained all along: none was held for good


def test_without_the_budget_a_slower_flipper_amplifies_more(tmp_path: Path) -> None:
    """The count-based drop budget alone (``download_ratio=None``, as before) bounds tasks per
    config second, so the slower the flips, the more bytes down per byte up: one flip per 20 s is
    sent more than its bytes plus a task (six times its bytes)."""
    d = slow_flipper(tmp_path, 60, 20.0, download_ratio=None)
    assert d.down > d.up + d.largest, (d.down, d.up, d.largest)


def test_answering_clients_are_never_held(tmp_path: Path) -> None:
    d = slow_flipper(tmp_path, 40, 60.0 / 26, download_ratio=1.0)
    budget = d.server.protocol.downloads
    assert budget is not None
    assert not any(budget.is_held(cid) for cid in range(1, CLIENTS))
    assert budget.stats.bytes_refunded > 0


def test_debts_are_forgiven_at_one_largest_task_per_forgive_s() -> None:
    holds: list[tuple[int, bool]] = []
    b = DownloadBudget(2.0, 100.0, lambda cid, held: holds.append((cid, held)))
    b.sent(7, 1, 1000, None, 0, wall=0.0)  # a task: 1,000 bytes of debt, held
    assert holds == [(7, True)] and b.balance(7) == -1000.0
    b.received(7, 100, wall=0.0)  # 200 bytes of credit
    assert b.is_held(7)
    b.sweep(50.0)  # half a task forgiven: 1000 - 200 - 500 = 300 still owed
    assert b.is_held(7) and b.balance(7) == pytest.approx(-300.0)
    b.sweep(80.0)  # 300 more forgiven
    assert not b.is_held(7) and holds[-1] == (7, False) and b.balance(7) == 0.0
    b.sweep(10_000.0)  # forgiveness pays debt only: no credit grows from time
    assert b.balance(7) == 0.0
    # The unit is each login's own largest debit: another login's huge task does not speed it up.
    b.sent(8, 2, 100_000, None, 0, wall=10_000.0)
    b.sent(9, 3, 1000, None, 0, wall=10_000.0)
    b.sweep(10_050.0)
    assert b.balance(9) == pytest.approx(-500.0) and b.balance(8) == pytest.approx(-50_000.0)


def test_an_answered_task_is_refunded_and_a_held_model_costs_nothing() -> None:
    b = DownloadBudget(2.0, 1e9, lambda cid, held: None)
    b.sent(3, 1, 300, "a" * 64, 40_000, wall=0.0)  # a task naming a model it does not hold
    assert b.balance(3) == -40_300.0
    b.closed(3, 1, answered=True, wall=0.0)
    assert b.balance(3) == 0.0 and not b.is_held(3)
    b.sent(3, 2, 300, "a" * 64, 40_000, wall=0.0)  # the same model again: only the message
    b.closed(3, 2, answered=False, wall=0.0)  # cancelled: no refund
    assert b.balance(3) == -300.0 and b.is_held(3)


def test_bad_download_budget_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="download budget: ratio and forgive_s must be positive"):
        DownloadBudget(0.0, 600.0, lambda cid, held: None)
