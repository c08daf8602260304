"""Per-client admission control: what one client can make the server send, whatever it reports.

Every tier report the server acts on can cost a model download: a client that reports AVL_TRAIN
is picked and sent the model, one that leaves again frees its slot (TierTrack), and the next
version may pick it again (``Orchestrator``'s rejoin rule keeps it out only for the rest of the
version). A logged-in client flipping its tier as fast as it can publish therefore made the
server send it training and eval tasks and their cancels at the aggregation rate: 200 flips
(32 KB up) brought 1.4 MB down, and 5,000 flips per second were all acted on. Two rules bound
that, in the sans-I/O core so that the simulator and the MQTT server share them:

- **Flap damping.** A client whose reported tier changes more than ``flap_limit`` times within
  ``flap_window_s`` is treated as unavailable (its acting tier becomes UN_AVL, which frees the
  slot of its task under TierTrack, and it is not selected) until it has reported no change for
  ``flap_hold_s``; then its last reported tier applies. The defaults are far above the real
  traces: the busiest MobiPerf device (any series, three days) changes tier at most 24 times in
  a minute, and the simulated runs of the shipped scenarios saw at most 2 (``docs/deployment.md``,
  "Admission control").
- **A task budget.** Each task (training or eval) and each cancel sent to a client spends one
  token of its bucket, which holds at most ``task_burst`` and refills at ``task_rate`` per second;
  a client with less than one token is not selected until it has one again. A cancel is never
  withheld (it closes a task the server already gave up), so it may leave the bucket below zero.
  Each task is cancelled at most once, so over any interval of T seconds a client is sent at most
  ``task_burst + task_rate * T`` tasks and at most as many cancels plus one per task it held at
  the interval's start. Honest clients of the shipped scenarios received at most 2 tasks and
  cancels in a second, 6 in 10 s, 31 in 60 s and 151 in 300 s (MobiPerf 3_50, ``felix``; probes
  go to every AVL_EVAL client each version): the defaults (30 and 2/s) leave them 4x room.

- **A drop budget.** The task budget alone let a client that flips its tier slowly (under the
  flap limit) take a model download per flip, each task freed again by the flip away: 200 flips
  at 26 a minute brought 43x the bytes down that they sent up. Each task a client leaves, lets
  time out or reports failed spends one token of a second bucket (``drop_burst``, refilled at
  ``drop_rate``); a client with less than one token is not selected until it has one. So over
  any interval of T seconds a client takes at most ``drop_burst + drop_rate * T`` downloads it
  does not answer, whatever the spacing of its flips, while a client that answers its tasks never
  spends a token. It is off by default, so simulated results stay those of the published
  methods (honest churn does drop tasks); ``felix serve`` turns it on with ``DEPLOY_DROP_RATE``
  unless the config sets ``drop_rate``.

A shell may hold a client out of selection by a rule of its own (``hold``; the MQTT server's
per-login download budget, ``felix.deploy.download_budget``, counted in bytes and wall seconds,
which the core does not see); a held client is excluded like a damped one until released.

Time is the events' time (config seconds); nothing here reads a clock. The state is per client
that ever changed tier or got a task, bounded by the population, plus the change times within one
window per client.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import Field

from felix.core.settings import Settings

#: ``felix serve``'s drop budget refill when the config leaves ``drop_rate`` unset: one dropped
#: task per 10 minutes beyond the burst of 2.
DEPLOY_DROP_RATE = 1.0 / 600.0
_TABLE_IDS = 1 << 22  # ``Admission.allowed`` looks ids below this up in a table (at most 4 MB)


class AdmissionConfig(Settings):
    """The two per-client rules (the config's ``orchestrator.admission`` section); ``None`` turns
    one off. The defaults are far above what honest clients of the shipped scenarios and the
    MobiPerf trace do (the module docstring has the measurements)."""

    flap_limit: int | None = Field(
        100,
        ge=1,
        description="a client whose reported tier changes more than this many times within "
        "flap_window_s is treated as unavailable (null: never)",
    )
    flap_window_s: float = Field(60.0, gt=0)
    flap_hold_s: float = Field(
        600.0, gt=0, description="a damped client is available again after this long without a tier change"
    )
    task_rate: float | None = Field(
        2.0, gt=0, description="tasks and cancels per second a client's budget refills (null: no budget)"
    )
    task_burst: float = Field(30.0, ge=1, description="the task budget's capacity (and a new client's)")
    drop_rate: float | None = Field(
        None,
        gt=0,
        description="tasks per second a client may leave, let time out or fail beyond drop_burst "
        "before it is not selected until it has a token again (null: no drop budget; "
        "felix serve uses 1/600 unless this is set)",
    )
    drop_burst: float = Field(2.0, ge=1, description="the drop budget's capacity")


class TokenBuckets:
    """One token bucket per key: ``burst`` tokens at most (a new key starts full), refilled at
    ``rate`` per second of the caller's clock. The task budget here and the MQTT server's
    per-client message limit (``felix.deploy.server``) are both made of these."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self.levels: dict[int, tuple[float, float]] = {}  # key -> (tokens, when counted)

    def spend(self, key: int, now: float, amount: float = 1.0) -> float:
        """Spend ``amount`` tokens of ``key``'s bucket at ``now``, even if that leaves it below zero
        (a debt the refill pays first); return what is left."""
        tokens, at = self.levels.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + max(0.0, now - at) * self.rate) - amount
        self.levels[key] = (tokens, now)
        return tokens

    def take(self, key: int, now: float, amount: float = 1.0) -> bool:
        """Spend ``amount`` tokens if ``key`` has them at ``now``; False (nothing spent) if not.
        ``amount`` 0: whether the bucket is out of debt."""
        tokens, at = self.levels.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + max(0.0, now - at) * self.rate)
        if tokens < amount or tokens < 0.0:
            self.levels[key] = (tokens, now)
            return False
        self.levels[key] = (tokens - amount, now)
        return True

    def ready_at(self, tokens: float, now: float) -> float:
        """When a bucket holding ``tokens`` at ``now`` holds one token again."""
        return now + max(0.0, 1.0 - tokens) / self.rate


@dataclass(slots=True)
class AdmissionStats:
    damped: int = 0  # times a client started flapping (was made unavailable)
    throttled: int = 0  # times a client's task budget ran out
    drops_throttled: int = 0  # times a client's drop budget ran out
    tier_changes: int = 0  # reported tier changes seen (repeats of the same tier not counted)


class Admission:
    """The state of both rules. The orchestrator asks ``excluded_ids`` before selecting, calls
    ``tier_changed`` on each reported change and ``charge`` for each task or cancel it emits, and
    takes ``due`` at every event: the damped clients whose hold ended (to restore their tier)."""

    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config if config is not None else AdmissionConfig()
        self.stats = AdmissionStats()
        self._changes: dict[int, deque[float]] = {}  # client -> its change times within the window
        self._damped: dict[int, float] = {}  # client -> its last change (the hold runs from it)
        rate = self.config.task_rate
        self._budget = None if rate is None else TokenBuckets(rate, self.config.task_burst)
        drop = self.config.drop_rate
        self._drops = None if drop is None else TokenBuckets(drop, self.config.drop_burst)
        self._throttled: dict[int, float] = {}  # client -> when it has one token again
        self._held: set[int] = set()  # clients a shell holds out of selection (not checkpointed)
        self._wakeups: list[tuple[float, int]] = []  # candidate release times (lazy: checked when due)
        self._excluded: np.ndarray | None = np.empty(0, dtype=np.int64)  # None: to rebuild
        self._table: np.ndarray | None = None  # allowed[id + 1] (``allowed``); None: to rebuild

    # ------------------------------------------------------------------ queries
    @property
    def any_excluded(self) -> bool:
        """Whether some client is damped or out of budget (the usual answer, no, costs nothing)."""
        return bool(self._damped or self._throttled or self._held)

    def excluded_ids(self) -> np.ndarray:
        """The clients that may not be given a task now (damped or out of budget), sorted."""
        if self._excluded is None:
            ids = set(self._damped) | set(self._throttled) | self._held
            self._excluded = np.array(sorted(ids), dtype=np.int64)
            self._table = None
        return self._excluded

    def allowed(self, client_ids: np.ndarray) -> np.ndarray:
        """A mask over ``client_ids``: True where the client may be given a task. One lookup in a
        table of the excluded ids (``np.isin`` costs ten times that on the few hundred candidates
        of a dispatch, which runs on every tier message while a slot is free); ``np.isin`` only
        when an excluded id lies outside the table's range."""
        excluded = self.excluded_ids()  # after a change it is rebuilt, and the table dropped
        if self._table is None:
            if excluded.size and (excluded[0] < 0 or excluded[-1] >= _TABLE_IDS):
                return ~np.isin(client_ids, excluded)
            # Index id + 1; the ends stay True, so ``clip`` maps every id outside the range to allowed.
            self._table = np.ones(int(excluded[-1]) + 3 if excluded.size else 2, dtype=bool)
            self._table[excluded + 1] = False
        return self._table.take(client_ids + 1, mode="clip")

    def hold(self, client_id: int, held: bool) -> None:
        """A shell's own rule holds ``client_id`` out of selection (``held``) or releases it."""
        if held != (client_id in self._held):
            if held:
                self._held.add(client_id)
            else:
                self._held.discard(client_id)
            self._excluded = None

    def is_damped(self, client_id: int) -> bool:
        return client_id in self._damped

    def next_wakeup(self) -> float | None:
        """When a damped or throttled client may next be released (a ``Tick`` is due then)."""
        return self._wakeups[0][0] if self._wakeups else None

    # ------------------------------------------------------------------ events
    def tier_changed(self, client_id: int, now: float) -> bool:
        """Record a change of ``client_id``'s reported tier at ``now``; True if the client is
        damped after it (it flapped now, or earlier and is still held)."""
        self.stats.tier_changes += 1
        c = self.config
        if client_id in self._damped:
            self._damped[client_id] = now  # the hold restarts: it must be stable for flap_hold_s
            heapq.heappush(self._wakeups, (now + c.flap_hold_s, client_id))
            return True
        if c.flap_limit is None:
            return False
        times = self._changes.get(client_id)
        if times is None:
            times = self._changes[client_id] = deque()
        times.append(now)
        while times and times[0] <= now - c.flap_window_s:
            times.popleft()
        if len(times) <= c.flap_limit:
            return False
        del self._changes[client_id]
        self._damped[client_id] = now
        self._excluded = None
        self.stats.damped += 1
        heapq.heappush(self._wakeups, (now + c.flap_hold_s, client_id))
        return True

    def charge(self, client_id: int, now: float) -> None:
        """A task or a cancel is sent to ``client_id`` at ``now``: it spends one token."""
        if self._budget is not None and self._spend(self._budget, client_id, now):
            self.stats.throttled += 1

    def dropped(self, client_id: int, now: float) -> None:
        """``client_id`` left a task, let it time out or reported it failed: one drop token."""
        if self._drops is not None and self._spend(self._drops, client_id, now):
            self.stats.drops_throttled += 1

    def _spend(self, bucket: TokenBuckets, client_id: int, now: float) -> bool:
        """Spend a token of ``bucket``; a client left with less than one waits until it has one
        (the later of its waits, if another budget holds it too). True if it starts waiting now."""
        tokens = bucket.spend(client_id, now)
        if tokens >= 1.0:
            return False
        ready = bucket.ready_at(tokens, now)
        prior = self._throttled.get(client_id)
        self._throttled[client_id] = ready if prior is None else max(prior, ready)
        heapq.heappush(self._wakeups, (ready, client_id))
        if prior is None:
            self._excluded = None
        return prior is None

    def due(self, now: float) -> list[int]:
        """Release the clients whose hold or budget wait has passed by ``now``; return the damped
        ones released (their reported tier applies again)."""
        released: list[int] = []
        while self._wakeups and self._wakeups[0][0] <= now:
            _, cid = heapq.heappop(self._wakeups)
            ready = self._throttled.get(cid)
            if ready is not None and ready <= now:
                del self._throttled[cid]
                self._excluded = None
            last = self._damped.get(cid)
            if last is not None and last + self.config.flap_hold_s <= now:
                del self._damped[cid]
                self._excluded = None
                released.append(cid)
        return released

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        changes = [(c, t) for c, ts in self._changes.items() for t in ts]
        levels = {} if self._budget is None else self._budget.levels
        drops = {} if self._drops is None else self._drops.levels
        return {
            "change_client": np.array([c for c, _ in changes], dtype=np.int64),
            "change_time": np.array([t for _, t in changes], dtype=np.float64),
            "damped_client": np.fromiter(self._damped.keys(), dtype=np.int64, count=len(self._damped)),
            "damped_since": np.fromiter(self._damped.values(), dtype=np.float64, count=len(self._damped)),
            "token_client": np.fromiter(levels.keys(), dtype=np.int64, count=len(levels)),
            "tokens": np.array([v for v, _ in levels.values()], dtype=np.float64),
            "token_time": np.array([t for _, t in levels.values()], dtype=np.float64),
            "throttled_client": np.fromiter(
                self._throttled.keys(), dtype=np.int64, count=len(self._throttled)
            ),
            "throttled_until": np.fromiter(
                self._throttled.values(), dtype=np.float64, count=len(self._throttled)
            ),
            "drop_client": np.fromiter(drops.keys(), dtype=np.int64, count=len(drops)),
            "drops": np.array([v for v, _ in drops.values()], dtype=np.float64),
            "drop_time": np.array([t for _, t in drops.values()], dtype=np.float64),
            "stats": [
                self.stats.damped,
                self.stats.throttled,
                self.stats.tier_changes,
                self.stats.drops_throttled,
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        def pairs(a: str, b: str) -> list[tuple[Any, Any]]:
            return list(zip(np.asarray(state[a]).tolist(), np.asarray(state[b]).tolist(), strict=True))

        self._changes = {}
        for c, t in pairs("change_client", "change_time"):
            self._changes.setdefault(int(c), deque()).append(float(t))
        self._damped = {int(c): float(t) for c, t in pairs("damped_client", "damped_since")}
        for bucket, keys in (
            (self._budget, ("token_client", "tokens", "token_time")),
            (self._drops, ("drop_client", "drops", "drop_time")),
        ):
            if bucket is not None and keys[0] in state:  # (checkpoints before the drop budget lack it)
                bucket.levels = {
                    int(c): (float(v), float(t))
                    for c, v, t in zip(*(np.asarray(state[k]).tolist() for k in keys), strict=True)
                }
        self._throttled = {int(c): float(t) for c, t in pairs("throttled_client", "throttled_until")}
        hold = self.config.flap_hold_s
        self._wakeups = [(t + hold, c) for c, t in self._damped.items()]
        self._wakeups += [(t, c) for c, t in self._throttled.items()]
        heapq.heapify(self._wakeups)
        self._excluded = None
        counts = [int(v) for v in state["stats"]] + [0]  # (the drop count is newer)
        self.stats = AdmissionStats(
            damped=counts[0], throttled=counts[1], tier_changes=counts[2], drops_throttled=counts[3]
        )
