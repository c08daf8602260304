"""TierSelect (FeLiX §3.3): an Oort train selector plus a rate-limited eval selector.

The eval selector sends forward-pass tasks to idle AVL_TRAIN / AVL_EVAL clients whose utility
is oldest, so that the train selector ranks clients on fresh utilities rather than on values
measured long ago (or never). It is rate-limited because every eval task occupies a client that
could otherwise be picked to train, and costs a model download.

The train path is plain Oort (``felix.strategies.selection.oort``) over the candidates the orchestrator
passes; under ``knowledge=tiertrack`` those are the idle AVL_TRAIN clients not blocked by the
rejoin rule, which is exactly TierSelect's train pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from felix.core.eval_selection import EVAL_SELECTORS, EvalSelector
from felix.core.registry import params_from_dataclass
from felix.core.run_facts import RunFacts
from felix.core.selection import SelectionContext
from felix.strategies.selection.oort import OortParams, OortSelector
from felix.strategies.selection.ranking import smallest_first


@dataclass(frozen=True, slots=True)
class TierSelectEvalParams:
    """The FeLiX authors' eval-selector settings (``reference/felix-authors-setup.md``).

    ``include_unmeasured``: whether clients whose utility was never measured
    (``last_utility_round == -1``) may be probed. The paper's eval selector "probes stale or
    unobserved clients" (§3.1, §3.3), so they are eligible and rank stalest of all; the authors'
    fork skips them (``PROP_LAST_EVAL_ROUND is None``), which ``False`` reproduces.

    ``order``: ``"stalest"`` (default, the paper) probes the oldest utility first. ``"value"``
    probes first the eligible clients whose re-measurement is worth most to Oort's exploit step:
    last measured utility x rounds since it was measured (a high-utility client whose value has
    had long to drift), so the eval budget, and its model downloads, go to clients Oort may pick
    rather than to low-utility ones it will not. Never-measured clients (when included) come first,
    as their value is unknown. Ties break by client id.

    ``min_model_change``: a measured client is probed only when the model has moved at least this
    much since its utility was measured (``SelectionContext.model_path``: the sum, over the
    aggregations since, of each step's norm relative to the model's norm), since re-measuring a
    utility on a model that has barely moved buys nothing for its model download. 0: off (the
    paper, which only asks for ``staleness_threshold`` rounds).
    """

    eval_goal_factor: float = 1.5
    staleness_threshold: int = 35  # rounds (versions) a utility must have aged to be re-measured
    include_unmeasured: bool = True
    order: Literal["stalest", "value"] = "stalest"
    min_model_change: float = 0.0

    def __post_init__(self) -> None:
        if self.eval_goal_factor < 0:
            raise ValueError(f"eval_goal_factor must be >= 0, not {self.eval_goal_factor}")
        if self.staleness_threshold < 0:
            raise ValueError(f"staleness_threshold must be >= 0 rounds, not {self.staleness_threshold}")
        if self.order not in ("stalest", "value"):
            raise ValueError(f"order must be 'stalest' or 'value', not {self.order!r}")
        if not self.min_model_change >= 0:
            raise ValueError(f"min_model_change must be >= 0, not {self.min_model_change}")


class TierSelectEval(EvalSelector):
    """Stalest utility first, at most ``int(eval_goal_factor * agg_goal)`` eval tasks per round.

    The orchestrator resets the per-round counter at each aggregation (async) or round start
    (sync) and passes the idle AVL_TRAIN + AVL_EVAL clients; this class only decides which.
    Eligible: a utility at least ``staleness_threshold`` rounds old (``ctx.round -
    last_utility_round``), or never measured when ``include_unmeasured``. Order: the oldest
    ``last_utility_round`` first (never measured = -1 comes first), ties by client id so the
    choice is deterministic without drawing randomness.
    """

    name = "tierselect"

    def __init__(self, agg_goal: int, params: TierSelectEvalParams | None = None) -> None:
        if agg_goal < 1:
            raise ValueError(f"agg_goal must be >= 1, not {agg_goal}")
        self.params = params if params is not None else TierSelectEvalParams()
        self.per_round_budget = int(self.params.eval_goal_factor * agg_goal)

    def select(self, candidates: Sequence[int] | np.ndarray, budget: int, ctx: SelectionContext) -> list[int]:
        if budget <= 0 or len(candidates) == 0:
            return []
        ids = np.asarray(candidates, dtype=np.int64)
        last = ctx.clients.column("last_utility_round")[ctx.clients.rows_of(ids)]
        measured = last >= 0
        eligible = measured & (ctx.round - last >= self.params.staleness_threshold)
        if self.params.min_model_change > 0:
            if ctx.model_path is None:
                raise ValueError("min_model_change needs the model's path in the selection context")
            moved = ctx.model_path[ctx.round] - ctx.model_path[np.clip(last, 0, ctx.round)]
            eligible &= moved >= self.params.min_model_change
        if self.params.include_unmeasured:
            eligible |= ~measured
        idx = np.flatnonzero(eligible)
        if self.params.order == "value":
            util = ctx.clients.column("stat_utility")[ctx.clients.rows_of(ids)][idx]
            value = np.where(last[idx] >= 0, np.nan_to_num(util, nan=0.0) * (ctx.round - last[idx]), np.inf)
            order = np.lexsort((ids[idx], -value))[:budget]  # primary key: the largest value; then id
            return [int(c) for c in ids[idx[order]]]
        if (
            np.diff(ids) > 0
        ).all():  # the orchestrator's id-ordered candidates: a stable rank breaks ties by id
            order = smallest_first(last[idx], budget)
        else:
            order = np.lexsort((ids[idx], last[idx]))[:budget]  # primary key: last_utility_round; then id
        return [int(c) for c in ids[idx[order]]]

    def state_dict(self) -> dict[str, Any]:
        """Stateless: the per-round eval count is the orchestrator's."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"the TierSelect eval selector has no state, got keys {sorted(state)}")


def tierselect(
    agg_goal: int,
    eval_params: TierSelectEvalParams | None = None,
    reward_cap: int | None = None,
    **oort_overrides: Any,
) -> tuple[OortSelector, TierSelectEval]:
    """The ``felix`` preset's selector pair: Oort with the FeLiX authors' settings, and the eval path.

    ``oort_overrides`` replace fields of ``OortParams.felix_authors()`` (e.g. ``rounding="floor"``).
    """
    params = replace(OortParams.felix_authors(), **oort_overrides)
    return OortSelector(params, reward_cap=reward_cap), TierSelectEval(agg_goal, eval_params)


TierSelectEvalModel = params_from_dataclass(TierSelectEvalParams, "TierSelectEvalModel")


@EVAL_SELECTORS.register(
    "tierselect", params=TierSelectEvalModel, reads_reports=True
)  # its probes are reports, and order: value reads the utility
def _tierselect_eval(params: Any, ctx: RunFacts) -> TierSelectEval:
    """The eval path sized by the run's ``orchestrator.agg_goal``."""
    return TierSelectEval(ctx.agg_goal, TierSelectEvalParams(**params.model_dump()))
