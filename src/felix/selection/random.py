"""Uniform random selection: FedAvg's and FedBuff's selector."""
from __future__ import annotations

from collections.abc import Sequence

from felix.core.policies import SelectionContext, TrainSelector


class RandomSelector(TrainSelector):
    name = "random"

    def select(self, candidates: Sequence[int], k: int, ctx: SelectionContext) -> list[int]:
        if k >= len(candidates):
            return list(candidates)
        picked = ctx.rng.choice(len(candidates), size=k, replace=False)
        return [candidates[i] for i in picked]
