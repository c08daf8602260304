"""Data-plan policies: the server's side of a data plan (DAFL / local balancing), in the core.

DAFL's server (Sec. IV-B) plans augmentation from the class counts its clients register with
(``ClientRegistered.class_counts``) and sends each client its row with its training tasks
(``DispatchTrain.plan``); a client augments once, on the first task that brings its row. The
orchestrator calls ``on_registered`` after every registration; when the policy's trigger fires
(e.g. all expected clients registered) it returns the rows. While ``pending`` is true, training
tasks the orchestrator assigns are held back and go out, with their rows, when the plan exists:
no client trains before the plan is made, in the simulator and in the deployment alike.

The planners (``felix.strategies.dataplans``) register here by name (``DATA_PLANS``, picked by
the config's ``data_plan``); ``none`` is the policy without a plan.
"""

from __future__ import annotations

from typing import Any

from felix.core.client_map import ClientMap
from felix.core.registry import NoParams, Registry

Rows = dict[int, tuple[int, ...]]


class DataPlanPolicy:
    """No data plan: nothing is held, no client gets a row."""

    name = "none"

    @property
    def pending(self) -> bool:
        """Training dispatches wait for the plan (the trigger has not fired yet)."""
        return False

    def on_registered(self, clients: ClientMap, now: float) -> Rows | None:
        """A client registered (it is in ``clients``); return every client's row once the plan is
        made (exactly once), else None."""
        return None

    def info(self) -> dict[str, Any]:
        """The summary's ``data_plan`` block (empty without a plan)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint state (plain values and arrays); the rows themselves are the orchestrator's."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""


DATA_PLANS: Registry[DataPlanPolicy] = Registry(
    "data plan", modules=("felix.strategies.dataplans.policy",), key="data_plan"
)


@DATA_PLANS.register("none", params=NoParams)
def _no_plan(params: NoParams, ctx: Any) -> DataPlanPolicy:
    return DataPlanPolicy()
