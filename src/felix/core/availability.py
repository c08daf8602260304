"""Availability policies: what the server believes of its clients' availability (DESIGN.md's
second axis), and what a tier report or a timeout changes.

``none``: every registered client looks available; trouble shows only as a timeout.
``oracle``: tier reports filter selection (they stand for reading the trace), but in-flight tasks
are not interrupted: the oracle baselines know who is online, not who just left.
``tiertrack``: client-reported tiers filter selection *and* free the slot of a client that leaves
(UN_AVL, or AVL_TRAIN -> AVL_EVAL) at once; a timeout marks a silent client UN_AVL.

The orchestrator keeps each client's last reported tier (``ClientRecord.reported_tier``) and asks
the policy for the tier it should act on (``ClientRecord.tier``). A new policy (a REFL-style
availability predictor, say) is one subclass registered in ``AVAILABILITY`` next to it and picked
by ``orchestrator.availability``; the orchestrator is not edited. A policy acts on the orchestrator
through ``felix.core.view.OrchestratorView`` (``clients``, ``task``, ``release``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from felix.core.client_map import ClientMap, ClientRecord, ClientView
from felix.core.registry import NoParams, Registry
from felix.core.types import Task, TaskEvent, TaskKind, Tier
from felix.core.view import OrchestratorView, PolicySettings


class AvailabilityPolicy:
    """Base class: the decisions the orchestrator delegates about availability."""

    name = "base"
    #: Clients send tier reports that the server acts on, so a shell counts their bytes as control
    #: traffic (the oracle stands for reading the trace: its reports are free; ``none`` ignores them).
    tier_reports_sent = True
    #: The policy reads ground truth (the trace) through ``SelectionContext.oracle``.
    needs_oracle = False

    def __init__(self, cfg: PolicySettings) -> None:
        self.cfg = cfg

    def registered_tier(self, reported: Tier) -> Tier:
        """The tier the server acts on for a client that registers reporting ``reported``."""
        return reported

    def on_tier(self, orch: OrchestratorView, rec: ClientRecord | ClientView, tier: Tier) -> None:
        """``rec`` reported ``tier`` (already stored as ``rec.reported_tier``)."""
        orch.clients.set_tier(rec.client_id, tier)

    def train_rows(self, clients: ClientMap, now: float) -> np.ndarray:
        """Rows of the idle clients that may be picked to train at ``now`` (the orchestrator then
        applies the rejoin and once-per-round rules)."""
        return clients.idle_rows(Tier.AVL_TRAIN)

    def on_timeout(self, orch: OrchestratorView, task: Task) -> None:
        """``task`` ran past the task timeout (its slot is already freed)."""

    def on_reply(self, orch: OrchestratorView, rec: ClientRecord | ClientView) -> None:
        """A result arrived from ``rec``: it is alive. A timeout may have marked it UN_AVL; its
        reported tier holds again."""
        if rec.tier is Tier.UN_AVL and rec.reported_tier is not Tier.UN_AVL:
            orch.clients.set_tier(rec.client_id, rec.reported_tier)

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint state (plain values and arrays); the built-in policies keep theirs in the ClientMap."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""


AVAILABILITY: Registry[AvailabilityPolicy] = Registry("availability policy", key="orchestrator.availability")


@AVAILABILITY.register("none", params=NoParams)
class NoKnowledge(AvailabilityPolicy):
    name = "none"
    tier_reports_sent = False

    def __init__(self, params: NoParams, cfg: PolicySettings) -> None:
        super().__init__(cfg)

    def registered_tier(self, reported: Tier) -> Tier:
        return Tier.AVL_TRAIN

    def on_tier(self, orch: OrchestratorView, rec: ClientRecord | ClientView, tier: Tier) -> None:
        return

    def train_rows(self, clients: ClientMap, now: float) -> np.ndarray:
        return clients.idle_rows(*Tier)


@AVAILABILITY.register("oracle", params=NoParams)
class OracleKnowledge(AvailabilityPolicy):
    name = "oracle"
    tier_reports_sent = False
    needs_oracle = True

    def __init__(self, params: NoParams, cfg: PolicySettings) -> None:
        super().__init__(cfg)


@AVAILABILITY.register("tiertrack", params=NoParams)
class TierTrack(AvailabilityPolicy):
    name = "tiertrack"

    def __init__(self, params: NoParams, cfg: PolicySettings) -> None:
        super().__init__(cfg)

    def on_tier(self, orch: OrchestratorView, rec: ClientRecord | ClientView, tier: Tier) -> None:
        cid = rec.client_id
        orch.clients.set_tier(cid, tier)
        holder = orch.clients[cid].in_flight  # the ledger's column (a record has none)
        if holder is None:
            return
        task = orch.task(holder)
        if tier is Tier.UN_AVL or (tier is Tier.AVL_EVAL and task.kind is TaskKind.TRAIN):
            orch.release(task, TaskEvent.CLIENT_LEFT)

    def on_timeout(self, orch: OrchestratorView, task: Task) -> None:
        orch.clients.set_tier(task.client_id, Tier.UN_AVL)
