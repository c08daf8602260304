"""The training-selection axis: which idle clients train next.

``TrainSelector`` owns one decision (which ``k`` of the eligible candidates); eligibility is the
orchestrator's (availability, rejoin and once-per-round rules). Selectors are pure: randomness and
the current time reach them through ``SelectionContext``, which the eval selectors
(``felix.core.eval_selection``) share. Built-in selectors live in ``felix.strategies.selection``
and register in ``TRAIN_SELECTORS`` next to their classes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from felix.core.client_map import ClientMap, ClientRecord, ClientView
from felix.core.registry import Registry
from felix.core.types import Tier


class AvailabilityOracle(Protocol):
    """Ground-truth availability (a trace); only oracle baselines may consult it."""

    def tier_at(self, client_id: int, t: float) -> Tier: ...

    def available_throughout(self, client_id: int, t0: float, t1: float) -> bool: ...


@dataclass(slots=True)
class SelectionContext:
    now: float
    round: int  # the current round (sync) or model version (async)
    clients: ClientMap
    rng: np.random.Generator
    oracle: AvailabilityOracle | None = None
    # model_path[r]: how far the model had moved when round r began (the sum over aggregations of
    # the step's norm relative to the new model's norm); model_path[round] - model_path[r] is the
    # movement since round r. None where no orchestrator keeps it (a bare test context).
    model_path: np.ndarray | None = None


class TrainSelector:
    """Chooses ``k`` trainers among eligible candidates; eligibility is decided by the orchestrator."""

    name = "base"

    def select(self, candidates: Sequence[int] | np.ndarray, k: int, ctx: SelectionContext) -> list[int]:
        raise NotImplementedError

    def on_update(self, record: ClientRecord | ClientView, ctx: SelectionContext) -> None:
        """Feedback after a training update or an eval refreshed ``record``'s utility and duration."""

    def on_round_end(self, round_: int, ctx: SelectionContext) -> None:
        """Called once per aggregation (pacers and round-based bookkeeping)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep of the selector (plain values and numpy arrays); a stateless
        selector keeps nothing. Configuration is rebuilt from the config, never saved."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned, onto a selector built from the same config."""


# The built-in selectors' modules, imported on the first lookup (``felix.core.registry``).
TRAIN_SELECTORS: Registry[TrainSelector] = Registry(
    "selector",
    modules=(
        "felix.strategies.selection.random",
        "felix.strategies.selection.oort",
        "felix.strategies.selection.refl",
    ),
)

__all__ = ["TRAIN_SELECTORS", "AvailabilityOracle", "SelectionContext", "TrainSelector"]
