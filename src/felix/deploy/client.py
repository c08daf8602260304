"""Deployment clients: one process runs one client (``felix client``) or many (an emulate worker).

Each client (a ``Device``) has its own MQTT connection and login, its local partition (its shard
of the run's plan, ``felix.engine.plan``: the simulator's partition for the same seed, gathered
alone: a process holds no other client's samples), its
tier, replayed from the config's availability trace (device ``cid`` unless ``--trace-device``)
with the trace's time compressed by ``time_scale``, and a queue of tasks: the shared device
runner (:mod:`felix.engine.device`, the simulator's own), fed the trace time (clock / time_scale),
whose timers this loop sets and whose released results it publishes. All clients of a process
share one loop thread and one ``LocalTrainer`` (the simulator's), so tasks compute one at a time
per process; paho's network threads only hand messages to the loop. The loop's clock is
injectable (``ClientHost(clock=...)``), and ``handle`` / ``run_timers`` are its two steps, so
tests drive the message handling in virtual time with a fake link.

Protocol of a client:
- waits for the server's retained STATUS, then sends REGISTER (sample and class counts, tier),
  again whenever a new server session appears (a resumed server);
- sends STATE only when its tier changes (TierTrack: no heartbeats), and once after each
  reconnect, to undo the last will (STATE UN_AVL) the broker sends if the connection is lost;
- a task that names its model by hash (``felix serve --model-http``) first fetches it over HTTP
  (``felix.deploy.model_fetch``: checked against the hash, shared by the host's clients, bounded
  in size and time); a model that cannot be had fails the task (a FAILED report);
- runs TRAIN and EVAL tasks in arrival order; a task re-delivered by the broker is run once;
  CANCEL drops a queued or running task;
- with ``secure_aggregation:`` on, a training RESULT carries the update's metadata only; the
  client keeps the delta and answers the server's secure-aggregation stages for that task
  (``felix.deploy.secagg_member``: keys, shares, the masked ``[w, w * delta]``, unmask shares);
- after every reconnect, publishes again the results it sent in the last ``RESEND_WINDOW_S``
  (at most ``RESEND_MAX`` per client): a broker killed with ``kill -9`` loses what it had
  acknowledged since its last autosave, and the server drops what it already had (by task id).

Interrupted training. ``runtime="profile"`` (emulation, the default): a task lasts the client's
runtime from the config's runtime profile (``eval_fraction`` of it for an eval), scaled by
``time_scale``; the clock of a task runs only while the tier allows it (AVL_TRAIN for training,
AVL_TRAIN or AVL_EVAL for an eval) and pauses otherwise, resuming where it stopped when the client
is back: the simulator's model of a checkpointed, resumed task. The computation itself runs at
the end of that time, so a cancelled task costs nothing and a paused one loses nothing.
``runtime="compute"`` (a real device): the task takes as long as its computation; a result
finished while the tier forbids sending it is held until the tier allows, as the FeLiX authors'
clients do. Both deliver a late, stale update after an interruption.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from felix.client.trainer import LocalTrainer
from felix.config import Config, ConfigError
from felix.core.types import ClientUpdate, TaskKind, Tier
from felix.deploy import secagg_wire, wire
from felix.deploy.broker_config import default_max_message_bytes
from felix.deploy.channels import Channel
from felix.deploy.client_protocol import ClientProtocol, Dropped
from felix.deploy.inbox import Inbox
from felix.deploy.model_fetch import Fetched, FetchOptions, ModelFetcher
from felix.deploy.secagg_member import SealedUpdates
from felix.deploy.topics import client_user
from felix.deploy.transport import ClientLink, ClientLinkArgs, Connected, Delivery, LinkOptions
from felix.deploy.transport import resolve as resolve_transport
from felix.engine.device import DeviceRunner, DeviceTask, Step, TaskRules, task_seed
from felix.engine.plan import plan_run
from felix.engine.setup import build_client_side
from felix.privacy.setup import device_mechanism
from felix.scenario.traces import DeviceTrace
from felix.secagg import messages as sa
from felix.secagg.refusals import SecAggRefusal
from felix.strategies.dataplans.plans import PlanApplier

log = logging.getLogger("felix.deploy.client")

_TIER, _DONE = 0, 1
CONNECT_PARALLELISM = 16
# paho's network loop uses select(), which cannot watch file descriptors above 1024, and each
# paho client holds three (its socket and a wake-up socket pair): past ~300 clients a process's
# connections all fail at once. ``felix emulate`` spreads clients over enough processes.
MAX_CLIENTS_PER_PROCESS = 250
RESEND_WINDOW_S = 30.0  # results re-published after a reconnect: those sent this many wall seconds before
RESEND_MAX = 8  # ... at most this many per client
INBOX_BATCH = 16  # messages handled per loop turn at most (timers run between turns)
STOP_GRACE_S = 2.0  # on a stop request, the links get this long (together) to disconnect cleanly


@dataclass(frozen=True)
class ClientOptions:
    broker: LinkOptions  # the transport's options model; each client's login comes from ``credentials``
    run_id: str
    time_scale: float = 1.0  # wall seconds per config second (trace and runtime profile)
    runtime: str = "profile"  # "profile" (emulated runtime) or "compute" (real compute time)
    trace_device: int | None = None  # follow this device of the trace instead of the client's own
    t0: float | None = None  # Unix time at which the trace starts (shared by emulated clients)
    no_train: bool = False  # reply with a zero update at once (capacity benchmark)
    max_wall_s: float | None = None
    will_delay_s: int = 5
    max_inbox_bytes: int = 64 << 20  # received but not yet handled, all of a process's clients ...
    max_inbox_messages: int = 10000  # ... together: reaching either makes the network threads wait
    transport: str = "mqtt"  # the registered transport (felix.deploy.transport) the links use
    fetch: FetchOptions = field(default_factory=FetchOptions)  # model downloads by hash

    def __post_init__(self) -> None:
        if self.time_scale <= 0:
            raise ValueError("time scale must be positive")
        if self.runtime not in ("profile", "compute"):
            raise ValueError(f"runtime must be 'profile' or 'compute', not {self.runtime!r}")
        if self.trace_device is not None and self.trace_device < 0:
            raise ValueError(f"trace device must be 0 or more, not {self.trace_device}")
        if self.max_wall_s is not None and not self.max_wall_s > 0:
            raise ValueError(f"max wall seconds must be positive, not {self.max_wall_s}")


@dataclass(eq=False)
class Device(DeviceRunner[bytes]):
    """A deployed client: the shared task runner (times in trace seconds; results are encoded
    RESULT messages), its trace, and its MQTT connection."""

    trace: DeviceTrace = field(kw_only=True)
    link: ClientLink | None = field(default=None, kw_only=True)  # set when connected
    incarnation: str = field(default_factory=lambda: secrets.token_hex(4), kw_only=True)
    ids: wire.MsgIds = field(init=False)
    session: str | None = field(default=None, kw_only=True)  # the server session it registered with
    sent: deque[tuple[float, bytes]] = field(
        default_factory=lambda: deque(maxlen=RESEND_MAX), kw_only=True
    )  # recent results (clock time, payload)
    finished: bool = field(default=False, kw_only=True)
    connections: int = field(default=0, kw_only=True)
    sealed: SealedUpdates = field(default_factory=SealedUpdates, kw_only=True)  # updates awaiting groups

    def __post_init__(self) -> None:
        self.ids = wire.MsgIds(self.incarnation)


class ClientHost:
    """Runs a set of clients on one loop thread until the server says the run is finished."""

    def __init__(
        self,
        cfg: Config,
        client_ids: list[int],
        opts: ClientOptions,
        credentials: Callable[[int], tuple[str | None, str | None]],
        traces: dict[int, DeviceTrace] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``traces``: each client's availability trace, when the caller has them (``felix emulate``
        builds the population's trace once and hands each worker its share); else built here.
        ``clock``: monotonic seconds (a test's fake clock drives the client in virtual time)."""
        n = cfg.partition.num_clients
        bad = [c for c in client_ids if not 0 <= c < n]
        if bad:
            raise ValueError(f"client ids {bad} are outside the population of {n} clients")
        if len(client_ids) > MAX_CLIENTS_PER_PROCESS:
            raise ValueError(
                f"{len(client_ids)} clients in one process; at most {MAX_CLIENTS_PER_PROCESS} fit "
                f"(paho-mqtt's select() loop is limited to 1024 file descriptors): use more processes"
            )
        self.cfg = cfg
        self.opts = opts
        self.transport = resolve_transport(opts.transport, opts.broker)
        if cfg.client.flower_app is not None:
            raise ConfigError(
                "client.flower_app runs in the simulator (felix run, compare, sweep); "
                "the MQTT client trains with felix's own trainer"
            )
        # The run's plan, as the simulator's and the server's: this process gathers only its own
        # clients' rows of the training pool, and its stream (the simulator's model: same seed,
        # same samples) reads availability from these clients' traces, in trace time.
        plan = plan_run(cfg, shards_only=True)
        if traces is None:
            traces = {
                c: plan.trace.for_client(opts.trace_device if opts.trace_device is not None else c)
                for c in client_ids
            }
        missing = [c for c in client_ids if c not in traces]
        if missing:
            raise ValueError(f"no availability trace for clients {missing[:5]}")
        plan.client_traces = _TraceView(traces)
        self.max_bytes = default_max_message_bytes(int(plan.initial_weights.size))
        # The simulator's client side: the same trainer, runtimes, data plan (augmentation, seeds and
        # time charge) and stream feeds.
        side = build_client_side(plan)
        self.trainer: LocalTrainer = side.trainer
        self.stream = side.stream
        self.plan_applier: PlanApplier | None = side.plan_applier
        self.rules = TaskRules(
            eval_fraction=cfg.runtime.eval_fraction,
            compute=opts.runtime == "compute",
            augment=self.plan_applier,
            privacy=device_mechanism(cfg, os_noise=True),  # clipped (noised: local DP) on the device
        )
        self._clock = clock
        t0 = opts.t0 if opts.t0 is not None else time.time()
        self._mono_t0 = clock() - (time.time() - t0)
        self.devices: dict[int, Device] = {}
        for cid in client_ids:
            dt = traces[cid]
            self.devices[cid] = Device(
                cid, side.data(cid), float(side.runtimes[cid]), dt.tier_at(self.trace_time()), trace=dt
            )
            self.devices[cid].feed = side.feed(cid)
        self._credentials = credentials
        # Bounded like the server's: a flood makes the network threads wait (the broker keeps the
        # rest), instead of growing this process's memory; the tag is the client id.
        self.inbox = Inbox(opts.max_inbox_bytes, opts.max_inbox_messages)
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self.stop_requested = threading.Event()
        self.tasks_done = 0
        self.protocol = ClientProtocol(opts.run_id, self.max_bytes)  # the checks of the server's messages
        # Tasks that name their model by hash wait here (hash -> client, task, message) while it is fetched.
        self.models = ModelFetcher(opts.fetch, lambda f: self.inbox.put(f))
        self._awaiting: dict[str, list[tuple[int, wire.TrainTask | wire.EvalTask, bytes]]] = {}

    # ------------------------------------------------------------------ time
    def trace_time(self, mono: float | None = None) -> float:
        """Config seconds since the trace's start."""
        return ((self._clock() if mono is None else mono) - self._mono_t0) / self.opts.time_scale

    def _mono_at(self, trace_t: float) -> float:
        return self._mono_t0 + trace_t * self.opts.time_scale

    def _push(self, at: float, kind: int, cid: int, token: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, kind, cid, token))

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        """Connect every client, then serve tasks until all are finished; returns tasks completed."""
        deadline = None if self.opts.max_wall_s is None else self._clock() + self.opts.max_wall_s
        try:
            # Connections wait for the broker's answers: open a process's many links side by side.
            with ThreadPoolExecutor(max_workers=CONNECT_PARALLELISM) as pool:
                for fut in [pool.submit(self._connect, dev) for dev in self.devices.values()]:
                    fut.result()
            self.serve(deadline)
        finally:
            self.inbox.close()  # a network thread waiting on a full inbox must not block its link's close
            self.models.close()
            self._close_links()
        if self.protocol.dropped_by_kind:
            dropped = dict(sorted(self.protocol.dropped_by_kind.items()))
            log.warning("dropped messages from the server, by kind: %s", dropped)
        return self.tasks_done

    def _close_links(self) -> None:
        """Disconnect every link side by side, within ``STOP_GRACE_S`` in all: one at a time, a
        process's links would take up to a second each while the broker is unreachable (paho's
        reconnect wait), minutes for a full process. Links still closing after that are abandoned
        (daemon threads; the broker then sends their wills)."""
        links = [dev.link for dev in self.devices.values() if dev.link is not None]
        wait = (
            0.0 if self.stop_requested.is_set() else 2.0
        )  # a stop does not wait for unacknowledged publishes
        threads = [threading.Thread(target=link.close, args=(wait,), daemon=True) for link in links]
        for t in threads:
            t.start()
        deadline = time.monotonic() + STOP_GRACE_S + wait
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _connect(self, dev: Device) -> None:
        if self.stop_requested.is_set():
            return
        user, password = self._credentials(dev.cid)
        link = self.transport.client_link(
            ClientLinkArgs(
                self.opts.run_id,
                dev.cid,
                self.opts.broker.with_login(user, password),
                lambda item: self.inbox.put(item, dev.cid),
                lambda items: self.inbox.put_many(items, dev.cid),
            )
        )  # dev: this call's own
        link.set_will(Channel.STATE, lambda epoch: self._state_will(dev, epoch), self.opts.will_delay_s)
        link.start(fresh=True)
        dev.link = link

    def serve(self, deadline: float | None) -> None:
        """The loop: messages from the inbox, tier changes and task completions from the timer heap."""
        self.start_timers()
        while not all(d.finished for d in self.devices.values()) and not self.stop_requested.is_set():
            if deadline is not None and self._clock() > deadline:
                log.warning("clients %s: stopping at the wall-time limit", sorted(self.devices))
                break
            nxt = self.next_timer()
            timeout = 0.25 if nxt is None else min(0.25, max(0.0, nxt - self._clock()))
            for cid, item in self.inbox.get_batch(timeout, INBOX_BATCH):
                self.handle(cid, item)
            self.run_timers()

    def start_timers(self) -> None:
        """Schedule every client's next tier change (the loop's first step)."""
        for dev in self.devices.values():
            self._schedule_tier(dev)

    def next_timer(self) -> float | None:
        """The clock time of the earliest pending timer (tier change or task completion)."""
        return self._heap[0][0] if self._heap else None

    def run_timers(self) -> None:
        """Fire the timers that are due by the clock."""
        while self._heap and self._heap[0][0] <= self._clock():
            _, _, kind, cid, token = heapq.heappop(self._heap)
            dev = self.devices[cid]
            if dev.finished:
                continue
            if kind == _TIER:
                self._on_tier(dev)
            else:
                self._on_done(dev, token)

    # ------------------------------------------------------------------ messages
    def handle(self, cid: int, item: Delivery | Connected | Fetched) -> None:
        """One item from a client's link (a message or a reconnection), or a model download that
        ended, as the loop takes it."""
        if isinstance(item, Fetched):
            self._on_fetched(item)
        else:
            self._on_item(self.devices[cid], item)

    def _on_item(self, dev: Device, item: Delivery | Connected) -> None:
        if isinstance(item, Connected):
            dev.connections += 1
            if dev.connections > 1 and dev.session is not None:
                self._send_state(dev)  # undo a will the broker may have sent while we were away
            if dev.connections > 1:
                self._resend_recent(dev)
            return
        if item.address is None:  # the transport could not place it (no transport of ours does this)
            log.warning("client %d: dropped a message from %s", dev.cid, item.origin[:80])
            return
        msg = self.protocol.receive(dev.cid, item.address.channel, item.payload)
        if isinstance(msg, Dropped):
            log.warning("client %d: dropped %s", dev.cid, msg.detail)
            return
        if isinstance(msg, secagg_wire.SecAggEnvelope):
            self._on_secagg(dev, msg)
            return
        if isinstance(msg, wire.Status):
            if msg.state == "finished":
                log.info("client %d: the server finished the run", dev.cid)
                dev.finished = True
            elif msg.session != dev.session:
                dev.session = msg.session
                self._register(dev)
            return
        if isinstance(msg, wire.Cancel):
            self._cancel(dev, msg.task)
        elif isinstance(msg, (wire.TrainTask, wire.EvalTask)) and msg.model is not None:
            self._await_model(dev, msg, item.payload)
        elif isinstance(msg, wire.TrainTask):
            self._receive(dev, msg.task, TaskKind.TRAIN, msg.version, msg.weights, msg.aux, msg.plan)
        elif isinstance(msg, wire.EvalTask):
            self._receive(dev, msg.task, TaskKind.EVAL, msg.version, msg.weights, {}, ())

    def _await_model(self, dev: Device, msg: wire.TrainTask | wire.EvalTask, payload: bytes) -> None:
        """A task that names its model by hash: run it with the host's copy, or once fetched."""
        assert msg.model is not None
        if msg.task in dev.seen:
            return  # a redelivery, or cancelled already
        body = self.models.cached(msg.model.sha256)
        if body is not None:
            self._with_model(dev, payload, body)
            return
        self._awaiting.setdefault(msg.model.sha256, []).append((dev.cid, msg, payload))
        self.models.request(msg.model)

    def _on_fetched(self, f: Fetched) -> None:
        for cid, msg, payload in self._awaiting.pop(f.sha256, []):
            dev = self.devices[cid]
            if f.body is not None:
                self._with_model(dev, payload, f.body)
            elif msg.task not in dev.seen:  # not cancelled meanwhile: the server hears it failed
                log.warning("client %d: task %d: %s", cid, msg.task, f.error)
                self._cancel(dev, msg.task)
                fail = wire.Failed(
                    **self._env(dev),
                    client=cid,
                    incarnation=dev.incarnation,
                    task=msg.task,
                    reason=f.error[: wire.MAX_STR],
                )
                self._publish_result(dev, msg.task, wire.encode(fail))

    def _with_model(self, dev: Device, payload: bytes, body: bytes) -> None:
        msg = self.protocol.complete(dev.cid, payload, body)
        if isinstance(msg, Dropped):
            log.warning("client %d: dropped %s", dev.cid, msg.detail)
        elif isinstance(msg, wire.TrainTask):
            self._receive(dev, msg.task, TaskKind.TRAIN, msg.version, msg.weights, msg.aux, msg.plan)
        else:
            self._receive(dev, msg.task, TaskKind.EVAL, msg.version, msg.weights, {}, ())

    def _receive(
        self,
        dev: Device,
        task_id: int,
        kind: TaskKind,
        version: int,
        weights: np.ndarray,
        aux: dict[str, np.ndarray],
        plan: tuple[int, ...],
    ) -> None:
        step = dev.receive(
            self.trace_time(), task_id, kind, weights, self.rules, aux=aux, version=version, plan=plan
        )
        if step is None:
            return  # a redelivery (QoS 1), or a task cancelled already: it runs once, or not at all
        log.info("client %d: task %d (%s) received", dev.cid, task_id, kind.value)
        self._follow(dev, step)

    def _follow(self, dev: Device, step: Step[bytes] | None) -> None:
        """Do what the device's runner asks: set its completion timer, publish its released results."""
        if step is None:
            return
        if step.timer is not None:
            self._push(self._mono_at(step.timer.at), _DONE, dev.cid, step.timer.token)
        for held in step.released:
            self._publish_result(dev, held.task.task_id, held.result)

    def _env(self, dev: Device) -> dict[str, Any]:
        return {"run": self.opts.run_id, "msg_id": dev.ids.next(), "sent_at": time.time()}

    def _publish(self, dev: Device, channel: Channel, payload: bytes) -> None:
        assert dev.link is not None
        dev.link.send(channel, payload)

    def _register(self, dev: Device) -> None:
        if self.stream is None:
            size = len(dev.data)
            counts = tuple(int(c) for c in torch.bincount(dev.data.y, minlength=self.trainer.num_classes))
        else:  # the most samples a task may hold, as in the simulator
            size, counts = self.stream.registration(dev.cid)
        msg = wire.Register(
            **self._env(dev),
            client=dev.cid,
            incarnation=dev.incarnation,
            num_samples=size,
            tier=dev.tier,
            class_counts=counts,
        )
        self._publish(dev, Channel.REGISTER, wire.encode(msg))

    def _send_state(self, dev: Device) -> None:
        msg = wire.State(**self._env(dev), client=dev.cid, incarnation=dev.incarnation, tier=dev.tier)
        self._publish(dev, Channel.STATE, wire.encode(msg))

    def _state_will(self, dev: Device, epoch: int) -> bytes:
        return wire.encode(
            wire.State(
                run=self.opts.run_id,
                msg_id=f"{dev.incarnation}-will-{epoch}",
                sent_at=time.time(),
                client=dev.cid,
                incarnation=dev.incarnation,
                tier=Tier.UN_AVL,
            )
        )

    # ------------------------------------------------------------------ tiers
    def _schedule_tier(self, dev: Device) -> None:
        nxt = dev.trace.next_change(self.trace_time())
        if nxt is not None:
            self._push(self._mono_at(nxt[0]), _TIER, dev.cid)

    def _on_tier(self, dev: Device) -> None:
        self._schedule_tier(dev)
        self._refresh_tier(dev)

    def _refresh_tier(self, dev: Device) -> None:
        now = self.trace_time()
        step = dev.set_tier(now, dev.trace.tier_at(now))
        if step is not None and dev.session is not None:
            self._send_state(dev)
        self._follow(dev, step)

    # ------------------------------------------------------------------ tasks
    def _cancel(self, dev: Device, task_id: int) -> None:
        self._follow(dev, dev.cancel(self.trace_time(), task_id))

    def _on_done(self, dev: Device, token: int) -> None:
        task = dev.complete(token)
        if task is None:
            return
        t0 = self._clock()
        try:
            upd = self._compute(dev, task)
        except Exception as exc:  # a broken task must not take the other clients of the process down
            log.exception("client %d: task %d failed", dev.cid, task.task_id)
            fail = wire.Failed(
                **self._env(dev),
                client=dev.cid,
                incarnation=dev.incarnation,
                task=task.task_id,
                reason=f"{type(exc).__name__}: {exc}"[: wire.MAX_STR],
            )
            self._publish_result(dev, task.task_id, wire.encode(fail))
            self._follow(dev, dev.fail(self.trace_time(), task))
            return
        spent = self._clock() - t0
        if self.rules.privacy is not None:
            upd = self.rules.privacy.release(dev.cid, task.task_id, upd)
        upd.duration = task.duration if self.opts.runtime == "profile" else spent / self.opts.time_scale
        sealed = task.kind is TaskKind.TRAIN and self.cfg.secure_aggregation.enabled
        if sealed:
            self._seal(dev, task.task_id, upd.delta)
            upd = dataclasses.replace(upd, delta=None)  # the update travels masked, in its group
        msg = wire.Result(
            **self._env(dev),
            client=dev.cid,
            incarnation=dev.incarnation,
            task=task.task_id,
            kind=task.kind,
            version=task.version,
            update=dataclasses.replace(upd, data_span=task.data_span)  # what it trained on
            if task.kind is TaskKind.TRAIN
            else dataclasses.replace(upd, delta=None, aux={}, data_span=None),  # an eval sends no arrays
            sealed=sealed,
        )
        self.tasks_done += 1
        self._refresh_tier(dev)  # the tier may have changed while computing
        self._follow(dev, dev.finish(self.trace_time(), task, wire.encode(msg)))  # sent now, or held

    # ------------------------------------------------------------------ secure aggregation
    def _seal(self, dev: Device, task_id: int, delta: np.ndarray | None) -> None:
        assert delta is not None  # a training update
        dev.sealed.seal(task_id, delta)

    def _on_secagg(self, dev: Device, env: secagg_wire.SecAggEnvelope) -> None:
        """One stage of the group of the task ``env.member``: answer it, or refuse it (counted)."""
        try:
            reply = self._secagg_reply(dev, env)
        except SecAggRefusal as exc:
            log.warning("client %d: dropped %s", dev.cid, self.protocol.refused(exc).detail)
            return
        if reply is not None:
            out = secagg_wire.SecAggEnvelope(self.opts.run_id, dev.cid, env.member, env.task, 0.0, reply)
            self._publish(dev, Channel.SECAGG, secagg_wire.encode(out))

    def _secagg_reply(self, dev: Device, env: secagg_wire.SecAggEnvelope) -> sa.Message | None:
        return dev.sealed.answer(env)

    def _compute(self, dev: Device, task: DeviceTask) -> ClientUpdate:
        if self.opts.no_train:
            delta = np.zeros(task.weights.size, np.float32) if task.kind is TaskKind.TRAIN else None
            return ClientUpdate(len(dev.data), 1.0, 1.0, 0.0, delta)
        if task.kind is TaskKind.TRAIN:
            gen = torch.Generator().manual_seed(task_seed(self.cfg.seed, task.task_id))  # as the simulator
            return self.trainer.train(task.weights, dev.data, dev.state, task.aux, gen)
        return self.trainer.probe(task.weights, dev.data)

    def _publish_result(self, dev: Device, task: int, payload: bytes) -> None:
        log.info("client %d: task %d: result sent", dev.cid, task)  # before: a log without it was never sent
        self._publish(dev, Channel.RESULT, payload)
        dev.sent.append((self._clock(), payload))

    def _resend_recent(self, dev: Device) -> None:
        """Publish the recent results again (same bytes, same message ids): what the broker lost
        in a crash reaches the server, what the server has is dropped there as a duplicate."""
        horizon = self._clock() - RESEND_WINDOW_S
        while dev.sent and dev.sent[0][0] < horizon:
            dev.sent.popleft()
        for _, payload in dev.sent:
            self._publish(dev, Channel.RESULT, payload)
        if dev.sent:
            log.info("client %d: re-sent %d recent results after a reconnect", dev.cid, len(dev.sent))


class _TraceView:
    """This process's clients' traces where the stream model reads availability (tied arrivals)."""

    def __init__(self, traces: dict[int, DeviceTrace]) -> None:
        self.traces = traces

    def for_client(self, cid: int) -> DeviceTrace:
        return self.traces[cid]


def save_trace_shard(path: Path, traces: dict[int, DeviceTrace]) -> None:
    """Write some clients' availability traces to one ``.npz`` (``felix emulate`` -> its workers)."""
    ids = list(traces)
    arrays = [traces[c] for c in ids]
    lens = np.array([len(t.times) for t in arrays], dtype=np.int64)
    np.savez(
        path,
        ids=np.array(ids, dtype=np.int64),
        lens=lens,
        times=np.concatenate([t.times for t in arrays]) if arrays else np.zeros(0),
        tiers=np.concatenate([t.tiers for t in arrays]) if arrays else np.zeros(0, np.int8),
        periods=np.array([np.nan if t.period is None else t.period for t in arrays], dtype=np.float64),
    )


def load_trace_shard(path: str | Path) -> dict[int, DeviceTrace]:
    with np.load(path, allow_pickle=False) as z:
        ids, lens, times, tiers, periods = (z[k] for k in ("ids", "lens", "times", "tiers", "periods"))
    ends = np.cumsum(lens)
    out = {}
    for i, cid in enumerate(ids.tolist()):
        a, b = int(ends[i] - lens[i]), int(ends[i])
        p = float(periods[i])
        out[cid] = DeviceTrace(times[a:b].copy(), tiers[a:b].astype(np.int8), None if np.isnan(p) else p)
    return out


def credentials_from_map(users: dict[str, str]) -> Callable[[int], tuple[str | None, str | None]]:
    """Per-client login from a ``credentials.json`` map (``client-<cid>`` -> password)."""

    def lookup(cid: int) -> tuple[str | None, str | None]:
        name = client_user(cid)
        if name not in users:
            raise ValueError(f"no credentials for {name} in the credentials file")
        return name, users[name]

    return lookup
