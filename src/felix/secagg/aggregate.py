"""Secure aggregation inside a run's aggregation: the updates of an aggregation are summed by
SecAgg+ groups (the protocol objects of :mod:`felix.secagg.server` and :mod:`felix.secagg.client`,
run through :func:`felix.secagg.session.run_group`, every message encoded and its bytes counted),
and the aggregator's step is formed from the unmasked group sums alone.

It is the aggregator's sum mechanism (``Aggregator.privacy``'s ``SumMechanism`` protocol, the hook
the central DP mechanism uses), installed by :mod:`felix.secagg.setup` when the section is on, so
both shells go through it. Pure numpy and the ``cryptography`` package: no clock, no I/O.

Who is in a group and who drops (the churn the run's trace produces):

- the members are the aggregation's reporters, and, for each training task that lost its slot or
  was cancelled since the previous aggregation, a member that drops after sharing its secrets (it
  advertised keys and sent shares when its task was dispatched, and never sent a masked vector):
  its mask key is rebuilt by its neighbours, the cost of a dropout;
- a reporter that the orchestrator knows to be unavailable at the aggregation (its last reported
  tier is ``UN_AVL``) drops before it answers the unmask request;
- a group that loses too many members is abandoned: its updates are lost (``updates_lost``), the
  other groups' sum is still applied; when every group is abandoned the aggregation fails and the
  orchestrator rejects its updates (never a wrong sum).

What the groups' exchanges take in virtual time (``felix.secagg.latency``, from the section's link
model) is kept for the run controller (:meth:`SecureSum.take_delay`): the simulator holds the new
version back by it.

With ``privacy.mechanism: central_gaussian`` on, the two compose: each client clips its delta to
``clip_norm`` before masking and folds its weight capped at 1, a client's second update in one
aggregation is left out (so one client moves the sum by at most C), and the server adds the
mechanism's noise to the unmasked sum (from the mechanism's generator: the OS's CSPRNG in a
deployment) and divides by its fixed denominator. The DP summary's ``max_contribution_norm`` is
measured on the deltas in the simulator; a deployment's server cannot measure a masked update,
and reports the bound its members were asked to keep (C times the largest folded weight in the
sum).

Otherwise each update's folded weight is the aggregator's weight for it over ``max_weight`` (capped
at 1), or over the aggregation's largest weight when ``max_weight`` is null (the default): a weight
far below 1 would shrink ``w * delta`` below the quantisation step. In a deployment (``remote``
set) the server sends each member its folded weight, and the member folds it into what it masks
(docs/deployment.md, "Secure aggregation").

The members are training tasks (their ids); in a deployment, only the aggregation's reporters,
whose dropouts are real (``RemoteGroups``: ``felix.deploy.secagg_groups``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from felix.core.types import BufferedUpdate, Tier
from felix.privacy.central import CentralGaussian
from felix.secagg.graph import GroupLayout, group_threshold, split_groups
from felix.secagg.latency import group_seconds
from felix.secagg.quantize import Quantizer
from felix.secagg.server import SecAggServer
from felix.secagg.session import Traffic, run_group

#: Ids of the members standing for dropped tasks (above any real client id the wire allows).
_PLACEHOLDER = 1 << 31


class RemoteGroups(Protocol):
    """Runs a group with real members (the deployment's ``felix.deploy.secagg_groups``): each
    member (a task id) is asked, through its client, for its masked ``[w, w * delta]`` with the
    folded weight given; returns the finished (or abandoned) server state and the bytes."""

    def run_group(
        self,
        layout: GroupLayout,
        quantizer: Quantizer,
        weights: Mapping[int, float],
        length: int,
        client_of: Mapping[int, int],
    ) -> tuple[SecAggServer, Traffic]: ...


class SecureSum:
    """The aggregation's sum by secure aggregation groups; counts what the summary reports.

    ``remote`` set (a deployment): the groups run with the clients that reported, which mask
    their own deltas (the buffer holds none), and their dropouts are real; unset (the
    simulator): the groups run in process on the buffered deltas, with the trace's dropouts."""

    def __init__(
        self, cfg: Any, normalize: str, orch: Any, rng: np.random.Generator, dp: CentralGaussian | None = None
    ) -> None:
        self.cfg = cfg
        self.dp = dp
        self.normalize = normalize
        self.orch = orch
        self.rng = rng
        self.q = Quantizer(cfg.clipping_range, cfg.quantization_bits, cfg.modulus_bits)
        self.groups = 0
        self.groups_abandoned = 0
        self.dropouts_recovered = 0
        self.updates_lost = 0
        self.bytes_total = 0
        self.bytes_plain = 0
        self.round_trips = 0
        self.delay_s = 0.0  # the virtual seconds the groups' exchanges held back the new versions
        self.deadlines = 0  # exchanges that waited out stage_timeout_s for a silent member
        self._delay = 0.0  # the last aggregation's, for the run controller (take_delay)
        self._dropped_mark = 0
        self._pending = (0, 0)  # (up, down) bytes of the aggregation just made, for the run's byte counts
        self._abandoned: set[int] = set()  # the tasks of the last aggregation, when every group was abandoned
        self.remote: RemoteGroups | None = None

    def noised_step(
        self, buffer: Sequence[BufferedUpdate], weights: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The mean update from the groups' unmasked sums, and each update's effective weight (0 for
        the updates of an abandoned group)."""
        s = self.cfg
        if self._abandoned and {item.task_id for item in buffer} <= self._abandoned:
            # the orchestrator's fallback tries each update of a failed aggregation alone: those
            # updates were lost (and counted) with it, and one update alone cannot be hidden
            raise ValueError("secure aggregation: this update's aggregation was abandoned")
        self._abandoned = set()
        stats = self.orch.stats
        dropped = stats.train_dropped + stats.train_cancelled - self._dropped_mark
        self._dropped_mark = stats.train_dropped + stats.train_cancelled
        if self.remote is not None:  # real members drop for real: no stand-ins
            dropped = 0
        if self.dp is None:
            w = np.asarray(weights, dtype=np.float64)
            scale = s.max_weight if s.max_weight is not None else float(w.max(initial=0.0)) or 1.0
            folded = np.minimum(w / scale, 1.0)
            index = {item.task_id: i for i, item in enumerate(buffer)}
        else:  # the central mechanism's bound: weights capped at 1, one update per client
            scale = 1.0
            folded = np.minimum(np.asarray(weights, dtype=np.float64), 1.0)
            newest = {item.client_id: i for i, item in enumerate(buffer)}
            index = {buffer[i].task_id: i for i in sorted(newest.values())}
            self.updates_lost += len(buffer) - len(index)
        ids = list(index) + [_PLACEHOLDER + k for k in range(dropped)]
        order = [ids[i] for i in self.rng.permutation(len(ids))]
        length = int(buffer[0].update.delta.size) if buffer and buffer[0].update.delta is not None else 0
        wsum, xsum, survivors, traffic, plain, excused = 0.0, np.zeros(length), [], Traffic(), 0, 0
        self._delay = 0.0
        for g, members in enumerate(split_groups(order, s.group_size) or [order]):
            reporters = [m for m in members if m in index]
            if len(members) < 2:  # a lone update cannot be hidden: it is not applied
                self.updates_lost += len(reporters)
                continue
            k, t = group_threshold(len(members), s.shares, s.t)
            layout = GroupLayout(self.orch.version * 4096 + g, tuple(members), k, t)
            if self.remote is not None:
                client_of = {m: buffer[index[m]].client_id for m in members}
                weights_of = {m: float(folded[index[m]]) for m in members}
                server, tr = self.remote.run_group(layout, self.q, weights_of, length, client_of)
            else:
                server, tr = self._in_process(layout, members, index, buffer, folded, length)
            traffic.add(tr)
            took = group_seconds(
                tr.stages,
                s.link,
                s.stage_timeout_s,
                [m for m in members if m not in index],  # stand-ins for dropped tasks
                {m: 4 * length for m in reporters},
                s.stage_grace_s,
            )
            self._delay = max(self._delay, took.seconds)  # the groups run side by side
            self.deadlines += took.deadlines
            self.groups += 1
            plain += 4 * length * len(reporters)
            excused += 4 * length * len(server.masked)  # the plaintext updates masked vectors stood in for
            if server.result is None:
                self.groups_abandoned += 1
                self.updates_lost += len(reporters)
                continue
            r = server.result
            self.dropouts_recovered += r.dropouts_recovered
            lost = [m for m in reporters if m not in r.members]
            self.updates_lost += len(lost)
            wsum += r.weight_sum
            xsum += r.weighted_sum
            survivors += [index[m] for m in r.members]
        self.bytes_total += traffic.total
        self.bytes_plain += excused
        # the masked vectors stand in for the plaintext updates the byte model already counts
        self._pending = (sum(traffic.up.values()) - plain, sum(traffic.down.values()))
        self.round_trips += traffic.round_trips
        self.delay_s += self._delay
        if not survivors:
            self._abandoned = {item.task_id for item in buffer}
            raise ValueError("secure aggregation: every group of this aggregation was abandoned")
        norm_w = np.zeros(len(buffer))
        if self.dp is not None:  # noise on the unmasked sum, the fixed denominator
            if self.remote is not None:  # the members clipped to C and folded w <= 1: the bound
                bound = self.dp.clip_norm * float(folded[survivors].max())
                self.dp.max_contribution_norm = max(self.dp.max_contribution_norm, bound)
            xsum += self.dp.generator().normal(0.0, self.dp.noise_std, length)
            norm_w[survivors] = folded[survivors] / self.dp.denominator
            return (xsum / self.dp.denominator).astype(np.float32), norm_w
        if self.normalize == "weights":
            if wsum <= 0:
                raise ValueError("secure aggregation: the surviving weights sum to 0")
            step = xsum / wsum
            norm_w[survivors] = folded[survivors] / folded[survivors].sum()
        else:
            step = xsum * scale / len(survivors)
            norm_w[survivors] = folded[survivors] * scale / len(survivors)
        return step.astype(np.float32), norm_w

    def _in_process(
        self,
        layout: GroupLayout,
        members: list[int],
        index: dict[int, int],
        buffer: Sequence[BufferedUpdate],
        folded: np.ndarray,
        length: int,
    ) -> tuple[SecAggServer, Traffic]:
        """The simulator's group: every member in this process, a stand-in for a dropped task
        silent from the masked stage on, a reporter the orchestrator sees unavailable silent at
        the unmask stage."""
        updates = {}
        for m in members:
            if m in index:
                item = buffer[index[m]]
                assert item.update.delta is not None
                updates[m] = (float(folded[index[m]]), self._client_side(item.update.delta))
            else:
                updates[m] = (0.0, np.zeros(length, dtype=np.float32))
        drop_at = {m: "masked" for m in members if m not in index}
        for m in members:
            if m in index and self.orch.clients[buffer[index[m]].client_id].reported_tier is Tier.UN_AVL:
                drop_at[m] = "unmask"
        return run_group(layout, self.q, updates, drop_at)

    def _client_side(self, delta: np.ndarray) -> np.ndarray:
        """What a client masks: its delta, clipped to the central mechanism's L2 bound when DP is on
        (the server cannot clip what it cannot see)."""
        if self.dp is None:
            return delta
        norm = float(np.linalg.norm(delta))
        self.dp.max_contribution_norm = max(self.dp.max_contribution_norm, min(norm, self.dp.clip_norm))
        return delta * (self.dp.clip_norm / norm) if norm > self.dp.clip_norm else delta

    @property
    def denominator(self) -> int | None:
        """The DP summary's fields, when DP is on (``felix.privacy.budget``)."""
        return None if self.dp is None else self.dp.denominator

    @property
    def max_contribution_norm(self) -> float | None:
        return None if self.dp is None else self.dp.max_contribution_norm

    def take_traffic(self) -> tuple[int, int]:
        """The (up, down) bytes the protocol added to the last aggregation (up: beyond the plaintext
        updates the run already counts), once: the run controller adds them to the ``train`` kind."""
        out, self._pending = self._pending, (0, 0)
        return out

    def take_delay(self) -> float:
        """The virtual seconds the last aggregation's groups took (the simulator holds the new
        version back by them: ``felix.engine.controller``), once."""
        out, self._delay = self._delay, 0.0
        return out

    def summary(self) -> dict[str, Any]:
        return {
            "protocol": self.cfg.protocol,
            "groups": self.groups,
            "groups_abandoned": self.groups_abandoned,
            "dropouts_recovered": self.dropouts_recovered,
            "updates_lost": self.updates_lost,
            "bytes_overhead": self.bytes_total - self.bytes_plain,
            "round_trips": self.round_trips,
            "delay_s": round(self.delay_s, 6),
            "deadlines": self.deadlines,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            **({} if self.dp is None else {"dp": self.dp.state_dict()}),
            "rng": self.rng.bit_generator.state,
            "counts": [
                self.groups,
                self.groups_abandoned,
                self.dropouts_recovered,
                self.updates_lost,
                self.bytes_total,
                self.bytes_plain,
                self.round_trips,
                self._dropped_mark,
            ],
            "delay": [self.delay_s, self.deadlines],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.dp is not None:
            self.dp.load_state_dict(state["dp"])
        self.rng.bit_generator.state = state["rng"]
        (
            self.groups,
            self.groups_abandoned,
            self.dropouts_recovered,
            self.updates_lost,
            self.bytes_total,
            self.bytes_plain,
            self.round_trips,
            self._dropped_mark,
        ) = (int(v) for v in state["counts"])
        delay, deadlines = state.get("delay", (0.0, 0))  # a checkpoint from before the link cost
        self.delay_s, self.deadlines = float(delay), int(deadlines)


__all__ = ["SecureSum"]
