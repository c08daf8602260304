"""The eval-selection axis: which clients get a forward-pass utility probe (TierSelect's eval path).

A probe costs a model download and returns a fresh utility; the orchestrator gives the selector
its per-round budget's worth of idle candidates. Built-in: ``none`` (here) and ``tierselect``
(``felix.strategies.selection.tierselect``), registered in ``EVAL_SELECTORS``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from felix.core.registry import NoParams, Registry
from felix.core.selection import SelectionContext


class EvalSelector:
    """Chooses clients for forward-pass utility probes (TierSelect's eval path)."""

    name = "none"
    per_round_budget: int = 0

    def select(self, candidates: Sequence[int] | np.ndarray, budget: int, ctx: SelectionContext) -> list[int]:
        return []

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint state, as ``TrainSelector.state_dict``; the eval selectors so far keep none."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""


EVAL_SELECTORS: Registry[EvalSelector] = Registry(
    "eval_selector", modules=("felix.strategies.selection.tierselect",)
)


@EVAL_SELECTORS.register("none", params=NoParams, reads_reports=False)
def _no_eval(params: NoParams, ctx: Any) -> EvalSelector:
    """No forward-pass probes."""
    return EvalSelector()


__all__ = ["EVAL_SELECTORS", "EvalSelector"]
