"""felix-fl's selection and aggregation as a Flower message-API ``Strategy`` (synchronous rounds).

:class:`FelixStrategy` is Flower's ``FedAvg`` with two decisions replaced by felix's own
implementations, the same objects felix's orchestrator uses:

- which nodes train in a round: an Oort selector (default: the FeLiX authors' settings, the train
  path of TierSelect) over the connected nodes, fed each reply's statistical utility and duration;
- how the replies become the next model: a felix ``Aggregator`` (default: TierFuse) on the
  replies' deltas from the round's global model, with the server learning rate and normalisation
  of felix's config, and aux state (FedeRage's beta) reduced by the same weights.

A node's reply is read as the Flower trainer path reads it (:mod:`felix.flower.trainer`):
``num-examples``, ``train_loss``, ``stat-utility`` (else |D| x ``train_loss``) and
``train-time-s`` (else the time between the instruction and the reply) from its ``MetricRecord``,
optional ``felix.aux`` arrays. The averaged aux travels to the next round's nodes as
``felix.aux``, where :func:`felix.flower.helpers.objective` starts from it.

What does not carry over (it needs felix's asynchronous engine, its availability tiers or its
virtual clock): TierTrack's availability tiers and the rejoin rule (Flower's Grid only lists
connected nodes), TierSelect's forward-pass probes of idle clients (a synchronous round has no
idle time to fill), buffered asynchronous aggregation (here every update is fresh, so TierFuse's
staleness term is constant and only its utility term weights the updates), over-commitment with
straggler cancellation, and time/bytes-to-target under real availability traces. For those, run
the same ``ClientApp`` under felix (``felix run --flower-app``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from logging import INFO
from typing import Any

import numpy as np

from felix.core.aggregation import Aggregator
from felix.core.client_map import ClientMap, ClientRecord
from felix.core.selection import SelectionContext, TrainSelector
from felix.core.types import BufferedUpdate, ClientUpdate, Tier
from felix.flower import import_flwr
from felix.flower.helpers import COUNTS, COUNTS_QUERY, PLAN_ROW
from felix.flower.trainer import AUX
from felix.strategies.aggregation.tierfuse import TierFuseAggregator
from felix.strategies.dataplans.dafl import AugmentationPlan, DaflParams, plan_dafl
from felix.strategies.selection.oort import OortParams, OortSelector

flwr = import_flwr()
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.strategy_utils import sample_nodes
from flwr.supercore import log


class FelixStrategy(FedAvg):
    """Flower ``FedAvg`` with felix's selector and aggregator (see the module docstring).

    ``clients_per_round``: nodes asked to train per round (all connected nodes when fewer).
    ``selector``: a felix ``TrainSelector`` (default Oort, FeLiX authors' settings).
    ``aggregator``: a felix ``Aggregator`` (default TierFuse with server learning rate 1).
    ``data_plan``: ``"dafl"`` asks the connected nodes for their class counts before the first
    round (a ``query.felix_counts`` message, answered by :func:`felix.flower.helpers.class_counts_reply`),
    plans with felix's DAFL planner (``dafl``: its ``DaflParams``) and sends each node its row
    with every train message (``felix.plan-row``, applied by :func:`felix.flower.helpers.apply_plan`).
    Other keyword arguments go to ``FedAvg`` (``fraction_evaluate``, ``min_available_nodes``, ...).
    """

    def __init__(
        self,
        clients_per_round: int = 10,
        selector: TrainSelector | None = None,
        aggregator: Aggregator | None = None,
        seed: int = 0,
        data_plan: str = "none",
        dafl: DaflParams | None = None,
        **fedavg: Any,
    ) -> None:
        if data_plan not in ("none", "dafl"):
            raise ValueError(f"data_plan must be 'none' or 'dafl', not {data_plan!r}")
        if clients_per_round < 1:
            raise ValueError(f"clients_per_round must be >= 1, not {clients_per_round}")
        fedavg.setdefault("min_available_nodes", 1)
        fedavg.setdefault("min_train_nodes", 1)
        super().__init__(**fedavg)
        self.clients_per_round = clients_per_round
        self.selector = selector if selector is not None else OortSelector(OortParams.felix_authors())
        self.aggregator = aggregator if aggregator is not None else TierFuseAggregator(server_lr=1.0)
        self.rng = np.random.default_rng(seed)
        self.clients = ClientMap()  # felix's client ids: 0, 1, ... in the order nodes connect
        self.node_ids: list[int] = []  # Flower's node id (unsigned 64-bit) of each felix client id
        self._felix_id: dict[int, int] = {}
        self.aux: dict[str, np.ndarray] = {}  # the last reduced aux state, sent with each round
        self._global: np.ndarray | None = None
        self._layout: list[tuple[str, tuple[int, ...], Any]] = []
        self._arrays: ArrayRecord | None = None
        self._sent_at = 0.0
        self.data_plan = data_plan
        self.dafl = dafl if dafl is not None else DaflParams()
        self.plan: AugmentationPlan | None = None
        self.plan_rows: dict[int, list[int]] = {}  # Flower node id -> its DAFL row

    def summary(self) -> None:
        super().summary()
        log(
            INFO,
            "\t└──> felix: %s selection, %s aggregation, %d nodes per round",
            self.selector.name,
            self.aggregator.name,
            self.clients_per_round,
        )

    def _ctx(self, server_round: int) -> SelectionContext:
        return SelectionContext(now=time.monotonic(), round=server_round, clients=self.clients, rng=self.rng)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Register newly connected nodes and let felix's selector pick this round's trainers."""
        # Flower's own wait: until min_available_nodes are connected (they register as the run starts).
        _, connected = sample_nodes(grid, self.min_available_nodes, 0)
        nodes = sorted(int(n) for n in connected)
        for nid in nodes:
            if nid not in self._felix_id:
                self._felix_id[nid] = cid = len(self.node_ids)
                self.node_ids.append(nid)
                self.clients.add(ClientRecord(cid, 1, Tier.AVL_TRAIN, Tier.AVL_TRAIN))
        if self.data_plan == "dafl" and self.plan is None:
            self._plan_dafl(nodes, grid)
        ids = sorted(self._felix_id[n] for n in nodes)
        picked = self.selector.select(ids, min(self.clients_per_round, len(ids)), self._ctx(server_round))
        for cid in picked:
            rec = self.clients[cid]
            rec.selected_round = server_round
            rec.times_selected += 1
        chosen = [self.node_ids[cid] for cid in picked]
        self._global = self._flatten(arrays)
        self._arrays = arrays
        config["server-round"] = server_round
        content = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        if self.aux:
            content[AUX] = ArrayRecord(
                {k: flwr.app.Array(np.asarray(v)) for k, v in sorted(self.aux.items())}
            )
        self._sent_at = time.time()
        log(INFO, "configure_train: felix picked %d of %d nodes", len(chosen), len(nodes))
        if not self.plan_rows:
            return self._construct_messages(content, chosen, MessageType.TRAIN)
        out = []
        for nid in chosen:  # each node's own DAFL row in its config
            own = RecordDict(dict(content.items()))
            own[self.configrecord_key] = ConfigRecord({**config, PLAN_ROW: self.plan_rows.get(nid, [])})
            out.append(Message(content=own, message_type=MessageType.TRAIN, dst_node_id=nid))
        return out

    def _plan_dafl(self, nodes: list[int], grid: Grid) -> None:
        """Ask every node for its class counts, and plan the augmentation over those that answer."""
        queries = [Message(RecordDict(), message_type=COUNTS_QUERY, dst_node_id=n) for n in nodes]
        counts: dict[int, np.ndarray] = {}
        for reply in grid.send_and_receive(queries):
            if not reply.has_error() and COUNTS in reply.content.array_records:
                counts[int(reply.metadata.src_node_id)] = reply.content.array_records[COUNTS][
                    "counts"
                ].numpy()
        if not counts:
            raise ValueError("data_plan dafl: no node answered the class-count query (query.felix_counts)")
        order = sorted(counts)
        self.plan = plan_dafl(np.stack([counts[n] for n in order]), self.dafl)
        self.plan_rows = {n: [int(v) for v in row] for n, row in zip(order, self.plan.A)}
        log(INFO, "DAFL plan: %d new samples over %d nodes", self.plan.added, len(order))

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Feed each reply to the selector, then aggregate the deltas with felix's aggregator."""
        # Flower's own check wants one ArrayRecord per reply; a felix reply may add felix.aux.
        valid, _ = self._check_and_log_replies(replies, is_train=True, validate=False)
        valid = [m for m in valid if self.arrayrecord_key in m.content.array_records]
        if not valid or self._global is None or self._arrays is None:
            return None, None
        ctx = self._ctx(server_round)
        buffer: list[BufferedUpdate] = []
        for i, msg in enumerate(valid):
            cid = self._felix_id[int(msg.metadata.src_node_id)]
            upd = self._update(msg)
            rec = self.clients[cid]
            rec.num_samples = upd.num_samples
            rec.stat_utility = upd.stat_utility
            rec.last_utility_round = server_round
            rec.last_duration = upd.duration
            self.selector.on_update(rec, ctx)
            rec.times_updated += 1
            buffer.append(BufferedUpdate(cid, i, server_round - 1, time.time(), upd, 0))
        theta, _, self.aux = self.aggregator.aggregate(self._global, buffer)
        self.selector.on_round_end(server_round, ctx)
        metrics = self.train_metrics_aggr_fn([m.content for m in valid], self.weighted_by_key)
        return self._unflatten(theta), metrics

    def _update(self, msg: Message) -> ClientUpdate:
        assert self._global is not None
        content = msg.content
        arrays = content.array_records[self.arrayrecord_key]
        # Flower types record values as a union of every kind a record may hold; these are numbers.
        metrics: dict[str, Any] = dict(next(iter(content.metric_records.values()), {}))
        n = int(metrics.get(self.weighted_by_key, 1))
        loss = float(metrics.get("train_loss", metrics.get("loss", 0.0)))
        duration = metrics.get("train-time-s")
        if duration is None:
            duration = max(float(msg.metadata.created_at) - self._sent_at, 0.0)
        aux_rec = content.array_records.get(AUX)
        aux = {k: np.asarray(v.numpy(), dtype=np.float64) for k, v in aux_rec.items()} if aux_rec else {}
        return ClientUpdate(
            num_samples=n,
            stat_utility=float(metrics.get("stat-utility", n * loss)),
            loss=loss,
            duration=float(duration),
            delta=self._flatten(arrays) - self._global,
            aux=aux,
        )

    def _flatten(self, arrays: ArrayRecord) -> np.ndarray:
        """The floating-point arrays of a record as one float32 vector (in the record's order)."""
        parts, layout = [], []
        for key, arr in arrays.items():
            a = arr.numpy()
            layout.append((key, a.shape, a.dtype))
            if np.issubdtype(a.dtype, np.floating):
                parts.append(a.astype(np.float32, copy=False).ravel())
        if not self._layout:
            self._layout = layout
        elif [k for k, _, _ in layout] != [k for k, _, _ in self._layout]:
            raise ValueError("a reply's arrays do not match the global model's keys")
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)

    def _unflatten(self, theta: np.ndarray) -> ArrayRecord:
        """The global record with its floating-point arrays replaced by ``theta``'s values."""
        assert self._arrays is not None
        out, at = {}, 0
        for key, arr in self._arrays.items():
            a = arr.numpy()
            if np.issubdtype(a.dtype, np.floating):
                n = a.size
                out[key] = flwr.app.Array(theta[at : at + n].reshape(a.shape).astype(a.dtype))
                at += n
            else:
                out[key] = arr
        return ArrayRecord(out)


def run_simulation(
    server_app: Any,
    client_app: Any,
    num_supernodes: int,
    backend_config: dict[str, Any] | None = None,
    num_cpus: int | None = None,
) -> None:
    """Flower's ``run_simulation`` on a Ray instance felix starts loopback-only, without usage
    statistics or cloud-metadata probes (:mod:`felix.distributed.ray_runtime`), and shuts down
    after; left to itself, Flower's Ray backend binds Ray's servers to every interface. An
    instance this process already runs is used as it is."""
    from felix.distributed.ray_runtime import import_ray, start_local

    ray = import_ray()
    started = not ray.is_initialized()
    if started:
        start_local(num_cpus=num_cpus)
    try:
        flwr.simulation.run_simulation(
            server_app=server_app,
            client_app=client_app,
            num_supernodes=num_supernodes,
            backend_config=backend_config,
        )
    finally:
        if started:
            ray.shutdown()


__all__ = ["FelixStrategy", "run_simulation"]
