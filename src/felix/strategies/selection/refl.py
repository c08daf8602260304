"""REFL's Intelligent Participant Selection (Abdelmoniem et al., EuroSys'23), as ``ahmedcs/REFL`` codes it.

``core/client_manager.py`` ``resampleClients`` with ``avail_priority=1``: a client that is online
for the whole next window but will be gone in the one after is "about to leave", so it gets
priority: train it now or lose its data for a while. Priority clients are taken first, the rest
filled at random, and the final choice inside that set is random or Oort. ``core/aggregator.py``
adds ``prohibit_reselect``: a client that ran within the last few rounds is not run again.

REFL predicts availability; the FeLiX evaluation (REFL*) gives it the trace instead, so the
lookahead reads ``ctx.oracle``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from felix.core.client_map import ClientRecord, ClientView
from felix.core.registry import params_from_dataclass
from felix.core.run_facts import RunFacts
from felix.core.selection import TRAIN_SELECTORS, AvailabilityOracle, SelectionContext, TrainSelector
from felix.strategies.selection.oort import OortSelector, OortSelectorParams, make_oort


@dataclass(frozen=True, slots=True)
class ReflIPSParams:
    """REFL's IPS knobs; defaults are the REFL* configuration of the FeLiX evaluation.

    ``time_window``: REFL's lookahead slot, its round deadline (100 s).
    ``avail_priority``: 1 = prioritise about-to-leave clients; 0 = no priority (plain choice).
    ``avail_probability``: the fraction of each class (priority and rest) kept at random, REFL's
    model of an imperfect predictor (0.9 in ``run_exps.sh``; 0 keeps all).
    ``prohibit_reselect``: rounds during which a client that ran may not run again (0 = off).
    """

    time_window: float = 100.0
    avail_priority: int = 1
    avail_probability: float = 0.9
    prohibit_reselect: int = 5

    def __post_init__(self) -> None:
        if self.time_window <= 0:
            raise ValueError(f"time_window must be > 0 seconds, not {self.time_window}")
        if self.avail_priority not in (0, 1):
            raise ValueError(
                f"avail_priority must be 0 or 1 (REFL's scheme 2 is not implemented), "
                f"not {self.avail_priority}"
            )
        if not 0.0 <= self.avail_probability <= 1.0:
            raise ValueError(f"avail_probability must lie in [0, 1], not {self.avail_probability}")
        if self.prohibit_reselect < 0:
            raise ValueError(f"prohibit_reselect must be >= 0 rounds, not {self.prohibit_reselect}")


class ReflIPSSelector(TrainSelector):
    """REFL IPS over the orchestrator's candidates; ``oort`` given = REFL's Oort mode, else random.

    REFL runs Oort with its copy of FedScale's selector, so pass
    ``OortSelector(OortParams.fedscale())`` (with ``blacklist_rounds=50`` for the FeLiX authors'
    REFL*). Feedback hooks are forwarded to it.
    """

    name = "refl-ips"

    def __init__(self, params: ReflIPSParams | None = None, oort: OortSelector | None = None) -> None:
        self.params = params if params is not None else ReflIPSParams()
        self.oort = oort

    def priority(self, client_id: int, ctx: SelectionContext) -> int:
        """REFL's ``getPriority`` with two lookahead slots of ``time_window``: 1 when the client
        is available throughout [now, now + w] but not throughout [now + w, now + 2w]."""
        oracle = _require_oracle(ctx)
        w, now = self.params.time_window, ctx.now
        soon = oracle.available_throughout(client_id, now, now + w)
        return int(soon and not oracle.available_throughout(client_id, now + w, now + 2 * w))

    def select(self, candidates: Sequence[int] | np.ndarray, k: int, ctx: SelectionContext) -> list[int]:
        _require_oracle(ctx)
        if k <= 0 or len(candidates) == 0:
            return []
        cands = np.asarray(candidates, dtype=np.int64)
        if cands.size <= k:
            return [int(c) for c in cands]  # REFL: fewer online clients than wanted -> take them all
        p = self.params
        rng = ctx.rng
        pool = cands
        if p.avail_priority and p.prohibit_reselect:
            # REFL drops recently-run picks after selecting and replaces them at random; removing
            # them before the priority split keeps the replacements under the priority rule.
            last = ctx.clients.column("selected_round")[ctx.clients.rows_of(cands)]
            pool = cands[~((last >= 0) & (ctx.round - last < p.prohibit_reselect))]
        if p.avail_priority:
            # The oracle answers one client at a time (it reads the trace): O(candidates) calls.
            urgent = np.fromiter((self.priority(int(c), ctx) for c in pool), dtype=bool, count=pool.size)
            prio, rest = pool[urgent], pool[~urgent]
            if p.avail_probability > 0:
                prio = _sample(prio, int(prio.size * p.avail_probability), rng)
                rest = _sample(rest, int(rest.size * p.avail_probability), rng)
            pool = np.concatenate([prio, _sample(rest, min(max(k - prio.size, 0), rest.size), rng)])

        if self.oort is not None and pool.size:
            chosen = self.oort.select(pool, min(k, pool.size), ctx)
        else:
            chosen = [int(c) for c in _sample(pool, min(k, pool.size), rng)]
        if len(chosen) < k:
            # REFL replaces removed picks with random online clients, without re-checking the
            # prohibit rule; recently-run and dropped-by-sampling clients fill the gap here.
            spare = cands[~np.isin(cands, np.asarray(chosen, dtype=np.int64))]
            chosen += [int(c) for c in _sample(spare, min(k - len(chosen), spare.size), rng)]
        return chosen

    def on_update(self, record: ClientRecord | ClientView, ctx: SelectionContext) -> None:
        if self.oort is not None:
            self.oort.on_update(record, ctx)

    def on_round_end(self, round_: int, ctx: SelectionContext) -> None:
        if self.oort is not None:
            self.oort.on_round_end(round_, ctx)

    def state_dict(self) -> dict[str, Any]:
        """IPS itself keeps no state (priority reads the oracle, recency the ClientMap); Oort's,
        when it runs one, under ``oort/`` keys."""
        if self.oort is None:
            return {}
        return {f"oort/{k}": v for k, v in self.oort.state_dict().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.oort is None:
            if state:
                raise ValueError(f"REFL IPS without Oort has no state, got keys {sorted(state)}")
            return
        stray = [k for k in state if not k.startswith("oort/")]
        if stray:
            raise ValueError(f"REFL IPS state: unexpected keys {stray}")
        self.oort.load_state_dict({k.removeprefix("oort/"): v for k, v in state.items()})


def _require_oracle(ctx: SelectionContext) -> AvailabilityOracle:
    if ctx.oracle is None:
        raise RuntimeError(
            "REFL IPS needs availability lookahead: give the orchestrator an availability oracle "
            "(the trace) so that ctx.oracle can answer available_throughout()"
        )
    return ctx.oracle


def _sample(items: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` items uniformly without replacement (REFL's ``Random.sample``), in draw order."""
    if n <= 0:
        return np.empty(0, dtype=np.int64)
    return items[rng.choice(items.size, size=n, replace=False)]


#: ``selector.params`` of ``refl_ips``: the ``ReflIPSParams`` fields, and ``oort`` (Oort's parameters,
#: as for ``selector: oort``) to rank the priority clients with Oort instead of at random.
ReflSelectorParams = params_from_dataclass(
    ReflIPSParams, "ReflSelectorParams", oort=(OortSelectorParams | None, None)
)


@TRAIN_SELECTORS.register(
    "refl_ips", params=ReflSelectorParams, reads_reports=lambda p: p.oort is not None
)  # Oort's utility ranks the priority clients when given
def _refl_ips(params: Any, ctx: RunFacts) -> ReflIPSSelector:
    fields = params.model_dump(exclude={"oort"})
    oort = None if params.oort is None else make_oort(params.oort, ctx)
    return ReflIPSSelector(ReflIPSParams(**fields), oort)
