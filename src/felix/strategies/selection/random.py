"""Uniform random selection: FedAvg's and FedBuff's selector."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from felix.core.registry import NoParams
from felix.core.selection import TRAIN_SELECTORS, SelectionContext, TrainSelector


class RandomSelector(TrainSelector):
    name = "random"

    def select(self, candidates: Sequence[int] | np.ndarray, k: int, ctx: SelectionContext) -> list[int]:
        if k >= len(candidates):
            return [int(c) for c in candidates]
        picked = ctx.rng.choice(len(candidates), size=k, replace=False)
        return [int(candidates[i]) for i in picked]

    def state_dict(self) -> dict[str, Any]:
        """Stateless: the randomness is the orchestrator's generator."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"the random selector has no state, got keys {sorted(state)}")


@TRAIN_SELECTORS.register("random", params=NoParams, reads_reports=False)
def _random(params: NoParams, cfg: Any) -> RandomSelector:
    return RandomSelector()
