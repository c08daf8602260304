"""Secure aggregation in a deployed run, end to end: ``felix serve``'s server and real clients
(the in-memory transport for the fast tests, Mosquitto for one), instrumented on both sides. The
applied model is the plaintext quantised aggregate's result, every group's unmasked sum is the
plaintext quantised sum bit for bit, no payload the server receives holds one client's update,
and clients that go silent at any stage are tolerated up to the threshold, abandoned (and
counted) below it."""

from __future__ import annotations

import csv
import dataclasses
import json
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from broker import MosquittoBroker
from mqtt_support import (
    Background,
    broker_options,
    load_config,
    needs_mosquitto,
    one_torch_thread,  # noqa: F401  (a fixture)
    reap,
    spawn,
    start_clients,
    users,
    wait_until,
    write_config,
)

from felix.config import Config
from felix.deploy import checkpoint as ckpt
from felix.deploy import secagg_wire, wire
from felix.deploy.channels import Channel
from felix.deploy.client import ClientHost, ClientOptions, Device, credentials_from_map
from felix.deploy.link import BrokerOptions
from felix.deploy.memory_transport import MemoryOptions
from felix.deploy.server import ServeOptions, Server
from felix.secagg import messages as sa
from felix.secagg.quantize import Quantizer
from felix.secagg.session import STAGES

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class Record:
    """What the test sees of a run: every payload the server received, the deltas the clients
    sealed (task -> delta), each group the server ran (its folded weights and its result), and
    every new model version."""

    received: list[tuple[Channel, bytes]] = field(default_factory=list)
    deltas: dict[int, np.ndarray] = field(default_factory=dict)
    groups: list[tuple[dict[int, float], dict[int, int], Any]] = field(default_factory=list)
    versions: list[tuple[int, np.ndarray, tuple[int, ...]]] = field(default_factory=list)


def instrument(server: Server, host: ClientHost, rec: Record) -> None:
    inbound, log_applied, seal = server.handle_inbound, server._log_applied, host._seal
    assert server.secagg is not None
    run_group = server.secagg.run_group

    def handle(m: Any, *rest: Any) -> None:
        if m.address is not None:
            rec.received.append((m.address.channel, m.payload))
        inbound(m, *rest)

    def group(layout: Any, q: Any, weights: Any, length: int, client_of: Any) -> Any:
        out = run_group(layout, q, weights, length, client_of)
        rec.groups.append((dict(weights), dict(client_of), out[0]))
        return out

    def applied(cmd: Any) -> None:
        rec.versions.append((cmd.version, cmd.weights, cmd.report.task_ids))
        log_applied(cmd)

    def sealed(dev: Device, task_id: int, delta: np.ndarray | None) -> None:
        assert delta is not None
        rec.deltas[task_id] = delta.copy()
        seal(dev, task_id, delta)

    server.handle_inbound = handle  # type: ignore[method-assign]
    server.secagg.run_group = group  # type: ignore[method-assign]
    server._log_applied = applied  # type: ignore[method-assign]
    host._seal = sealed  # type: ignore[method-assign]


def check_sums_and_models(cfg: Config, server: Server, rec: Record, theta0: np.ndarray) -> None:
    """Each finished group's unmasked sum is the plaintext quantised sum of its members' sealed
    deltas, and each new model is the previous one plus the plaintext quantised aggregate."""
    s = cfg.secure_aggregation
    q = Quantizer(s.clipping_range, s.quantization_bits, s.modulus_bits)
    plain: dict[int, tuple[float, np.ndarray]] = {}  # task -> (sum of w, sum of w * delta) share
    for weights, _, group in rec.groups:
        if group.result is None:
            continue
        total = np.zeros(theta0.size + 1, q.dtype)
        for m in group.result.members:
            total += q.encode(weights[m], rec.deltas[m])
        np.testing.assert_array_equal(group.result.total, total)  # bit for bit
        wsum, xsum = q.decode_sum(total, len(group.result.members))
        for m in group.result.members:
            plain[m] = (wsum, xsum)  # one entry per group is enough: keyed by its members
    assert rec.versions, "no model version was made"
    theta = theta0
    lr = np.float32(cfg.aggregator.server_lr)
    for _, new, tasks in rec.versions:
        groups = {id(plain[t][1]): plain[t] for t in tasks if t in plain}
        wsum = sum(w for w, _ in groups.values())
        xsum = sum(x for _, x in groups.values())
        expected = theta + lr * (xsum / wsum).astype(np.float32)
        np.testing.assert_allclose(new, expected, rtol=0, atol=1e-6)
        theta = new


def check_nothing_in_the_clear(rec: Record, q: Quantizer) -> int:
    """No training result carries a delta, and no masked vector the server received is within
    2^20 quantisation levels (an eighth of the range at 2^22 levels and more) of any sealed
    update's ``[w, w * delta]`` for any weight the server used; returns the masked vectors seen."""
    encoded = [
        q.encode(w, rec.deltas[m]).astype(np.int64)
        for weights, _, _ in rec.groups
        for m, w in weights.items()
    ]
    masked = 0
    for channel, payload in rec.received:
        if channel is Channel.RESULT:
            msg = wire.decode(payload)
            if isinstance(msg, wire.Result) and msg.kind.value == "train":
                assert msg.sealed and msg.update.delta is None
        elif channel is Channel.SECAGG:
            got = secagg_wire.decode(payload, from_server=False).msg
            if isinstance(got, sa.Masked):
                masked += 1
                words = got.words.astype(np.int64)
                assert all(np.abs(words - e).max() > 1 << 20 for e in encoded)
        for delta in rec.deltas.values():
            assert delta[:8].tobytes() not in payload
    return masked


class SilentHost(ClientHost):
    """Clients that go silent in their secure-aggregation groups from a stage on (``silent``:
    client -> the first stage they do not answer), as a client stopped mid-protocol would."""

    silent: dict[int, str]  # set before the run

    def _secagg_reply(self, dev: Device, env: secagg_wire.SecAggEnvelope) -> sa.Message | None:
        stage = {sa.Setup: "keys", sa.KeysBroadcast: "shares", sa.SharesForward: "masked"}.get(
            type(env.msg), "unmask"
        )
        gone = self.silent.get(dev.cid)
        if gone is not None and STAGES.index(gone) <= STAGES.index(stage):
            return None
        return super()._secagg_reply(dev, env)


class HostileHost(SilentHost):
    """Client 2 sends its shares, then other shares for the same stage (a replay); client 5
    answers the unmask request with a share of a peer it was not asked about."""

    def _secagg_reply(self, dev: Device, env: secagg_wire.SecAggEnvelope) -> sa.Message | None:
        reply = super()._secagg_reply(dev, env)
        if dev.cid == 2 and isinstance(reply, sa.Shares):
            first = secagg_wire.SecAggEnvelope(self.opts.run_id, dev.cid, env.member, env.task, 0.0, reply)
            self._publish(dev, Channel.SECAGG, secagg_wire.encode(first))
            return sa.Shares(reply.group_id, reply.sender, {k: v[::-1] for k, v in reply.ciphertexts.items()})
        if dev.cid == 5 and isinstance(reply, sa.Unmask):
            return sa.Unmask(reply.group_id, reply.sender, {**reply.seed_shares, 123456: 7}, reply.key_shares)
        return reply


def run_memory(
    cfg: Config,
    out: Path,
    run_id: str,
    silent: dict[int, str] | None = None,
    stop_when: Any = None,
    timeout: float = 60.0,
    host_class: type[SilentHost] = SilentHost,
    **serve: Any,
) -> tuple[Server, Record, dict[str, Any], np.ndarray]:
    opts = ServeOptions(
        MemoryOptions(),
        run_id=run_id,
        out_dir=out,
        time_scale=0.05,
        status_every_s=1e9,
        transport="memory",
        secagg_stage_s=1.0,
        **serve,
    )
    server = Server(cfg, opts)
    theta0 = server.orch.weights.copy()
    copts = ClientOptions(
        broker=MemoryOptions(), run_id=run_id, time_scale=0.05, max_wall_s=timeout, transport="memory"
    )
    host = host_class(cfg, list(range(cfg.partition.num_clients)), copts, lambda cid: (None, None))
    host.silent = silent or {}
    rec = Record()
    instrument(server, host, rec)
    serving, clients = Background(server.run, "server"), Background(host.run, "clients")
    serving.start()
    clients.start()
    try:
        if stop_when is not None:  # an interrupted server does not end the run: the clients are told too
            wait_until(lambda: stop_when(server), timeout, "the condition to stop")
            server.stop_requested.set()
            host.stop_requested.set()
        summ = serving.result(timeout)
        clients.result(20)
    finally:
        server.stop_requested.set()
        host.stop_requested.set()
    return server, rec, summ, theta0


def _buffered(tmp_path: Path) -> Config:
    return load_config(
        write_config(
            tmp_path / "c.yaml",
            secure_aggregation={"protocol": "buffered", "group_size": 4},
            partition={"kind": "dirichlet", "num_clients": 12, "alpha": 0.5},
            run={"target_accuracy": 0.99, "max_aggregations": 3, "max_time_s": 20000.0},
        )
    )


def _sync(tmp_path: Path) -> Config:
    """fedavg's synchronous rounds over all 8 clients (always available): every round's cohort
    is one group of 8, threshold 5."""
    path = write_config(
        tmp_path / "c.yaml",
        strategy="fedavg",
        secure_aggregation={"protocol": "secagg_plus", "group_size": 8},
        partition={"kind": "dirichlet", "num_clients": 8, "alpha": 0.5},
        trace={"kind": "slotted", "unavailable_fraction": 0.0, "slot_s": 60.0, "horizon_s": 3600.0},
        run={"target_accuracy": 0.99, "max_aggregations": 2, "max_time_s": 20000.0},
    )
    return load_config(path, {"orchestrator": {"agg_goal": 8, "overcommit": 1.0}})


@pytest.mark.parametrize("decode_worker", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_buffered_deployment_applies_the_plaintext_quantised_aggregate_and_sees_no_update(
    tmp_path: Path, decode_worker: bool
) -> None:
    cfg = _buffered(tmp_path)
    server, rec, summ, theta0 = run_memory(
        cfg, tmp_path / "out", f"sa-buffered-{decode_worker}", decode_worker=decode_worker
    )
    assert summ["stop_reason"] == "max_aggregations" and len(rec.versions) == 3
    sa_summ = summ["secure_aggregation"]
    assert sa_summ["protocol"] == "buffered" and sa_summ["groups"] == len(rec.groups) >= 3
    assert sa_summ["groups_abandoned"] == 0 and sa_summ["bytes_overhead"] > 0
    check_sums_and_models(cfg, server, rec, theta0)
    s = cfg.secure_aggregation
    assert (
        check_nothing_in_the_clear(rec, Quantizer(s.clipping_range, s.quantization_bits, s.modulus_bits))
        >= 10
    )
    assert summ["rejected_by_kind"] == {} and server.secagg is not None and server.secagg.refusals == []
    assert summ["wire_bytes_by_kind"]["up"]["train"] > 0


@pytest.mark.parametrize(
    "stage",
    [
        "keys",
        pytest.param("shares", marks=pytest.mark.slow),
        "masked",
        pytest.param("unmask", marks=pytest.mark.slow),
    ],
)
def test_a_client_silent_at_any_stage_is_tolerated_and_the_sum_stays_exact(
    tmp_path: Path, stage: str
) -> None:
    cfg = _sync(tmp_path)
    server, rec, summ, theta0 = run_memory(cfg, tmp_path / "out", f"sa-drop-{stage}", silent={3: stage})
    assert summ["stop_reason"] == "max_aggregations" and len(rec.groups) == 2
    for weights, client_of, group in rec.groups:
        assert len(weights) == 8 and group.result is not None
        (dropper,) = [m for m, c in client_of.items() if c == 3]
        assert (dropper in group.result.members) == (stage == "unmask")
    sa_summ = summ["secure_aggregation"]
    assert sa_summ["groups_abandoned"] == 0
    assert sa_summ["dropouts_recovered"] == (2 if stage == "masked" else 0)
    assert sa_summ["updates_lost"] == (0 if stage == "unmask" else 2)
    check_sums_and_models(cfg, server, rec, theta0)


def test_below_the_threshold_a_group_is_abandoned_counted_and_nothing_is_applied(tmp_path: Path) -> None:
    cfg = _sync(tmp_path)
    silent = {c: "masked" for c in range(4)}  # 4 of 8 members: below the threshold of 5

    def abandoned(server: Server) -> bool:
        return int(server.orch.aggregator.privacy.groups_abandoned) >= 1  # type: ignore[union-attr]

    server, rec, summ, _ = run_memory(cfg, tmp_path / "out", "sa-abandon", silent=silent, stop_when=abandoned)
    assert rec.versions == [] and server.orch.version == 0
    weights, _, group = rec.groups[0]
    assert group.abandoned and group.result is None and len(weights) == 8
    sa_summ = summ["secure_aggregation"]
    assert sa_summ["groups_abandoned"] >= 1 and sa_summ["updates_lost"] >= 8
    assert summ["rejected_by_kind"].get("unaggregatable", 0) >= 8  # the round's updates, refused whole


def test_hostile_secagg_messages_are_refused_with_their_reason_and_the_run_goes_on(tmp_path: Path) -> None:
    cfg = _sync(tmp_path)
    server, rec, summ, theta0 = run_memory(cfg, tmp_path / "out", "sa-hostile", host_class=HostileHost)
    assert summ["stop_reason"] == "max_aggregations" and len(rec.versions) == 2
    assert summ["rejected_by_reason"] == {"secagg: replay": 2, "secagg: unrequested": 2}
    assert summ["rejected_by_kind"] == {"secagg": 4}
    assert server.secagg is not None
    assert [exc.reason.value for _, exc in server.secagg.refusals] == ["replay", "unrequested"] * 2
    for _, client_of, group in rec.groups:  # both sent their vectors: both are in the sums
        assert group.result is not None and len(group.result.members) == 8
    check_sums_and_models(cfg, server, rec, theta0)


class FloodHost(SilentHost):
    """The first client a group's setup reaches floods the server with FLOOD valid tier reports
    (fresh message ids) before it answers, so they reach the server while that group runs."""

    FLOOD = 400
    flood: list[bytes]

    def _secagg_reply(self, dev: Device, env: secagg_wire.SecAggEnvelope) -> sa.Message | None:
        if isinstance(env.msg, sa.Setup) and not self.flood:
            for _ in range(self.FLOOD):
                raw = wire.encode(
                    wire.State(**self._env(dev), client=dev.cid, incarnation=dev.incarnation, tier=dev.tier)
                )
                self.flood.append(raw)
                self._publish(dev, Channel.STATE, raw)
        return super()._secagg_reply(dev, env)


@pytest.mark.parametrize(
    ("budget", "bound"),
    [(True, 50000), (False, 30)],  # the senders' admission budgets on; off, with a stash of 30
)
def test_a_flood_during_a_group_is_bounded_and_loses_nothing(
    tmp_path: Path, budget: bool, bound: int
) -> None:
    """With budgets on, the flood's excess is refused as it arrives (as it would be later) and
    the stash holds about one burst; with them off, the stash holds at most its bound and the
    rest waits in the inbox, then the broker. Either way every flooded message is handled once
    the aggregation is over, and the run goes on with exact sums."""
    cfg = _buffered(tmp_path)
    FloodHost.flood = []
    peaks: list[int] = []
    limits: dict[str, Any] = (
        {"client_msg_rate": 1.0}
        if budget
        else {"client_msg_rate": None, "client_cost_limit": False, "max_inbox_messages": bound}
    )
    real = Server._pump

    def pump(self: Server, timeout: float) -> None:
        real(self, timeout)
        peaks.append(len(self._stash))

    Server._pump = pump  # type: ignore[method-assign]
    try:
        server, rec, summ, theta0 = run_memory(
            cfg, tmp_path / "out", f"sa-flood-{budget}", host_class=FloodHost, **limits
        )
    finally:
        Server._pump = real  # type: ignore[method-assign]
    assert len(FloodHost.flood) == FloodHost.FLOOD and peaks
    handled = {payload for channel, payload in rec.received if channel is Channel.STATE}
    assert all(raw in handled for raw in FloodHost.flood)  # nothing lost: each handled once it could be
    assert summ["stop_reason"] == "max_aggregations" and len(rec.versions) == 3
    check_sums_and_models(cfg, server, rec, theta0)
    if budget:  # a burst of 50 and what the rate refills meanwhile; the rest refused at once
        assert max(peaks) <= 120
        assert summ["rejected_by_reason"].get("transport: rate limit (state)", 0) >= FloodHost.FLOOD - 120
    else:
        assert max(peaks) <= bound
        assert summ["transport"]["secagg_stash_full_reads"] > 0


def test_central_dp_with_secure_aggregation_noises_the_unmasked_sum_from_the_os(tmp_path: Path) -> None:
    """``privacy.mechanism: central_gaussian`` with ``buffered``: each group's sum stays exact, the
    server adds N(0, (sigma C)^2) per coordinate to the unmasked sum from the OS's CSPRNG (nothing
    a checkpoint could replay) and divides by the fixed denominator, and the DP summary's
    ``max_contribution_norm`` is the bound the members were asked to keep."""
    pytest.importorskip("dp_accounting", reason="extra felix-fl[privacy] not installed")
    sigma, clip = 0.5, 0.3
    cfg = load_config(
        write_config(
            tmp_path / "c.yaml",
            strategy="fedbuff",  # (FeLiX's probes would send losses in the clear)
            secure_aggregation={"protocol": "buffered", "group_size": 4},
            privacy={"mechanism": "central_gaussian", "noise_multiplier": sigma, "clip_norm": clip},
            partition={"kind": "dirichlet", "num_clients": 12, "alpha": 0.5},
            run={"target_accuracy": 0.99, "max_aggregations": 3, "max_time_s": 20000.0},
        )
    )
    server, rec, summ, theta0 = run_memory(cfg, tmp_path / "out", "sa-dp")
    assert summ["stop_reason"] == "max_aggregations" and len(rec.versions) == 3
    mech = server.orch.aggregator.privacy
    dp = getattr(mech, "dp", None)
    assert dp is not None and dp.os_noise and summ["privacy"]["noise_source"] == "os_csprng"
    assert mech.state_dict()["dp"]["rng"] is None  # type: ignore[union-attr]
    s = cfg.secure_aggregation
    q = Quantizer(s.clipping_range, s.quantization_bits, s.modulus_bits)
    done = [(w, g.result) for w, _, g in rec.groups if g.result is not None]
    for weights, result in done:  # each group's sum is exact; the deltas were clipped to C
        total = np.zeros(theta0.size + 1, q.dtype)
        for m in result.members:
            assert np.linalg.norm(rec.deltas[m]) <= clip * (1 + 1e-5)
            total += q.encode(weights[m], rec.deltas[m])
        np.testing.assert_array_equal(result.total, total)
    bound = clip * max(w[m] for w, r in done for m in r.members)
    assert summ["privacy"]["max_contribution_norm"] == pytest.approx(bound)
    theta, lr = theta0, float(cfg.aggregator.server_lr)
    for _, new, tasks in rec.versions:
        xsum = sum(r.weighted_sum for _, r in done if set(r.members) <= set(tasks))
        noise = (new.astype(np.float64) - theta) / lr * dp.denominator - xsum
        assert abs(noise.mean()) < 0.1 * sigma * clip
        assert noise.std() == pytest.approx(sigma * clip, rel=0.1)
        theta = new.astype(np.float64)


def _over_mosquitto(fn: Any) -> Any:
    for mark in reversed(needs_mosquitto):
        fn = mark(fn)
    return pytest.mark.slow(fn)


@_over_mosquitto
def test_sync_secagg_plus_over_mosquitto(tmp_path: Path) -> None:
    cfg = _sync(tmp_path)
    ids = list(range(cfg.partition.num_clients))
    with MosquittoBroker(len(ids), workdir=tmp_path / "broker") as broker:
        opts = ServeOptions(
            broker_options(broker), run_id="t", out_dir=tmp_path / "out", time_scale=0.05, status_every_s=1e9
        )
        server = Server(cfg, opts)
        theta0 = server.orch.weights.copy()
        copts = ClientOptions(
            broker=BrokerOptions("127.0.0.1", broker.port, reconnect_max_s=1.0),
            run_id="t",
            time_scale=0.05,
            max_wall_s=90.0,
        )
        host = ClientHost(cfg, ids, copts, credentials_from_map(users(broker)))
        rec = Record()
        instrument(server, host, rec)
        serving, clients = Background(server.run, "server"), Background(host.run, "clients")
        serving.start()
        clients.start()
        try:
            summ = serving.result(90)
            clients.result(20)
        finally:
            server.stop_requested.set()
            host.stop_requested.set()
    assert summ["stop_reason"] == "max_aggregations" and len(rec.versions) == 2
    assert summ["secure_aggregation"]["groups"] == 2 and summ["secure_aggregation"]["groups_abandoned"] == 0
    check_sums_and_models(cfg, server, rec, theta0)
    s = cfg.secure_aggregation
    assert (
        check_nothing_in_the_clear(rec, Quantizer(s.clipping_range, s.quantization_bits, s.modulus_bits))
        == 16
    )
    assert summ["rejected_by_kind"] == {}


@_over_mosquitto
def test_kill_and_resume_with_secure_aggregation_applies_every_update_once(tmp_path: Path) -> None:
    """The server is killed (SIGKILL) after a checkpoint, whether or not a group is open then;
    ``--resume`` goes on with groups of the resumed life's tasks (ids past 2^32) and no update is
    applied twice."""
    cfg_path = write_config(
        tmp_path / "cfg.yaml",
        partition={"num_clients": 12},
        trace={"kind": "always"},
        secure_aggregation={"protocol": "buffered", "group_size": 3},
        run={"target_accuracy": 0.99, "max_aggregations": 8, "max_time_s": 20000.0},
    )
    sets = ["--set", "orchestrator.agg_goal=3", "--set", "orchestrator.concurrency=6"]
    cfg = load_config(cfg_path, {"orchestrator": {"agg_goal": 3, "concurrency": 6}})
    out, ck = tmp_path / "out", tmp_path / "ck.safetensors"
    with MosquittoBroker(12, workdir=tmp_path / "broker") as broker:
        args = ["serve", str(cfg_path), *sets, "--broker", broker.address, "--run-id", "t"]
        args += [f"--password={users(broker)['felix-server']}", "--time-scale", "0.03", "--out", str(out)]
        args += ["--checkpoint", str(ck), "--secagg-stage-s", "2"]
        first = spawn(args, tmp_path / "life0.log")
        resumed = None
        host, clients = start_clients(cfg, broker, list(range(12)), 0.03)
        try:

            def checkpointed_version() -> int:
                try:
                    return int(ckpt.load_checkpoint(ck)["orchestrator"]["version"])
                except (ckpt.CheckpointError, OSError, KeyError):
                    return -1

            wait_until(lambda: checkpointed_version() >= 2, 60, "a checkpoint at version 2")
            first.send_signal(signal.SIGKILL)
            reap(first)
            resumed = spawn([*args, "--resume"], tmp_path / "life1.log")
            assert reap(resumed, timeout=90) == [0], (tmp_path / "life1.log").read_text()[-3000:]
            clients.result(20)
        finally:
            host.stop_requested.set()
            reap(*[p for p in (first, resumed) if p is not None])
    summ = json.loads((out / "summary.json").read_text())
    assert summ["stop_reason"] == "max_aggregations" and summ["deployment"]["lives"] == 2
    sa_summ = summ["secure_aggregation"]
    assert sa_summ["groups"] >= 8 and sa_summ["groups"] - sa_summ["groups_abandoned"] >= 8
    with open(out / "applied_updates.csv") as f:
        applied = list(csv.DictReader(f))
    task_ids = [int(r["task_id"]) for r in applied]
    assert len(task_ids) == len(set(task_ids)) == summ["updates_applied"], "an update was applied twice"
    assert any(t > ckpt.RESUME_TASK_ID_STRIDE for t in task_ids)  # the resumed life's groups


class _Killed(BaseException):
    """Ends a server's run as a crash would: not an ``Exception``, so no handler takes it."""


@_over_mosquitto
def test_a_server_killed_while_a_group_runs_resumes_without_that_group(tmp_path: Path) -> None:
    """The server dies after the masked vectors of a group arrived and before it asks for the
    unmask shares. The resumed server gets the group's results again from the broker and forms
    new groups of them; their clients already masked those updates and refuse (``replay``), so
    those updates are lost, counted, and the run goes on with no update applied twice."""
    path = write_config(
        tmp_path / "c.yaml",
        partition={"num_clients": 12},
        trace={"kind": "always"},
        secure_aggregation={"protocol": "buffered", "group_size": 5},
        run={"target_accuracy": 0.99, "max_aggregations": 4, "max_time_s": 20000.0},
    )
    cfg = load_config(path, {"orchestrator": {"agg_goal": 5, "concurrency": 10}})
    ck = tmp_path / "ck.safetensors"
    with MosquittoBroker(12, workdir=tmp_path / "broker") as broker:
        opts = ServeOptions(
            broker_options(broker),
            run_id="t",
            out_dir=tmp_path / "out",
            checkpoint=ck,
            time_scale=0.05,
            status_every_s=1e9,
            secagg_stage_s=2.0,
        )
        first = Server(cfg, opts)
        assert first.secagg is not None
        send = first.secagg.send

        def die_before_unmasking(cid: int, payload: bytes) -> None:
            msg = secagg_wire.decode(payload, from_server=True).msg
            if isinstance(msg, sa.UnmaskRequest) and first.stats.checkpoints >= 1:
                raise _Killed
            send(cid, payload)

        first.secagg.send = die_before_unmasking
        copts = ClientOptions(
            broker=BrokerOptions("127.0.0.1", broker.port, reconnect_max_s=1.0),
            run_id="t",
            time_scale=0.05,
            max_wall_s=120.0,
        )
        host = ClientHost(cfg, list(range(12)), copts, credentials_from_map(users(broker)))
        serving, clients = Background(first.run, "server"), Background(host.run, "clients")
        serving.start()
        clients.start()
        try:
            with pytest.raises(_Killed):
                serving.result(60)
            killed_at = first.orch.version
            second = Server(cfg, dataclasses.replace(opts, resume=True))
            summ = Background(second.run, "resumed")
            summ.start()
            summary = summ.result(90)
            clients.result(20)
        finally:
            first.stop_requested.set()
            host.stop_requested.set()
    assert summary["stop_reason"] == "max_aggregations" and summary["deployment"]["lives"] == 2
    assert second.orch.version == 4 > killed_at
    # The dead group's stage messages come again from the broker: no group of this life has them.
    assert summary["rejected_by_reason"].get("secagg: wrong_group", 0) >= 1
    # Its members' updates were masked once: their clients refuse the new groups' setups.
    refused = host.protocol.dropped_by_kind.get("secagg", 0)
    sa_summ = summary["secure_aggregation"]
    assert refused >= 1 and sa_summ["updates_lost"] >= refused
    with open(tmp_path / "out" / "applied_updates.csv") as f:
        task_ids = [int(r["task_id"]) for r in csv.DictReader(f)]
    assert len(task_ids) == len(set(task_ids)) == summary["updates_applied"]
