"""The run controller: what a run measures and when it stops, the same for both shells.

It sits between a shell (the simulator, :mod:`felix.sim.simulation`, or the MQTT server,
:mod:`felix.deploy.server`) and the orchestrator. The shell hands it every event; it passes the
event on and returns the orchestrator's commands for the shell to carry out, and on the way it

- accounts the bytes of the event's message (upstream) and of every command's message
  (downstream) by one byte model, :func:`upstream_bytes` / :func:`downstream_bytes`, so that a
  strategy reports the same byte categories in both shells;
- on each ``NewModelVersion``: notes the clients' training loss, evaluates the model on the eval
  cadence (``run.eval_every``; 0 evaluates nothing, not even the initial model), appends each
  evaluation to a sink as it happens (``evaluations.csv``), and checks the stop rules (target
  reached by the FeLiX window rule, ``max_aggregations``);
- stops on ``max_time_s`` (:meth:`RunController.past_time_limit`) and on
  :meth:`RunController.request_stop` (Ctrl-C / SIGTERM: the shells and the CLI catch signals and
  call it; ``stop_reason: interrupted``);
- evaluates the final model (:meth:`RunController.finish`), assembles the summary
  (:meth:`RunController.summary`), and saves/restores its measurements for
  the server's checkpoints (:meth:`RunController.state_dict`).

It is sans-I/O apart from the injected evaluator and sink (and :meth:`RunController.write_outputs`,
which a shell calls at the end): time comes in as arguments.

The byte model (modelled bytes, ``bytes_by_kind``): every message is ``HEADER_BYTES`` plus its
payload, as the simulator has always modelled it: a model is 4 bytes a parameter, a training
task also carries its aux arrays and its data-plan row (8 bytes a class), a registration its class
counts (8 bytes a class), an evaluation result two numbers (16 bytes); a cancel and a client's
failure report are bare headers. Which client messages count: every one the orchestrator acts on
(events a shell derives itself, ticks or a restarted client's lost task, are no messages). A tier report is such a
message only when the availability knowledge tracks tiers (``availability: tiertrack``, the FeLiX
authors' TierTrack cost); under ``none`` and ``oracle`` the orchestrator ignores tier reports, so
they are not part of the modelled protocol (the MQTT client still sends them: the server reports
what really crossed the wire separately, ``wire_bytes_by_kind``). Messages a shell refuses before
the orchestrator sees them (transport errors, duplicates) are wire bytes only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from felix.config import Config
from felix.core.commands import CancelTask, Command, DispatchEval, DispatchTrain, NewModelVersion
from felix.core.events import ClientRegistered, Event, TaskFailed, TaskFinished, TierChanged
from felix.core.orchestrator import Orchestrator
from felix.metrics.recorder import HEADER_BYTES, ByteCounter, EvalRow, Recorder, TrainLossRow
from felix.metrics.report import summary as run_summary
from felix.metrics.report import write_run
from felix.metrics.stall import StallClock
from felix.privacy.budget import PrivacyBudget
from felix.secagg.aggregate import SecureSum

EVAL_RESULT_BYTES = HEADER_BYTES + 16  # an evaluation result: accuracy-style utility and loss


class EvalSink(Protocol):
    """Where evaluations go as they happen (``felix.metrics.report.EvalLog``: evaluations.csv)."""

    def reset(self, rows: list[EvalRow]) -> None: ...

    def append(self, row: EvalRow) -> None: ...


def aux_nbytes(aux: dict[str, np.ndarray]) -> int:
    return sum(np.asarray(v).nbytes for v in aux.values())


def upstream_bytes(event: Event, model_bytes: int, tier_reports: bool) -> tuple[str, int] | None:
    """The modelled (kind, bytes) of the client message behind ``event``; None when it is not a
    counted message (a tick; a tier report when tiers are not tracked)."""
    if isinstance(event, TaskFinished):
        upd = event.update
        if upd.delta is None:
            return "eval", EVAL_RESULT_BYTES
        return "train", model_bytes + aux_nbytes(upd.aux)
    if isinstance(event, ClientRegistered):
        return "control", HEADER_BYTES + 8 * len(event.class_counts)
    if isinstance(event, TierChanged):
        return ("control", HEADER_BYTES) if tier_reports else None
    if isinstance(event, TaskFailed):
        return "control", HEADER_BYTES
    return None


def downstream_bytes(cmd: Command, model_bytes: int) -> tuple[str, int] | None:
    """The modelled (kind, bytes) of the server message a command sends; None for the commands that
    send nothing (a new version, a rejection)."""
    if isinstance(cmd, DispatchTrain):
        return "train", model_bytes + aux_nbytes(cmd.aux) + 8 * len(cmd.plan)
    if isinstance(cmd, DispatchEval):
        return "eval", model_bytes
    if isinstance(cmd, CancelTask):
        return "control", HEADER_BYTES
    return None


class RunController:
    """One run's measurement and stop rules around ``orch`` (see the module docstring)."""

    def __init__(
        self,
        cfg: Config,
        orch: Orchestrator,
        recorder: Recorder,
        sink: EvalSink | None = None,
        measure_wire: bool = False,
    ) -> None:
        self.cfg = cfg
        self.orch = orch
        self.rec = recorder
        self.sink = sink
        r = cfg.run
        self.max_time_s = r.max_time_s
        self.max_aggregations = r.max_aggregations
        self.stop_at_target = r.stop_at_target
        self.model_bytes = 4 * int(orch.weights.size) + HEADER_BYTES
        self.tier_reports = orch.availability.tier_reports_sent
        # What really crossed the wire (the MQTT server's encoded payloads), beside the model.
        self.wire: ByteCounter | None = ByteCounter() if measure_wire else None
        self.stall = StallClock()  # the aggregator's stall time (felix.metrics.stall)
        self._stop: str | None = None
        # privacy on: the budget accounts each aggregation (felix.privacy.budget)
        self.privacy = PrivacyBudget(cfg, orch.aggregator.privacy) if cfg.privacy.enabled else None
        # secure aggregation on: its groups' protocol bytes and counts (felix.secagg.aggregate)
        mech = orch.aggregator.privacy
        self.secagg = mech if isinstance(mech, SecureSum) else None
        # The versions whose release the groups' exchanges hold back: version -> virtual release time
        # (only those not yet released at the latest aggregation; empty without secure aggregation).
        self.releases: dict[int, float] = {}
        self.on_evaluation: list[Callable[[EvalRow], None]] = []  # e.g. a log line per evaluation

    # ------------------------------------------------------------------ stopping
    @property
    def stop_reason(self) -> str | None:
        """Why the run stops (the first rule that fired), None while it runs."""
        return self._stop

    def stop(self, reason: str) -> None:
        """End the run for ``reason`` unless a rule already ended it (e.g. ``no_more_events``)."""
        self._stop = self._stop or reason

    def request_stop(self) -> None:
        """Ctrl-C / SIGTERM: stop after the event in hand (safe to call from a signal handler)."""
        self.stop("interrupted")

    def past_time_limit(self, now: float) -> bool:
        """True (and the run stops: ``max_time``) once ``now`` is beyond ``run.max_time_s``."""
        if now > self.max_time_s:
            self.stop("max_time")
            return True
        return False

    # ------------------------------------------------------------------ events
    def start(self) -> None:
        """Evaluate the initial model (unless ``eval_every`` is 0 or a resumed run has rows), point
        the sink at what is measured so far, and start the stall clock."""
        if self.sink is not None:
            self.sink.reset(self.rec.rows)
        # Until the first client registers (a deployment waits for them), nothing is in flight.
        self.stall.observe(self.orch.now, 0, self.orch.ledger.train_in_flight == 0)
        if self.rec.eval_every > 0 and not self.rec.rows:
            self._record(0.0, 0, self.orch.weights)

    def handle(self, event: Event, from_client: bool = True) -> list[Command]:
        """Pass ``event`` to the orchestrator, account the bytes of its message (``from_client``:
        the event is a client's message, not one the shell derived) and of the commands' messages,
        and act on new model versions. Returns the commands, for the shell to carry out."""
        if from_client:
            up = upstream_bytes(event, self.model_bytes, self.tier_reports)
            if up is not None:
                self.rec.bytes.add("up", *up)
        commands = self.orch.handle(event)
        versions = 0
        for cmd in commands:  # in order: an evaluation's byte totals include what was sent before it
            if isinstance(cmd, NewModelVersion):
                versions += 1
                self._on_version(cmd)
                continue
            down = downstream_bytes(cmd, self.model_bytes)
            if down is not None:
                self.rec.bytes.add("down", *down)
        self.stall.observe(self.orch.now, versions, self.orch.ledger.train_in_flight == 0)
        return commands

    def count_wire(self, direction: str, kind: str, n: int) -> None:
        """A message's real encoded size (the MQTT server), reported as ``wire_bytes_by_kind``."""
        if self.wire is not None:
            self.wire.add(direction, kind, n)

    def release_time(self, version: int) -> float | None:
        """When ``version`` is released to the clients, if its secure aggregation holds it back
        (the simulator delivers the tasks that carry it then); None: at once."""
        return self.releases.get(version)

    def _on_version(self, cmd: NewModelVersion) -> None:
        self.rec.on_aggregation(cmd)
        at = cmd.time
        if self.secagg is not None:
            up, down = self.secagg.take_traffic()
            self.rec.bytes.add("up", "train", up)  # the protocol's messages are training traffic
            self.rec.bytes.add("down", "train", down)
            # the version exists once its groups have unmasked, and never before the one it follows
            at = max([cmd.time + self.secagg.take_delay(), *self.releases.values()])
            self.releases = {v: t for v, t in self.releases.items() if t > cmd.time}
            if at > cmd.time:
                self.releases[cmd.version] = at
        if self.privacy is not None:
            self.privacy.step()
            if self.privacy.spent:
                self.stop("privacy_budget_spent")
        if self.rec.due(cmd.version):
            self._record(at, cmd.version, cmd.weights)
            if self.stop_at_target and self.rec.reached:
                self.stop("target_reached")
        if self.max_aggregations is not None and cmd.version >= self.max_aggregations:
            self.stop("max_aggregations")
        if self.rec.converged_at is not None:  # run.converge_threshold: the DAFL paper's rule
            self.stop("converged")

    def _record(self, time_s: float, version: int, weights: np.ndarray) -> EvalRow:
        eps = None if self.privacy is None else self.privacy.epsilon
        row = self.rec.record(time_s, version, weights, eps)
        if self.sink is not None:
            self.sink.append(row)
        for hook in self.on_evaluation:
            hook(row)
        return row

    # ------------------------------------------------------------------ the end
    def finish(self, now: float) -> None:
        """The run has ended: evaluate the final model if the cadence skipped it (never with
        ``eval_every`` 0; an interrupted run too: it is what the run measured last)."""
        self.stall.advance(now)
        rows = self.rec.rows
        if self.rec.eval_every > 0 and (not rows or rows[-1].version != self.orch.version):
            self._record(now, self.orch.version, self.orch.weights)

    def summary(self, now: float, wall_s: float, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """The run's summary (``felix.metrics.report.summary``: figures, diagnostics, provenance with
        the run settings), with the shell's ``extra`` keys."""
        c = self.cfg
        common: dict[str, Any] = {
            "scenario": c.name,
            "num_clients": c.partition.num_clients,
            "num_params": int(self.orch.weights.size),
        }
        if self.wire is not None:
            common["wire_bytes_by_kind"] = {"down": dict(self.wire.down), "up": dict(self.wire.up)}
        summ = run_summary(
            c.strategy,
            c.seed,
            self.rec,
            self.orch.stats,
            self.orch.version,
            now,
            wall_s,
            self._stop or "running",
            {**common, **(extra or {})},
            run_settings=c.run.model_dump(),
        )
        summ["diagnostics"].update(self.stall.diagnostics(now))
        rec = self.rec
        if rec.converge is not None:
            at = rec.converged_at
            summ["convergence"] = {
                "round": rec.converged_round,
                "version": None if at is None else at.version,
                "time_s": None if at is None else at.time_s,
            }
        if self.privacy is not None:
            summ["privacy"] = self.privacy.summary()
        if self.secagg is not None:
            summ["secure_aggregation"] = self.secagg.summary()
        if rec.per_client is not None:  # run.per_client_eval: the final model, client by client
            summ["per_client"] = rec.per_client(self.orch.weights)
        return summ

    def write_outputs(self, out_dir: Path, summ: dict[str, Any], plots: bool) -> None:
        """summary.json, evaluations.csv (rewritten whole: no row twice), plots and config.json."""
        write_run(out_dir, summ, self.rec.rows, plots)
        (out_dir / "config.json").write_text(self.cfg.model_dump_json(indent=2) + "\n")

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The measurements so far, explicit and columnar like ``Orchestrator.state_dict``."""
        r = self.rec
        state: dict[str, Any] = {
            "rows": _columns(r.rows, EvalRow),
            "train_losses": _columns(r.train_losses, TrainLossRow),
            "bytes_down": dict(r.bytes.down),
            "bytes_up": dict(r.bytes.up),
            "time_to_target": r.time_to_target,
            "bytes_to_target": r.bytes_to_target,
            "version_at_target": r.version_at_target,
            "stall": self.stall.state_dict(),
        }
        if self.wire is not None:
            state["wire_down"], state["wire_up"] = dict(self.wire.down), dict(self.wire.up)
        if self.privacy is not None:
            state["privacy_aggregations"] = self.privacy.accountant.steps
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        r = self.rec
        r.rows = _rows(state["rows"], EvalRow)
        r.train_losses = _rows(state["train_losses"], TrainLossRow)
        r.bytes = ByteCounter(dict(state["bytes_down"]), dict(state["bytes_up"]))
        r.time_to_target = state["time_to_target"]
        r.bytes_to_target = state["bytes_to_target"]
        r.version_at_target = state["version_at_target"]
        if "stall" in state:  # a checkpoint from before stall time was measured starts it afresh
            self.stall.load_state_dict(state["stall"])
        if self.privacy is not None:  # a checkpoint made without privacy: every version counts
            self.privacy.accountant.steps = int(state.get("privacy_aggregations", self.orch.version))
        if self.wire is not None and "wire_down" in state:
            self.wire = ByteCounter(dict(state["wire_down"]), dict(state["wire_up"]))


def _columns(rows: list[Any], cls: type) -> dict[str, np.ndarray]:
    """Rows of a flat numeric dataclass as one float64 array per field (exact for ints below 2**53);
    an optional field that some row leaves None (``epsilon`` without privacy) is left out."""
    return {
        f.name: np.array([getattr(r, f.name) for r in rows], dtype=np.float64)
        for f in fields(cls)
        if not any(getattr(r, f.name) is None for r in rows)
    }


def _rows(cols: dict[str, np.ndarray], cls: type) -> list[Any]:
    """The rows ``_columns`` wrote; a field with a default that an older checkpoint lacks takes
    its default."""
    names = [f.name for f in fields(cls) if f.name in cols or f.default is MISSING]
    ints = {f.name for f in fields(cls) if f.type in ("int", int)}
    lists = [np.asarray(cols[k]).tolist() for k in names]
    return [
        cls(**{k: int(v) if k in ints else float(v) for k, v in zip(names, vals, strict=True)})
        for vals in zip(*lists, strict=True)
    ]


__all__ = [
    "EVAL_RESULT_BYTES",
    "EvalSink",
    "RunController",
    "aux_nbytes",
    "downstream_bytes",
    "upstream_bytes",
]
