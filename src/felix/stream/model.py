"""The stream model: every client's arrivals, classes, pool samples, label delays and proxy
labels, generated lazily and seeded, sans-I/O (a time in, the client's samples out).

A client's stream is generated in fixed blocks from the stream's start (``-warmup_s``), each
block from the client's own generator, in order; a block is ``BLOCK_S`` seconds, or as many hours
as it takes to expect ``BLOCK_ARRIVALS`` samples at the client's highest rate (a slow client's
week is a few blocks, not 168). A block is drawn whole
(a Poisson count at the highest rate, uniform times, thinned to the rate at each time), so the
samples do not depend on when, or how often, the client is asked: the simulator (which asks at
each task start, a strategy's choice) and the MQTT client (which asks in wall-clock time) see
the same stream for the same seed, and so does every strategy of a comparison."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from felix.config import StreamCfg
from felix.stream.drift import GlobalMix, Shift
from felix.stream.labels import draw_delays
from felix.stream.store import LocalStore, Snapshot

BLOCK_S = 3600.0
BLOCK_ARRIVALS = 16
MAX_BLOCK_S = 7 * 86400.0
DAY_S = 86400.0
_STREAM = 5  # the stream's id under the run seed (felix.scenario.build's streams are 0-4)

TierAt = Callable[[int, float], bool]
"""Whether client ``cid`` is in the AVL_TRAIN tier at a run time (``arrivals.kind: availability``)."""


@dataclass
class StreamStats:
    arrivals: int = 0
    dropped: int = 0


class ClientStream:
    """One client's samples over time: generated block by block, moved into its store as the time
    they arrive is reached."""

    def __init__(self, model: StreamModel, cid: int) -> None:
        self.model = model
        self.cid = cid
        self.rng = np.random.default_rng(np.random.SeedSequence([model.seed, _STREAM, 1, cid]))
        self.rate_s = float(model.rates[cid]) / 3600.0
        a = model.cfg.arrivals
        self.peak_s = self.rate_s * (1.0 + a.diurnal_amplitude if a.kind == "diurnal" else 1.0)
        hours = math.ceil(BLOCK_ARRIVALS / (self.peak_s * 3600.0)) if self.peak_s > 0 else math.inf
        self.block_s = min(BLOCK_S * max(1, hours), MAX_BLOCK_S)
        self.generated_to = -model.cfg.arrivals.warmup_s
        self.store = LocalStore(model.cfg.store.cap)
        self.now = -np.inf
        self._pending: dict[str, np.ndarray] | None = None
        d = model.cfg.drift
        self.pref = (
            self.rng.dirichlet(np.full(model.num_classes, d.personal_alpha)) if d.personal_weight else None
        )
        self.arrivals = 0

    def advance(self, now: float) -> None:
        """Every sample that arrived by ``now`` is in the store. Time only moves forward."""
        if now <= self.now:
            return
        self.now = now
        while self.generated_to < now:
            self._block(self.generated_to, self.generated_to + self.block_s)
        p = self._pending
        if p is not None:
            k = int(np.searchsorted(p["arrival"], now, side="right"))
            if k:
                self.store.push(*(p[f][:k] for f in ("arrival", "label_time", "index", "label", "proxy")))
                self.arrivals += k
                self._pending = {f: v[k:] for f, v in p.items()} if k < len(p["arrival"]) else None

    def snapshot(self, now: float) -> Snapshot:
        """What a task starting at ``now`` trains on (``stream.store``'s windows, proxy labels)."""
        self.advance(now)
        s = self.model.cfg.store
        return self.store.snapshot(
            now, self.model.cfg.labels.proxy_error is not None, s.window_s, s.window_count
        )

    def _block(self, t0: float, t1: float) -> None:
        m, rng = self.model, self.rng
        a = m.cfg.arrivals
        n = int(rng.poisson(self.peak_s * (t1 - t0)))
        times = np.sort(rng.uniform(t0, t1, n))
        if a.kind == "diurnal":
            u = rng.random(n)
            phase = 2.0 * np.pi * (times / 3600.0 - a.peak_hour) / 24.0
            times = times[u < (1.0 + a.diurnal_amplitude * np.cos(phase)) / (1.0 + a.diurnal_amplitude)]
        elif a.kind == "availability":
            assert m.tier_at is not None
            want = a.tied_to == "available"
            times = times[
                np.array([m.tier_at(self.cid, max(float(t), 0.0)) == want for t in times], dtype=bool)
            ]
        n = len(times)
        d = m.cfg.drift
        prefs: list[np.ndarray] | None = None
        changes = np.zeros(0)
        if self.pref is not None:  # the client's interest changes whether or not samples arrive
            changes = np.sort(
                rng.uniform(t0, t1, int(rng.poisson(d.personal_shifts_per_day * (t1 - t0) / DAY_S)))
            )
            prefs = [self.pref, *(rng.dirichlet(np.full(m.num_classes, d.personal_alpha)) for _ in changes)]
            self.pref = prefs[-1]
        self.generated_to = t1
        if n == 0:
            return
        mix = m.mix.at(times)
        if prefs is not None:
            mix = (1.0 - d.personal_weight) * mix + d.personal_weight * np.asarray(prefs)[
                np.searchsorted(changes, times, side="right")
            ]
        cum = np.cumsum(mix, axis=1)
        classes = np.minimum((cum < rng.random(n)[:, None] * cum[:, -1:]).sum(axis=1), m.num_classes - 1)
        index = m.pool_order[
            m.class_start[classes] + (rng.random(n) * m.class_count[classes]).astype(np.int64)
        ]
        label_time = times + draw_delays(m.cfg.labels, rng, n)
        proxy = classes
        if m.cfg.labels.proxy_error is not None:
            wrong = rng.random(n) < m.cfg.labels.proxy_error
            proxy = np.where(wrong, (classes + rng.integers(1, m.num_classes, n)) % m.num_classes, classes)
        new = {"arrival": times, "label_time": label_time, "index": index, "label": classes, "proxy": proxy}
        if self._pending is not None:
            new = {f: np.concatenate([self._pending[f], v]) for f, v in new.items()}
        self._pending = new


class StreamModel:
    """All clients' streams of one run (``cfg``: the ``stream`` section), over a training pool with
    labels ``pool_labels``. Clients' streams are made on first use."""

    def __init__(
        self,
        cfg: StreamCfg,
        pool_labels: np.ndarray,
        num_classes: int,
        num_clients: int,
        seed: int,
        tier_at: TierAt | None = None,
    ) -> None:
        self._needs_trace = cfg.arrivals.kind == "availability" and tier_at is None
        self.cfg = cfg
        self.seed = seed
        self.num_classes = num_classes
        self.num_clients = num_clients
        self.tier_at = tier_at
        labels = np.asarray(pool_labels, dtype=np.int64)
        self.pool_order = np.argsort(labels, kind="stable")
        self.class_count = np.bincount(labels, minlength=num_classes)
        self.class_start = np.concatenate([[0], np.cumsum(self.class_count)[:-1]])
        rng = np.random.default_rng(np.random.SeedSequence([seed, _STREAM, 0]))
        self.mix = GlobalMix(cfg.drift, num_classes, rng, self.class_count > 0)
        a = cfg.arrivals
        spread = rng.standard_normal(num_clients) * a.rate_spread
        # Lognormal around the configured mean: exp(s z - s^2 / 2) has mean 1.
        self.rates = a.rate_per_hour * np.exp(spread - a.rate_spread**2 / 2.0)
        self._clients: dict[int, ClientStream] = {}

    def client(self, cid: int) -> ClientStream:
        if self._needs_trace:
            raise ValueError("stream.arrivals.kind 'availability' needs the clients' availability trace")
        s = self._clients.get(cid)
        if s is None:
            s = self._clients[cid] = ClientStream(self, cid)
        return s

    @property
    def clients_started(self) -> int:
        """Clients whose stream has been asked for so far."""
        return len(self._clients)

    def population_mix(self, t: float) -> np.ndarray:
        """The class mix of the data arriving at ``t`` over the population: the global mix, with
        the personal share at its expectation (a symmetric Dirichlet's mean, every class alike)."""
        w = self.cfg.drift.personal_weight
        present = (self.class_count > 0).astype(np.float64)
        return (1.0 - w) * self.mix.at(float(t)) + w * present / present.sum()

    def shifts(self) -> list[Shift]:
        return self.mix.shifts()

    def registration(self, cid: int) -> tuple[int, tuple[int, ...]]:
        """What client ``cid`` registers: the most samples it can train on (the store cap, or the
        count window) and that count split by the population's mix at time 0 (largest remainders),
        so the server's bound on a result's sample count holds for any task."""
        s = self.cfg.store
        n = s.cap if s.window_count is None else min(s.cap, s.window_count)
        share = self.population_mix(0.0) * n
        counts = np.floor(share).astype(np.int64)
        rest = n - int(counts.sum())
        counts[np.argsort(-(share - counts), kind="stable")[:rest]] += 1
        return n, tuple(int(c) for c in counts)

    def stats(self) -> StreamStats:
        return StreamStats(
            sum(c.arrivals for c in self._clients.values()),
            sum(c.store.dropped for c in self._clients.values()),
        )

    def held_bytes(self) -> int:
        """Bytes of sample records held: the stores and the generated blocks not yet arrived."""
        total = 0
        for c in self._clients.values():
            total += c.store.nbytes
            if c._pending is not None:
                total += sum(v.nbytes for v in c._pending.values())
        return total
