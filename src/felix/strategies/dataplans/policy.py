"""The server side of ``data_plan: lb | dafl`` as a core data-plan policy (``felix.core.dataplan``).

The orchestrator calls the policy after every registration; once all ``expected_clients`` have
registered, it plans from their registered class counts (DAFL's Algorithm 1, or local balancing)
and returns every client's row, which then travels with the client's training tasks. The same
policy object runs in the simulator and in the MQTT server: the simulator's clients register at
time 0, so its tasks carry rows from the first one on; the server's clients register over time,
and the training tasks assigned meanwhile wait for the plan.

numpy/numba only (the planner), no torch: it runs inside the sans-I/O core.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from felix.config import ConfigError, DaflCfg, DaflPlannerCfg
from felix.core.client_map import ClientMap
from felix.core.dataplan import DATA_PLANS, DataPlanPolicy, Rows
from felix.strategies.dataplans.dafl import AugmentationPlan, DaflParams, plan_dafl, plan_local_balancing

log = logging.getLogger("felix.strategies.dataplans")


def dafl_params(cfg: DaflCfg) -> DaflParams:
    """The planner's parameters from the config's ``dafl`` section."""
    return DaflParams(**{n: getattr(cfg, n) for n in DaflPlannerCfg.model_fields})


def plan_augmentation(method: str, counts: NDArray[np.int64], cfg: DaflCfg) -> AugmentationPlan:
    """What the server computes for ``data_plan`` ``method`` from the count matrix."""
    if method == "dafl":
        return plan_dafl(counts, dafl_params(cfg))
    if method == "lb":
        return plan_local_balancing(counts, cfg.tau, step=cfg.step)
    raise ValueError(f"unknown data plan {method!r}; expected 'lb' or 'dafl'")


@dataclass(frozen=True)
class PlanSetup:
    """What a planner needs besides its parameters: the trigger and what a failed plan means.

    ``on_error``: ``raise`` (a ``ConfigError``: the simulator, whose counts come from the config)
    or ``skip`` (log it and train without a plan: the MQTT server, whose counts come from clients)."""

    expected_clients: int
    on_error: Literal["raise", "skip"] = "raise"


class PlannedDataPlan(DataPlanPolicy):
    """Plan ``method`` (``lb`` / ``dafl``) once ``setup.expected_clients`` clients have registered."""

    def __init__(self, method: str, cfg: DaflCfg, setup: PlanSetup) -> None:
        if setup.expected_clients < 1:
            raise ValueError("a data plan needs at least one expected client")
        self.name = method
        self.cfg = cfg
        self.setup = setup
        self.plan: AugmentationPlan | None = None  # this process's plan (not kept by checkpoints)
        self._info: dict[str, Any] = {}
        self._done = False

    @property
    def pending(self) -> bool:
        return not self._done

    def on_registered(self, clients: ClientMap, now: float) -> Rows | None:
        if self._done or len(clients) < self.setup.expected_clients:
            return None
        self._done = True
        ids = np.sort(clients.ids)
        try:
            counts = np.array([clients[int(c)].class_counts for c in ids], dtype=np.int64)
            plan = plan_augmentation(self.name, counts, self.cfg)
        except ValueError as exc:
            if self.setup.on_error == "raise":
                raise ConfigError(f"data_plan {self.name!r}: {exc}") from None
            log.error("data plan %r impossible, training without it: %s", self.name, exc)
            self._info = {"method": self.name, "error": str(exc)}
            return {}
        self.plan = plan
        self._info = {
            "method": plan.method,
            "I_before": plan.I_before,
            "J_before": plan.J_before,
            "I_after": plan.I_after,
            "J_after": plan.J_after,
            "added": plan.added,
            "added_per_client": list(plan.added_per_client),
            "plan_seconds": plan.plan_seconds,
        }
        # The paper sends every client its row, zeros included.
        return {int(c): tuple(int(v) for v in row) for c, row in zip(ids, plan.A, strict=True)}

    def info(self) -> dict[str, Any]:
        return dict(self._info)

    def state_dict(self) -> dict[str, Any]:
        return {"done": self._done, "info": dict(self._info)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._done = bool(state["done"])
        self._info = dict(state["info"])


@DATA_PLANS.register("lb", params=DaflCfg)
def _lb(params: DaflCfg, setup: PlanSetup) -> PlannedDataPlan:
    """Local balancing: every client augments until its own imbalance is below ``tau``."""
    return PlannedDataPlan("lb", params, setup)


@DATA_PLANS.register("dafl", params=DaflCfg)
def _dafl(params: DaflCfg, setup: PlanSetup) -> PlannedDataPlan:
    """DAFL's planned augmentation (Algorithm 1)."""
    return PlannedDataPlan("dafl", params, setup)
