"""The Random Access Model (RAM) of FedeRage: who participates is decided outside the algorithm.

Each round an external, independent process draws the participating set ``S_t``: client ``i``
joins with its own probability ``p_i``, independently of the others and of past rounds. The
``p_i`` are never shown to the learning algorithm (only the IPS oracle baseline reads them).

The generators build the setting the paper targets: a few frequent and many rare clients, with
the rare ones holding the globally rare classes, so that data and availability heterogeneity are
coupled. ``participation_to_events`` turns a round-based draw into the per-device availability
event list the trace-driven simulator reads, one slot of ``slot_s`` seconds per round, and
``participation_trace`` into the ``AvailabilityTrace`` of ``trace.kind: ram``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from felix.core.types import Tier
from felix.scenario.traces import TRACES, AvailabilityTrace, DeviceTrace

if TYPE_CHECKING:
    from felix.config import TraceCfg


@dataclass(frozen=True)
class RandomAccessModel:
    """Independent Bernoulli participation: client ``i`` joins each round with ``probabilities[i]``."""

    probabilities: np.ndarray

    def __post_init__(self) -> None:
        p = np.array(self.probabilities, dtype=np.float64, copy=True)
        if p.ndim != 1 or p.size == 0:
            raise ValueError(f"RAM probabilities must be a non-empty 1-D array, got shape {p.shape}")
        if not np.isfinite(p).all() or (p < 0).any() or (p > 1).any():
            raise ValueError("RAM probabilities must be finite and lie in [0, 1]")
        p.flags.writeable = False
        object.__setattr__(self, "probabilities", p)

    @property
    def num_clients(self) -> int:
        return int(self.probabilities.shape[0])

    def draw(self, round_rng: np.random.Generator) -> np.ndarray:
        """One round's participation mask (bool, one entry per client); it may be empty."""
        return round_rng.random(self.num_clients) < self.probabilities

    def draw_rounds(self, rounds: int, rng: np.random.Generator) -> np.ndarray:
        """``rounds`` successive draws as a (rounds, clients) bool matrix."""
        if rounds < 0:
            raise ValueError(f"rounds must be >= 0, not {rounds}")
        return (
            np.stack([self.draw(rng) for _ in range(rounds)])
            if rounds
            else np.zeros((0, self.num_clients), bool)
        )


def two_level_probabilities(
    num_clients: int,
    rng: np.random.Generator,
    frequent_fraction: float = 0.2,
    p_frequent: float = 0.5,
    p_rare: float = 0.05,
) -> np.ndarray:
    """A few frequent and many rare clients: ``round(frequent_fraction * N)`` clients, at random
    positions, join with ``p_frequent``; the rest with ``p_rare``.

    The defaults (20% at 0.5, 80% at 0.05) give 14 expected participants per 100 clients, of
    whom 10 are frequent: a rare client is 10x less likely to be heard than a frequent one.
    """
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, not {num_clients}")
    if not (0.0 <= frequent_fraction <= 1.0):
        raise ValueError(f"frequent_fraction must lie in [0, 1], not {frequent_fraction}")
    if not (0.0 < p_rare <= p_frequent <= 1.0):
        raise ValueError(f"need 0 < p_rare <= p_frequent <= 1, got p_rare={p_rare}, p_frequent={p_frequent}")
    p = np.full(num_clients, p_rare, dtype=np.float64)
    n_freq = round(frequent_fraction * num_clients)
    p[rng.permutation(num_clients)[:n_freq]] = p_frequent
    return p


def beta_probabilities(
    num_clients: int,
    rng: np.random.Generator,
    a: float = 0.5,
    b: float = 3.0,
    p_min: float = 0.02,
    p_max: float = 0.9,
) -> np.ndarray:
    """A continuum of availability: ``p_i ~ Beta(a, b)`` clipped to ``[p_min, p_max]``.

    With ``a < 1 < b`` (defaults 0.5 and 3: mean 0.14, median about 0.07) most clients are rare
    and a long right tail is frequent. The clip keeps every client reachable (``p_min > 0``, so
    inverse-probability weights stay finite) and none certain.
    """
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, not {num_clients}")
    if not (a > 0 and b > 0):
        raise ValueError(f"Beta shape parameters must be > 0, got a={a}, b={b}")
    if not (0.0 < p_min <= p_max <= 1.0):
        raise ValueError(f"need 0 < p_min <= p_max <= 1, got [{p_min}, {p_max}]")
    return np.clip(rng.beta(a, b, size=num_clients), p_min, p_max)


def rarity_scores(class_counts: np.ndarray) -> np.ndarray:
    """How rare a client's data is globally: the mean surprisal ``-log pi_c`` of its samples.

    ``pi`` is the global label distribution (column sums of the client x class count matrix).
    A client holding only globally rare classes scores high; a client with no samples scores 0.
    """
    counts = np.asarray(class_counts, dtype=np.float64)
    if counts.ndim != 2 or counts.size == 0:
        raise ValueError(
            f"class_counts must be a non-empty clients x classes matrix, got shape {counts.shape}"
        )
    if not np.isfinite(counts).all() or (counts < 0).any():
        raise ValueError("class_counts must be finite and non-negative")
    total = counts.sum()
    if total <= 0:
        raise ValueError("class_counts holds no samples")
    pi = counts.sum(axis=0) / total
    surprisal = np.where(pi > 0, -np.log(np.where(pi > 0, pi, 1.0)), 0.0)
    n = counts.sum(axis=1)
    return np.where(n > 0, counts @ surprisal / np.where(n > 0, n, 1.0), 0.0)


def correlate_with_rarity(probabilities: np.ndarray, class_counts: np.ndarray) -> np.ndarray:
    """Reassign the same probabilities so that the rarest data gets the lowest availability.

    Clients are ranked by ``rarity_scores`` (ties: lower client index first) and receive the
    probabilities in ascending order, so the multiset of ``p`` (and hence the expected round
    size) is unchanged while the coupling is perfect in rank.
    """
    p = np.asarray(probabilities, dtype=np.float64)
    scores = rarity_scores(class_counts)
    if p.shape != scores.shape:
        raise ValueError(f"{p.shape[0] if p.ndim else 0} probabilities for {scores.shape[0]} clients")
    rarest_first = np.argsort(-scores, kind="stable")
    out = np.empty_like(p)
    out[rarest_first] = np.sort(p)
    return out


def participation_to_events(participation: np.ndarray, slot_s: float) -> dict[int, list[tuple[float, str]]]:
    """Turn a (rounds, clients) participation matrix into per-client availability events.

    Round ``r`` occupies ``[r * slot_s, (r + 1) * slot_s)``: the client is ``AVL_TRAIN`` in the
    slots of the rounds it was drawn for and ``UN_AVL`` otherwise. As in the trace files, each
    list starts at ``t = 0`` and then records changes only; a client still available in the last
    round gets a closing ``UN_AVL`` at ``rounds * slot_s``, so nothing outside the drawn horizon
    looks available.
    """
    part = np.asarray(participation)
    if part.ndim != 2:
        raise ValueError(f"participation must be a rounds x clients matrix, got shape {part.shape}")
    if part.dtype != np.bool_:
        raise ValueError(f"participation must be boolean, not {part.dtype}")
    if not (slot_s > 0 and np.isfinite(slot_s)):
        raise ValueError(f"slot_s must be a finite positive number of seconds, not {slot_s}")
    rounds, clients = part.shape
    events: dict[int, list[tuple[float, str]]] = {}
    for c in range(clients):
        col = part[:, c]
        evs: list[tuple[float, str]] = [(0.0, "AVL_TRAIN" if rounds and col[0] else "UN_AVL")]
        for r in np.flatnonzero(col[1:] != col[:-1]) + 1:
            evs.append((float(r) * slot_s, "AVL_TRAIN" if col[r] else "UN_AVL"))
        if rounds and col[-1]:
            evs.append((float(rounds) * slot_s, "UN_AVL"))
        events[c] = evs
    return events


def participation_trace(participation: np.ndarray, slot_s: float) -> AvailabilityTrace:
    """The availability trace of a RAM draw (``trace.kind: ram``): client ``c`` follows device
    ``c``, available to train in exactly the slots of the rounds it was drawn for."""
    events = participation_to_events(participation, slot_s)
    devices = tuple(
        DeviceTrace.from_events([(t, Tier[name]) for t, name in evs[1:]], initial=Tier[evs[0][1]])
        for _, evs in sorted(events.items())
    )
    return AvailabilityTrace(devices, f"ram({participation.shape[0]} rounds of {slot_s:g} s)")


def ram_probabilities(
    cfg: TraceCfg, num_clients: int, rng: np.random.Generator, class_counts: np.ndarray | None = None
) -> np.ndarray:
    """``trace.kind: ram``: each client's participation probability p_i (``trace.ram``), drawn
    from ``rng`` (the scenario's trace stream) and placed by ``trace.ram.coupling``."""
    from felix.config import ConfigError

    r = cfg.ram
    if r.coupling == "rare_clients":  # the last clients hold the rare classes (partition.kind rare_clients)
        n_rare = num_clients - round(r.frequent_fraction * num_clients)
        return np.array([r.p_frequent] * (num_clients - n_rare) + [r.p_rare] * n_rare)
    try:
        if r.p_dist == "beta":
            p = beta_probabilities(num_clients, rng, r.a, r.b, r.p_min, r.p_max)
        else:
            p = two_level_probabilities(num_clients, rng, r.frequent_fraction, r.p_frequent, r.p_rare)
        if r.coupling == "none":
            return p
        if class_counts is None:
            raise ConfigError(
                "trace.ram.coupling 'rarity' needs the clients' class counts (a trace built with "
                "the population)"
            )
        return correlate_with_rarity(p, class_counts)
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"trace.ram: {exc}") from None


@TRACES.register("ram")
def ram_trace(
    cfg: TraceCfg, num_clients: int, rng: np.random.Generator, class_counts: np.ndarray | None = None
) -> AvailabilityTrace:
    """The trace of ``trace.kind: ram``: the p_i, then one draw per slot of ``trace.slot_s`` over
    ``trace.horizon_s``, both from the scenario's trace stream (the same for every strategy)."""
    p = ram_probabilities(cfg, num_clients, rng, class_counts)
    return participation_trace(
        RandomAccessModel(p).draw_rounds(int(cfg.horizon_s // cfg.slot_s), rng), cfg.slot_s
    )
