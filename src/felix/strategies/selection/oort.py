"""Oort's training selector (Lai et al., OSDI'21), as its public code implements it.

Followed line by line: ``SymbioticLab/Oort`` ``oort/oort.py`` (``_training_selector.getTopK``) and,
for ``variant="fedscale"``, the copy in ``SymbioticLab/FedScale`` ``thirdparty/oort/oort.py`` (which
REFL also ships). ``reference/baselines.md`` lists both. One selection:

1. Blacklist (off by default): clients with more than ``blacklist_rounds`` successful updates.
2. Preferred round duration ``T``: the ``round_threshold``-th percentile of known durations.
3. Normalisation (``get_norm``) over the positive rewards of the feasible clients, explored or not
   (Oort keeps a registration reward for unexplored clients, so they shape min / range / clip too).
4. Score of an explored client: ``(min(r, clip) - min) / range + sqrt(0.1 ln(round) / last_round)``,
   times ``(T / duration) ** round_penalty`` when it is slower than ``T``.
5. epsilon <- max(epsilon * decay, min); exploit ``exploitLen`` clients sampled with probability
   proportional to score among those scoring at least ``cut_off_util`` x the score at rank
   ``exploitLen`` of the sorted scores; explore unexplored clients by registration reward inside
   a ``sample_window`` window; fill any shortfall uniformly at random.
6. Pacer, once per round: when the exploited utility of the last ``pacer_step`` rounds is flat,
   relax ``round_threshold`` by ``pacer_delta`` (admit slower clients); when it jumps, tighten it.

Where our setting forces a choice the docstrings say why. The cost of a selection is linear in
the candidate set, never in the population: the candidates' fields come from the ClientMap in one
gather (one cache line each) and are split once into explored and unexplored vectors; the
selector's own population-wide state (sorted durations, explored count, blacklist watch) is kept
in columns indexed by the same rows and brought up to date from the ClientMap's write log, so a
decision re-reads nothing that did not change; rankings use partitions
(``felix.strategies.selection.ranking``) rather than full sorts, and the weighted draws replay
numpy's ``choice`` without its per-call overhead (``felix.strategies.selection.sampling``).

One file of about 640 lines on purpose: it follows Oort's ``getTopK`` step by step, and reading the
six steps side by side with the reference is how it is checked; the pieces that stand alone
(ranking, sampling) are already modules of their own.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, NamedTuple

import numpy as np

from felix.core.client_map import ClientMap, ClientRecord, ClientRows, ClientView, LogMark
from felix.core.registry import params_from_dataclass
from felix.core.run_facts import RunFacts
from felix.core.selection import TRAIN_SELECTORS, SelectionContext, TrainSelector
from felix.strategies.selection.ranking import kth_largest, largest_first
from felix.strategies.selection.sampling import choice_by_weight

Variant = Literal["oort", "fedscale"]
Rounding = Literal["floor", "stochastic"]


@dataclass(frozen=True, slots=True)
class OortParams:
    """Oort's knobs; the defaults are the Oort repository's (``training/argParser.py``).

    ``variant`` picks between the two public implementations, which differ in three places:
    ``"oort"`` exploits ``int(K (1 - eps))`` clients, keeps only those at or above the cut-off,
    and sets epsilon to 0 for good once no unexplored client is left; ``"fedscale"`` exploits
    ``K - int(K eps)``, keeps sorting past the cut-off until it holds more than 10 x exploitLen
    clients, and takes ``abs`` of the score.

    ``rounding`` says how the fractional exploit count is rounded. ``"floor"`` is the code's
    ``int()``. ``"stochastic"`` rounds up with probability equal to the fraction (the expected
    split is then exactly ``(1 - eps) K`` for every K). It exists for async top-ups, which ask for
    one or two clients at a time: ``int(1 * (1 - 0.2)) = 0`` would never exploit at all there.
    """

    exploration_factor: float = 0.9
    exploration_decay: float = 0.95
    exploration_min: float = 0.2
    round_threshold: float = 10.0  # percentile of durations that sets the preferred duration T
    round_penalty: float = 2.0
    pacer_step: int = 20
    pacer_delta: float = 5.0
    clip_bound: float = 0.98
    cut_off_util: float = 0.7
    sample_window: float = 5.0
    blacklist_rounds: int | None = None  # Oort's -1: off
    blacklist_max_len: float = 0.3
    variant: Variant = "oort"
    rounding: Rounding = "floor"

    def __post_init__(self) -> None:
        for name in ("exploration_factor", "exploration_min", "blacklist_max_len"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], not {v}")
        if not 0.0 < self.exploration_decay <= 1.0:
            raise ValueError(f"exploration_decay must lie in (0, 1], not {self.exploration_decay}")
        if not 0.0 < self.round_threshold <= 100.0:
            raise ValueError(f"round_threshold is a percentile in (0, 100], not {self.round_threshold}")
        if self.round_penalty < 0:
            raise ValueError(f"round_penalty must be >= 0, not {self.round_penalty}")
        if self.pacer_step < 1:
            raise ValueError(f"pacer_step must be >= 1, not {self.pacer_step}")
        if self.pacer_delta <= 0:
            raise ValueError(f"pacer_delta must be > 0, not {self.pacer_delta}")
        if not 0.0 < self.clip_bound <= 1.0:
            raise ValueError(f"clip_bound is a quantile in (0, 1], not {self.clip_bound}")
        if not 0.0 <= self.cut_off_util <= 1.0:
            raise ValueError(f"cut_off_util must lie in [0, 1], not {self.cut_off_util}")
        if self.sample_window < 1.0:
            raise ValueError(f"sample_window must be >= 1 (window >= picks), not {self.sample_window}")
        if self.blacklist_rounds is not None and self.blacklist_rounds < 0:
            raise ValueError("blacklist_rounds must be >= 0, or None to disable the blacklist")
        if self.variant not in ("oort", "fedscale"):
            raise ValueError(f"variant must be 'oort' or 'fedscale', not {self.variant!r}")
        if self.rounding not in ("floor", "stochastic"):
            raise ValueError(f"rounding must be 'floor' or 'stochastic', not {self.rounding!r}")

    @classmethod
    def felix_authors(cls) -> OortParams:
        """The FeLiX authors' settings (``reference/felix-authors-setup.md``), for ``felix`` and ``oort*``.

        Exploration 0.9 decayed x0.98 per selection down to 0.2, round_threshold 30, pacer step 20
        and delta 5, penalty 2. Their fork departs from Oort's algorithm elsewhere (no reward
        normalisation, a cut-off taken on an ascending list so that it admits nearly every
        explored client, unexplored clients drawn uniformly); we keep Oort's algorithm and only
        take their numbers. ``rounding="stochastic"`` is ours: their async loop tops up one or
        two trainers at a time, where floor rounding would never exploit (see the class doc).
        """
        return cls(
            exploration_factor=0.9,
            exploration_decay=0.98,
            exploration_min=0.2,
            round_threshold=30.0,
            round_penalty=2.0,
            pacer_step=20,
            pacer_delta=5.0,
            rounding="stochastic",
        )

    @classmethod
    def fedscale(cls) -> OortParams:
        """FedScale's defaults (``fedscale/cloud/config_parser.py``); REFL ships this copy and defaults."""
        return cls(
            exploration_decay=0.98,
            exploration_min=0.3,
            round_threshold=30.0,
            clip_bound=0.9,
            cut_off_util=0.05,
            variant="fedscale",
        )


class NormStats(NamedTuple):
    max: float
    min: float
    range: float
    clip: float


def get_norm(values: np.ndarray, clip_bound: float, thres: float = 1e-4) -> NormStats:
    """Oort's ``get_norm``: clip value at the ``clip_bound`` quantile, ``min * 0.999``, range >= ``thres``.

    An empty list (no positive reward among the candidates) has no scale; Oort's code would
    raise there. We return a zero clip and minimum with range ``thres`` so that scores reduce to
    the staleness bonus, the only term still defined.
    """
    if values.size == 0:
        return NormStats(0.0, 0.0, thres, 0.0)
    values = np.asarray(values, dtype=np.float64)
    n = values.size
    ci = min(int(n * clip_bound), n - 1)
    vmax = float(values.max())
    vmin = float(values.min()) * 0.999
    clip = vmax if ci == n - 1 else kth_largest(values, n - 1 - ci)  # the order statistic, O(n)
    return NormStats(vmax, vmin, max(vmax - vmin, thres), clip)


def weighted_sample(weights: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of ``n`` draws without replacement, with probability proportional to ``weights``.

    Oort calls ``numpy.random.choice(..., p=score / sum, replace=False)``, which fails when fewer
    than ``n`` weights are positive (zero utilities, or negative Oort scores). Such entries carry
    no preference, so the positive ones are all taken and the rest is drawn uniformly.
    """
    m = weights.size
    if n <= 0:
        return np.empty(0, dtype=np.int64)
    if n >= m:
        return np.arange(m)
    w = np.where(np.isfinite(weights) & (weights > 0), weights, 0.0)
    pos = np.flatnonzero(w > 0)
    if pos.size >= n:
        wp = w.take(pos)
        return pos.take(choice_by_weight(wp / wp.sum(), n, rng))
    rest = np.flatnonzero(w <= 0)
    return np.concatenate([pos, rng.choice(rest, size=n - pos.size, replace=False)])


def _positive(values: np.ndarray) -> np.ndarray:
    """The positive entries of ``values``, in order (``values`` itself when all are)."""
    above = values > 0
    return values if above.all() else values.take(np.flatnonzero(above))


class _Group(NamedTuple):
    """The explored (or the unexplored) candidates: their positions in the candidate list, and
    their fields as contiguous vectors (each op on a column of the gathered rows would stride)."""

    idx: np.ndarray  # positions among the candidates, ascending
    reward: np.ndarray  # stat utility; the registration reward when unexplored
    last_round: np.ndarray  # last_utility_round (int64); empty for the unexplored (unused)
    duration: np.ndarray  # last training duration, nan when unknown


_DURATION, _EXPLORED = 0, 1  # the columns of OortSelector._seen
_NO_ROUNDS = np.empty(0, dtype=np.int64)
_RESORT = 256  # more changed durations than this at once: re-sort them all rather than insert each
_STATE_KEYS = (
    "exploration",
    "exploration_min",
    "round_threshold",
    "exploit_history",
    "exploit_pending",
    "exploit_replied",
    "seen_duration",
    "seen_explored",
    "watched",
)


class OortSelector(TrainSelector):
    """Oort's exploration / exploitation selector over the candidates the orchestrator passes.

    Reads the ClientMap's columns: ``stat_utility`` (NaN = unexplored), ``last_utility_round``
    (Oort's ``time_stamp``: the round its utility was last measured, by training or, under FeLiX,
    by an eval task, which is the FeLiX authors' ``last_eval`` nudge), ``last_duration`` and
    ``times_updated`` (Oort's ``count``, for the blacklist).

    ``reward_cap`` is ``local_steps * batch_size``. Oort registers each client with the reward
    ``min(num_samples, local_steps * batch_size)``: before it has trained, a client's utility can
    only be guessed from how many samples one task would touch, and the client-side utility is
    scaled by the same ``min(|D|, steps * batch)``, so registration rewards and measured
    utilities share a scale. ``None`` (epochs-based training, no step cap) uses ``num_samples``.

    The selector's own per-client state (the duration it folded into the sorted durations, whether
    it has seen the client explored, whether the blacklist watches it) is kept in columns indexed
    by the ClientMap's rows, so one selector serves one ClientMap.
    """

    name = "oort"

    def __init__(self, params: OortParams | None = None, reward_cap: int | None = None) -> None:
        if reward_cap is not None and reward_cap < 1:
            raise ValueError(f"reward_cap (local_steps * batch_size) must be >= 1, not {reward_cap}")
        self.params = params if params is not None else OortParams()
        self.reward_cap = reward_cap
        self._exploration = self.params.exploration_factor
        self._exploration_min = self.params.exploration_min
        self._round_threshold = self.params.round_threshold
        self._sorted_durations: list[float] = []
        self._rows = 0  # rows of the ClientMap covered by the columns below
        # per row, side by side (one gather): the duration in _sorted_durations (NaN: none), and
        # 1.0 once the client is counted in _n_explored
        self._seen = np.zeros((0, 2))
        self._n_explored = 0
        self._watched = np.zeros(0, dtype=bool)  # per row: a blacklist candidate (count at the threshold+)
        self._watch_rows: list[int] = []
        self._mark: LogMark | None = None  # how far the ClientMap's write log has been folded in
        self._exploit_pending: set[int] = set()  # client ids exploited, no reply yet
        self._exploit_replied: set[int] = set()  # client ids exploited and replied since the last round end
        self._exploit_history: list[float] = []

    # ------------------------------------------------------------------ state, for metrics and tests
    @property
    def exploration(self) -> float:
        return self._exploration

    @property
    def round_threshold(self) -> float:
        return self._round_threshold

    @property
    def exploit_history(self) -> tuple[float, ...]:
        return tuple(self._exploit_history)

    @property
    def preferred_duration(self) -> float:
        """Oort's ``round_prefer_duration``: the ``round_threshold``-th percentile of known durations.

        Oort sorts the durations of every registered client, estimated from device profiles at
        registration. A real server knows a duration only once the client has trained, so ``T``
        is taken over the clients with a measured duration, and is infinite (no penalty) before.
        """
        d = self._sorted_durations
        if self._round_threshold >= 100.0 or not d:
            return math.inf
        return d[min(int(len(d) * self._round_threshold / 100.0), len(d) - 1)]

    def registration_reward(self, record: ClientRecord | ClientView) -> float:
        n = record.num_samples
        return float(n if self.reward_cap is None else min(n, self.reward_cap))

    def _registration_rewards(self, num_samples: np.ndarray) -> np.ndarray:
        n = num_samples if self.reward_cap is None else np.minimum(num_samples, self.reward_cap)
        return n.astype(np.float64)

    # ------------------------------------------------------------------ policy hooks
    def on_update(self, record: ClientRecord | ClientView, ctx: SelectionContext) -> None:
        cid = record.client_id
        m = ctx.clients
        self._sync(m)
        r = m.row(cid)
        if cid in self._exploit_pending:
            self._exploit_pending.discard(cid)
            self._exploit_replied.add(cid)
        br = self.params.blacklist_rounds
        # times_updated is incremented after this call when the update is buffered, so a client
        # at the threshold may cross it now: watch it from there.
        if br is not None and record.times_updated >= br:
            self._watch(r)

    def on_round_end(self, round_: int, ctx: SelectionContext) -> None:
        """Oort's pacer, once per aggregation.

        The round's exploited utility is Oort's ``calculateSumUtil``: the mean current utility
        (``sum / (count + 1e-4)``) of the exploited clients that replied. In async mode a pick
        replies versions later, so picks stay pending until they reply and count in that round.
        The pacer fires on the number of rounds seen (``len(history)``), not on ``round_``, so a
        sync round that aggregated nothing cannot make it skip a step. The sum is ``math.fsum``
        (exact, so independent of the order the replies are kept in).
        """
        replied = self._exploit_replied
        util = ctx.clients.column("stat_utility")[ctx.clients.rows_of(sorted(replied))]
        total = math.fsum(np.nan_to_num(util, nan=0.0).tolist())
        self._exploit_history.append(total / (len(replied) + 1e-4))
        self._exploit_replied = set()
        step, hist = self.params.pacer_step, self._exploit_history
        if len(hist) >= 2 * step and len(hist) % step == 0:
            last = sum(hist[-2 * step : -step])
            cur = sum(hist[-step:])
            delta = self.params.pacer_delta
            if abs(cur - last) <= 0.1 * last:
                self._round_threshold = min(100.0, self._round_threshold + delta)
            elif abs(cur - last) >= 5 * last:
                self._round_threshold = max(delta, self._round_threshold - delta)

    # ------------------------------------------------------------------ scoring
    def score_candidates(
        self, candidates: Sequence[int] | np.ndarray, ctx: SelectionContext
    ) -> dict[int, float]:
        """Oort's exploitation score of each explored candidate (the unexplored have none)."""
        m = ctx.clients
        self._sync(m)
        rows = m.rows_of(candidates)
        explored, unexplored = self._groups(m.gather(rows))
        scores = self._scores(explored, unexplored, ctx)
        return {int(c): float(s) for c, s in zip(m.ids_of(rows.take(explored.idx)), scores, strict=True)}

    def _scores(self, explored: _Group, unexplored: _Group, ctx: SelectionContext) -> np.ndarray:
        """Oort's score of the explored candidates.

        The normalisation is taken over every candidate's positive reward, explored or not (its
        max, min and order statistic do not depend on the order the rewards come in).
        """
        p = self.params
        positive = [_positive(r) for r in (explored.reward, unexplored.reward)]
        norm = get_norm(np.concatenate(positive), p.clip_bound)
        # Oort's rounds start at 1; an async run starts at version 0, where ln(0) and x / 0 are
        # undefined: clamping both to 1 gives no bonus at the start, as Oort's first round does.
        cur = max(ctx.round, 1)
        bonus = np.sqrt(0.1 * math.log(cur) / np.maximum(explored.last_round, 1.0))
        sc = (np.minimum(explored.reward, norm.clip) - norm.min) / norm.range + bonus
        sc *= self._system_factor(explored.duration)
        return np.abs(sc) if p.variant == "fedscale" else sc

    def _system_factor(self, duration: np.ndarray) -> np.ndarray:
        """``(T / duration) ** round_penalty`` for clients slower than ``T``, else 1.

        An unknown duration (an explored client measured only by eval tasks) counts as fast,
        as in the FeLiX authors' fork: nothing says it is slow.
        """
        t_pref = self.preferred_duration
        if t_pref == math.inf:
            return np.ones(duration.size)
        # element by element as on the slow ones alone; NaN (unknown) compares False
        penalty = (t_pref / np.maximum(1e-4, duration)) ** self.params.round_penalty
        return np.where(duration > t_pref, penalty, 1.0)

    # ------------------------------------------------------------------ selection
    def select(self, candidates: Sequence[int] | np.ndarray, k: int, ctx: SelectionContext) -> list[int]:
        if k <= 0 or len(candidates) == 0:
            return []
        m = ctx.clients
        self._sync(m)
        rows, explored, unexplored = self._view(m, m.rows_of(candidates))
        p = self.params
        rng = ctx.rng

        self._exploration = max(self._exploration * p.exploration_decay, self._exploration_min)
        eps = self._exploration
        if p.variant == "oort":
            exploit_len = self._round(k * (1.0 - eps), rng)
        else:
            exploit_len = k - self._round(k * eps, rng)
        exploit_len = min(exploit_len, explored.idx.size)
        scores = self._scores(explored, unexplored, ctx) if exploit_len > 0 else np.empty(0)
        exploit = self._exploit(explored.idx, scores, exploit_len, rng)

        explore_len = min(unexplored.idx.size, k - exploit.size)
        explore = self._explore(unexplored, explore_len, rng)
        if p.variant == "oort" and len(m) <= self._n_explored:
            # Oort: with nobody left to explore, epsilon and its floor drop to 0 for good.
            self._exploration = self._exploration_min = 0.0

        picked = np.concatenate([exploit, explore])
        shortfall = min(k, rows.size) - picked.size
        if shortfall > 0:
            rest = np.setdiff1d(np.arange(rows.size), picked, assume_unique=True)
            picked = np.concatenate([picked, rng.choice(rest, size=shortfall, replace=False)])

        self._exploit_pending.update(m.ids_of(rows.take(exploit)).tolist())
        return m.ids_of(rows.take(picked)).tolist()

    def _exploit(self, idx: np.ndarray, scores: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
        """Sample ``n`` explored clients by score among those that pass the cut-off.

        The cut-off is ``cut_off_util`` x the score at 0-based rank ``n`` of the descending
        scores (Oort indexes ``sortedClientUtil[exploitLen]``, one past the exploitLen best),
        clamped to the last rank, where Oort's code would raise an IndexError. Only the pool
        that passes is ranked (ties by candidate order, as Oort's stable sort keeps them): the
        clients at or above the cut are exactly the head of the descending order.
        """
        if n <= 0:
            return np.empty(0, dtype=np.int64)
        cut = kth_largest(scores, min(n, scores.size - 1)) * self.params.cut_off_util
        passing = np.flatnonzero(scores >= cut)
        wanted = min(scores.size, 10 * n + 1) if self.params.variant == "fedscale" else 0
        if passing.size >= wanted:
            pool_idx = passing[np.argsort(-scores[passing], kind="stable")]
        else:
            pool_idx = largest_first(scores, wanted)
        return idx[pool_idx[weighted_sample(scores[pool_idx], n, rng)]]

    def _explore(self, unexplored: _Group, n: int, rng: np.random.Generator) -> np.ndarray:
        """Sample ``n`` unexplored clients by their (duration-penalised) registration reward,
        within the ``sample_window * n`` largest."""
        if n <= 0:
            return np.empty(0, dtype=np.int64)
        init = unexplored.reward * self._system_factor(unexplored.duration)
        window = largest_first(init, min(int(self.params.sample_window * n), init.size))
        return unexplored.idx[window[weighted_sample(init[window], n, rng)]]

    def _round(self, x: float, rng: np.random.Generator) -> int:
        if self.params.rounding == "floor":
            return int(x)
        base = math.floor(x)
        return base + int(rng.random() < x - base)

    # ------------------------------------------------------------------ bookkeeping
    def _view(self, m: ClientMap, rows: np.ndarray) -> tuple[np.ndarray, _Group, _Group]:
        """Gather the candidates' fields (one cache line each) and drop the blacklisted; returns
        the rows kept and their explored and unexplored groups (positions among those rows)."""
        g = m.gather(rows)
        blacklist = self._blacklist(m)
        if blacklist.size:
            keep = ~np.isin(rows, blacklist)
            rows, g = rows[keep], g.take(keep)
        return (rows, *self._groups(g))

    def _groups(self, g: ClientRows) -> tuple[_Group, _Group]:
        """Split gathered candidates into the explored and the unexplored (``stat_utility`` NaN)."""
        util = g.field("stat_utility")
        unexplored = np.isnan(util)
        e, u = np.flatnonzero(~unexplored), np.flatnonzero(unexplored)
        duration = g.field("last_duration")
        return (
            _Group(e, util[e], g.field("last_utility_round")[e], duration[e]),
            _Group(u, self._registration_rewards(g.field("num_samples")[u]), _NO_ROUNDS, duration[u]),
        )

    def _fit(self, m: ClientMap) -> None:
        """Extend the per-row columns to the map's population (geometrically)."""
        n = len(m)
        if n > self._seen.shape[0]:
            cap = max(n, 2 * self._seen.shape[0], 1024)
            seen = np.full((cap, 2), np.nan)
            seen[:, _EXPLORED] = 0.0
            seen[: self._seen.shape[0]] = self._seen
            self._seen = seen
            self._watched = np.concatenate([self._watched, np.zeros(cap - self._watched.size, bool)])
        self._rows = max(self._rows, n)

    def _sync(self, m: ClientMap) -> None:
        """Fold the clients whose result fields changed since the last look into the selector's
        population-wide state (durations, explored count, blacklist watch).

        The ClientMap's write log names them, so a decision costs nothing here when nothing was
        written, and fields written by someone else (a test, a registration with a history) are
        seen too. When the log cannot say (the first look, a restored map or selector, a burst of
        writes longer than the log), the whole map is read once, vectorised.
        """
        self._fit(m)
        rows = m.written_since(self._mark)
        self._mark = m.mark()
        if rows is None:
            n = len(m)
            self._observe(
                np.arange(n),
                m.column("stat_utility"),
                m.column("last_duration"),
                m.column("times_updated"),
            )
        elif rows.size:
            g = m.gather(np.fromiter(dict.fromkeys(rows.tolist()), dtype=np.int64))  # distinct rows
            self._observe(g.rows, g.field("stat_utility"), g.field("last_duration"), g.field("times_updated"))

    def _observe(self, rows: np.ndarray, util: np.ndarray, d: np.ndarray, times_updated: np.ndarray) -> None:
        """Fold the fields of distinct ``rows`` into the selector's state. Vectorised over the rows;
        a duration that changed costs a (log n) sorted-list update, many of them one re-sort."""
        seen = self._seen.take(rows, axis=0)
        new = rows.take(((seen[:, _EXPLORED] == 0.0) & ~np.isnan(util)).nonzero()[0])
        if new.size:
            self._seen[new, _EXPLORED] = 1.0
            self._n_explored += int(new.size)
        changed = ((d != seen[:, _DURATION]) & ~np.isnan(d)).nonzero()[0]
        if changed.size > _RESORT:
            self._seen[rows.take(changed), _DURATION] = d.take(changed)
            known = self._seen[: self._rows, _DURATION]
            self._sorted_durations = np.sort(known[~np.isnan(known)]).tolist()
        else:
            for r in changed:
                self._set_duration(int(rows[r]), float(d[r]))
        br = self.params.blacklist_rounds
        if br is not None:
            over = rows[times_updated > br]
            for r in over[~self._watched[over]]:
                self._watch(int(r))

    def _set_duration(self, row: int, d: float) -> None:
        old = float(self._seen[row, _DURATION])
        if old == d:
            return
        if not math.isnan(old):
            del self._sorted_durations[bisect.bisect_left(self._sorted_durations, old)]
        self._seen[row, _DURATION] = d
        bisect.insort(self._sorted_durations, d)

    def _watch(self, row: int) -> None:
        if not self._watched[row]:
            self._watched[row] = True
            self._watch_rows.append(row)

    def _blacklist(self, m: ClientMap) -> np.ndarray:
        """Oort's ``get_blacklist``: rows of the most-updated clients above ``blacklist_rounds``, at
        most ``blacklist_max_len`` of the population (Oort slices with a float there, which Python 3
        rejects; we truncate to an int). Only watched clients are examined, not the population."""
        br = self.params.blacklist_rounds
        if br is None or not self._watch_rows:
            return np.empty(0, dtype=np.int64)
        watched = np.asarray(self._watch_rows, dtype=np.int64)
        count = m.column("times_updated")[watched]
        over = count > br
        watched, count = watched[over], count[over]
        order = np.lexsort((m.ids[watched], -count))  # most updated first, then by client id
        return watched[order[: int(self.params.blacklist_max_len * len(m))]]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The selector's mutable state: floats, and arrays of one entry per registered client at most."""
        n = self._rows
        return {
            "exploration": float(self._exploration),
            "exploration_min": float(self._exploration_min),
            "round_threshold": float(self._round_threshold),
            "exploit_history": np.asarray(self._exploit_history, dtype=np.float64),
            "exploit_pending": np.asarray(sorted(self._exploit_pending), dtype=np.int64),
            "exploit_replied": np.asarray(sorted(self._exploit_replied), dtype=np.int64),
            "seen_duration": self._seen[:n, _DURATION].copy(),
            "seen_explored": self._seen[:n, _EXPLORED] != 0.0,
            "watched": self._watched[:n].copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output (ValueError on a malformed state; this selector is unchanged then)."""
        if not isinstance(state, dict) or set(state) != set(_STATE_KEYS):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"Oort state must hold exactly {sorted(_STATE_KEYS)}, got {got}")
        floats = {}
        for key in ("exploration", "exploration_min", "round_threshold"):
            try:
                floats[key] = float(state[key])
            except (TypeError, ValueError):
                raise ValueError(f"Oort state: {key} must be a number, not {state[key]!r}") from None
            if not math.isfinite(floats[key]) or floats[key] < 0:
                raise ValueError(f"Oort state: {key} must be finite and >= 0, not {floats[key]}")
        arrays = {k: np.asarray(state[k]) for k in _STATE_KEYS[3:]}
        for key, a in arrays.items():
            if a.ndim != 1:
                raise ValueError(f"Oort state: {key} must be a vector, got shape {a.shape}")
        n = arrays["seen_duration"].size
        if arrays["seen_explored"].size != n or arrays["watched"].size != n:
            raise ValueError(
                "Oort state: seen_duration, seen_explored and watched must have one entry per client"
            )
        seen = arrays["seen_duration"].astype(np.float64)
        known = seen[~np.isnan(seen)]
        if not np.isfinite(known).all():
            raise ValueError("Oort state: seen_duration holds infinite values")
        history = arrays["exploit_history"].astype(np.float64)
        if not np.isfinite(history).all():
            raise ValueError("Oort state: exploit_history holds non-finite values")
        self._exploration, self._exploration_min = floats["exploration"], floats["exploration_min"]
        self._round_threshold = floats["round_threshold"]
        self._exploit_history = history.tolist()
        self._exploit_pending = {int(c) for c in arrays["exploit_pending"]}
        self._exploit_replied = {int(c) for c in arrays["exploit_replied"]}
        self._rows = n
        self._seen = np.stack([seen, arrays["seen_explored"].astype(bool).astype(np.float64)], axis=1)
        self._watched = arrays["watched"].astype(bool)
        self._n_explored = int(self._seen[:, _EXPLORED].sum())
        self._sorted_durations = sorted(known.tolist())
        self._watch_rows = np.flatnonzero(self._watched).tolist()
        self._mark = None  # the restored state is folded together with the map's at the next look


OORT_BASES = {"oort": OortParams, "felix_authors": OortParams.felix_authors, "fedscale": OortParams.fedscale}
#: ``selector.params`` of ``oort``: ``base`` picks Oort's own defaults, the FeLiX authors' numbers or
#: FedScale's; the ``OortParams`` fields given override it; ``reward_cap`` defaults to the clients'
#: ``max_steps x batch_size`` when they have a step bound.
OortSelectorParams = params_from_dataclass(
    OortParams,
    "OortSelectorParams",
    base=(Literal["oort", "felix_authors", "fedscale"], "felix_authors"),
    reward_cap=(int | None, None),
)


def oort_params(params: Any) -> OortParams:
    """The ``OortParams`` of validated ``OortSelectorParams``: the base's, with the keys given replaced."""
    given = params.model_dump(exclude_unset=True)
    given.pop("reward_cap", None)
    return replace(OORT_BASES[given.pop("base", params.base)](), **given)


@TRAIN_SELECTORS.register("oort", params=OortSelectorParams, reads_reports=True)  # statistical utility
def make_oort(params: Any, ctx: RunFacts | None) -> OortSelector:
    reward_cap = params.reward_cap
    if reward_cap is None and ctx is not None and ctx.max_steps is not None:
        reward_cap = ctx.max_steps * ctx.batch_size
    return OortSelector(oort_params(params), reward_cap=reward_cap)
