"""Availability traces: per device, a step function of time over the three tiers.

Readers for the FeLiX/MobiPerf event format and FedScale's client_behave_trace, and generators
for the synthetic settings of the FeLiX paper (always available; 600 s slots with a fraction of
clients unavailable). A trace with fewer devices than clients is reused round-robin.

``TRACES`` is the trace registry. A trace builder is ``builder(cfg, num_clients, rng, **params) ->
AvailabilityTrace``: ``cfg`` the run's ``TraceCfg`` (path, series, slot settings), ``num_clients``
the population size, ``rng`` the scenario's trace stream, ``params`` ``trace.params``. A config
names it ``trace.kind: NAME`` or ``package.module:builder``; ``trace.offset_s`` is applied after.
A builder that has a ``class_counts`` parameter also receives the clients' samples per class
(``num_clients x num_classes``, or None where the trace is built without the population), for
availability coupled to the data (the Random Access Model's rare clients).
"""

from __future__ import annotations

import inspect
import io
import json
import math
import pickle
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from felix.config import ConfigError
from felix.core.registry import CallShape, Registry
from felix.core.types import Tier
from felix.scenario.errors import TraceError
from felix.scenario.locations import trace_file

if TYPE_CHECKING:
    from felix.config import TraceCfg

MOBIPERF_SERIES = {
    "2": "avl_events_2_state",
    "3_50": "avl_events_3_state_50",
    "3_75": "avl_events_3_state_75",
}


@dataclass(frozen=True)
class DeviceTrace:
    """Tier as a step function: ``tiers[i]`` holds from ``times[i]`` until ``times[i+1]``.

    With a ``period`` the trace repeats (FedScale wraps its traces at ``finish_time``).
    """

    times: np.ndarray  # float64, strictly increasing, times[0] == 0
    tiers: np.ndarray  # int8 Tier values, no two equal neighbours
    period: float | None = None

    @classmethod
    def from_events(
        cls, events: Iterable[tuple[float, Tier]], period: float | None = None, initial: Tier = Tier.UN_AVL
    ) -> DeviceTrace:
        """Build from (time, tier) events in time order; of events at the same time the last wins."""
        times: list[float] = [0.0]
        tiers: list[int] = [int(initial)]
        for t, tier in events:
            t = float(t)
            if t <= times[-1]:
                tiers[-1] = int(tier)
            else:
                times.append(t)
                tiers.append(int(tier))
        t_arr = np.array(times, dtype=np.float64)
        k_arr = np.array(tiers, dtype=np.int8)
        mask = np.concatenate([[True], k_arr[1:] != k_arr[:-1]])
        return cls(t_arr[mask], k_arr[mask], period)

    def _local(self, t: float) -> tuple[float, float]:
        """Map t into the base period; returns (offset of the period start, local time)."""
        if self.period is None:
            return 0.0, t
        base = math.floor(t / self.period) * self.period
        return base, t - base

    def tier_at(self, t: float) -> Tier:
        _, lt = self._local(t)
        i = int(np.searchsorted(self.times, lt, side="right")) - 1
        return Tier(int(self.tiers[max(i, 0)]))

    def next_change(self, t: float) -> tuple[float, Tier] | None:
        """The first change strictly after t, or None if the tier never changes again."""
        base, lt = self._local(t)
        i = int(np.searchsorted(self.times, lt, side="right"))
        if i < len(self.times):
            return base + float(self.times[i]), Tier(int(self.tiers[i]))
        if self.period is None or len(self.times) == 1:
            return None
        nxt = base + self.period
        first = Tier(int(self.tiers[0]))
        if first != Tier(int(self.tiers[-1])):
            return nxt, first
        return self.next_change(nxt)

    def shifted(self, offset_s: float) -> DeviceTrace:
        """The same device seen from ``offset_s`` seconds into its trace: time 0 of the result is
        ``offset_s`` here (a periodic trace is rotated, so it keeps its period)."""
        if offset_s < 0 or not math.isfinite(offset_s):
            raise ValueError(f"trace offset must be a finite number >= 0, got {offset_s!r}")
        if offset_s == 0:
            return self
        start = self.tier_at(offset_s)
        if self.period is None:
            events = [
                (float(t) - offset_s, Tier(int(k))) for t, k in zip(self.times, self.tiers) if t > offset_s
            ]
            return DeviceTrace.from_events(events, None, initial=start)
        off = offset_s % self.period
        events = [(float(t) - off, Tier(int(k))) for t, k in zip(self.times, self.tiers) if t > off]
        if off > 0:
            events.append((self.period - off, Tier(int(self.tiers[0]))))
            events += [
                (float(t) + self.period - off, Tier(int(k)))
                for t, k in zip(self.times, self.tiers)
                if 0 < t < off
            ]
        return DeviceTrace.from_events(events, self.period, initial=start)

    def available_throughout(self, t0: float, t1: float, tier: Tier = Tier.AVL_TRAIN) -> bool:
        if self.tier_at(t0) < tier:
            return False
        t = t0
        while True:
            ch = self.next_change(t)
            if ch is None or ch[0] > t1:
                return True
            if ch[1] < tier:
                return False
            t = ch[0]


@dataclass(frozen=True)
class AvailabilityTrace:
    """A set of device traces; client k follows device ``k % len(devices)``. Also the oracle."""

    devices: tuple[DeviceTrace, ...]
    source: str = ""

    def __post_init__(self) -> None:
        if not self.devices:
            raise TraceError(f"{self.source or 'trace'}: no devices")

    def shifted(self, offset_s: float) -> AvailabilityTrace:
        """Every device from ``offset_s`` seconds into the trace (``trace.offset_s``): lets a
        scenario start where the trace has churn instead of in an all-available head."""
        if offset_s == 0:
            return self
        return AvailabilityTrace(
            tuple(d.shifted(offset_s) for d in self.devices), f"{self.source}+{offset_s:g}s"
        )

    def for_client(self, client_id: int) -> DeviceTrace:
        return self.devices[client_id % len(self.devices)]

    def tier_at(self, client_id: int, t: float) -> Tier:
        return self.for_client(client_id).tier_at(t)

    def available_throughout(self, client_id: int, t0: float, t1: float) -> bool:
        return self.for_client(client_id).available_throughout(t0, t1)


# ---------------------------------------------------------------------- synthetic
def always_available(num_devices: int = 1) -> AvailabilityTrace:
    dev = DeviceTrace(np.zeros(1), np.array([int(Tier.AVL_TRAIN)], dtype=np.int8))
    return AvailabilityTrace(tuple(dev for _ in range(max(1, num_devices))), "always")


def slotted_churn(
    num_devices: int,
    unavailable_fraction: float,
    rng: np.random.Generator,
    slot_s: float = 600.0,
    horizon_s: float = 86400.0,
    head_s: float = 0.0,
) -> AvailabilityTrace:
    """The FeLiX synthetic setting: in each slot a random ``unavailable_fraction`` of clients is UN_AVL.

    The pattern repeats after ``horizon_s``; ``head_s`` seconds of full availability may lead in.
    """
    if not 0.0 <= unavailable_fraction < 1.0:
        raise ValueError("unavailable_fraction must be in [0, 1)")
    if slot_s <= 0 or horizon_s < slot_s:
        raise ValueError("need slot_s > 0 and horizon_s >= slot_s")
    n_slots = int(horizon_s // slot_s)
    down = np.zeros((n_slots, num_devices), dtype=bool)
    k = round(unavailable_fraction * num_devices)
    for s in range(n_slots):
        down[s, rng.choice(num_devices, size=k, replace=False)] = True
    # What DeviceTrace.from_events builds from the slot events, in numpy: thousands of devices with
    # thousands of slots each (an emulated population) take seconds, not minutes.
    starts = head_s + np.arange(n_slots, dtype=np.float64) * slot_s
    codes = np.where(down.T, np.int8(Tier.UN_AVL), np.int8(Tier.AVL_TRAIN)).astype(np.int8)  # device x slot
    if head_s > 0:  # the lead-in: available from 0 until the first slot
        starts = np.concatenate([[0.0], starts])
        codes = np.concatenate(
            [np.full((num_devices, 1), np.int8(Tier.AVL_TRAIN), dtype=np.int8), codes], axis=1
        )
    keep = np.ones_like(codes, dtype=bool)
    keep[:, 1:] = codes[:, 1:] != codes[:, :-1]
    period = head_s + n_slots * slot_s if head_s == 0 else None
    devices = [DeviceTrace(starts[keep[d]], codes[d, keep[d]], period) for d in range(num_devices)]
    return AvailabilityTrace(tuple(devices), f"slotted({unavailable_fraction})")


# ---------------------------------------------------------------------- MobiPerf / FeLiX format
def load_mobiperf(path: str | Path, series: str = "3_50") -> AvailabilityTrace:
    """Read the FeLiX authors' per-device event lists; ``series`` picks 2-state, 3-state (battery
    threshold 50 or 75) or ``failures_48h`` (unavailability as [start, duration] pairs)."""
    path = Path(path)
    if series not in MOBIPERF_SERIES and series != "failures_48h":
        raise TraceError(
            f"unknown series {series!r}; choose one of {sorted(MOBIPERF_SERIES)} or failures_48h"
        )
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise TraceError(f"trace file {path} not found") from None
    except (OSError, ValueError) as exc:  # ValueError: JSON or UTF-8 decoding
        raise TraceError(f"{path}: not a JSON trace ({exc})") from None
    devices = doc.get("devices") if isinstance(doc, dict) else None
    if not isinstance(devices, dict) or not devices:
        raise TraceError(f"{path}: expected an object with a non-empty 'devices' map")
    out = []
    for dev_id in sorted(devices, key=lambda s: (len(s), s)):
        entry = devices[dev_id]
        if not isinstance(entry, dict):
            raise TraceError(f"{path}: device {dev_id}: expected an object")
        if series == "failures_48h":
            out.append(_failures(path, dev_id, entry.get("failure_durations_s_48h")))
        else:
            out.append(_events(path, dev_id, entry.get(MOBIPERF_SERIES[series]), MOBIPERF_SERIES[series]))
    return AvailabilityTrace(tuple(out), f"{path.name}:{series}")


def _events(path: Path, dev: str, raw: object, key: str) -> DeviceTrace:
    if not isinstance(raw, list) or not raw:
        raise TraceError(f"{path}: device {dev}: missing or empty '{key}'")
    events: list[tuple[float, Tier]] = []
    last = -math.inf
    for i, ev in enumerate(raw):
        if not (isinstance(ev, (list, tuple)) and len(ev) == 2):
            raise TraceError(f"{path}: device {dev}, event {i}: expected [t_seconds, tier], got {ev!r}")
        t, name = ev
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise TraceError(f"{path}: device {dev}, event {i}: bad time {t!r}")
        if t < last:
            raise TraceError(f"{path}: device {dev}, event {i}: time {t} goes back before {last}")
        try:
            tier = Tier.parse(name) if isinstance(name, str) else Tier.parse(repr(name))
        except ValueError as exc:
            raise TraceError(f"{path}: device {dev}, event {i}: {exc}") from None
        events.append((float(t), tier))
        last = t
    return DeviceTrace.from_events(events, initial=events[0][1])


def _failures(path: Path, dev: str, raw: object) -> DeviceTrace:
    if not isinstance(raw, list):
        raise TraceError(f"{path}: device {dev}: missing 'failure_durations_s_48h'")
    events: list[tuple[float, Tier]] = []
    for i, ev in enumerate(raw):
        ok = (
            isinstance(ev, (list, tuple))
            and len(ev) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in ev)
        )
        if not ok:
            raise TraceError(f"{path}: device {dev}, failure {i}: expected [start_s, duration_s], got {ev!r}")
        start, dur = float(ev[0]), float(ev[1])
        if events and start < events[-1][0]:
            raise TraceError(f"{path}: device {dev}, failure {i}: overlaps the previous one")
        events += [(start, Tier.UN_AVL), (start + dur, Tier.AVL_TRAIN)]
    return DeviceTrace.from_events(events, period=48 * 3600.0, initial=Tier.AVL_TRAIN)


# ---------------------------------------------------------------------- FedScale client_behave_trace
class _PlainUnpickler(pickle.Unpickler):
    """FedScale ships its trace as a pickle; allow only plain containers and numbers, never code."""

    def find_class(self, module: str, name: str) -> object:
        raise TraceError(f"refusing to load {module}.{name} from a trace pickle: only plain data is allowed")


def load_fedscale(path: str | Path) -> AvailabilityTrace:
    """FedScale's ``client_behave_trace``: {client: {active: [...], inactive: [...], finish_time}},
    as its pickle or as JSON; time wraps at ``finish_time`` as in FedScale's is_active()."""
    path = Path(path)
    try:
        raw_bytes = path.read_bytes()
    except OSError as exc:
        raise TraceError(f"trace file {path}: {exc.strerror or exc}") from None
    try:
        doc = (
            json.loads(raw_bytes)
            if raw_bytes[:1] in (b"{", b"[")
            else _PlainUnpickler(io.BytesIO(raw_bytes)).load()
        )
    except TraceError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged pickle fails in many ways (EOF, overflow, type...)
        raise TraceError(
            f"{path}: not a FedScale client_behave_trace ({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(doc, dict) or not doc:
        raise TraceError(f"{path}: expected a non-empty map of client -> behaviour")
    out = []
    for dev in sorted(doc, key=lambda k: (str(type(k)), k)):
        e = doc[dev]
        if not isinstance(e, dict):
            raise TraceError(f"{path}: client {dev}: expected a map with active/inactive/finish_time")
        active, inactive, finish = e.get("active"), e.get("inactive"), e.get("finish_time")
        if not isinstance(active, list) or not isinstance(inactive, list) or len(active) != len(inactive):
            raise TraceError(f"{path}: client {dev}: 'active' and 'inactive' must be lists of equal length")
        if not isinstance(finish, (int, float)) or finish <= 0:
            raise TraceError(f"{path}: client {dev}: bad finish_time {finish!r}")
        events: list[tuple[float, Tier]] = []
        for i, (a, b) in enumerate(zip(active, inactive)):
            if not (isinstance(a, (int, float)) and isinstance(b, (int, float)) and 0 <= a <= b):
                raise TraceError(
                    f"{path}: client {dev}, interval {i}: bad active/inactive pair ({a!r}, {b!r})"
                )
            if events and a < events[-1][0]:
                raise TraceError(f"{path}: client {dev}, interval {i}: intervals out of order")
            events += [(float(a), Tier.AVL_TRAIN), (float(b), Tier.UN_AVL)]
        out.append(DeviceTrace.from_events(events, period=float(finish), initial=Tier.UN_AVL))
    return AvailabilityTrace(tuple(out), f"{path.name}:fedscale")


# ---------------------------------------------------------------------- registry
TraceBuilder = Callable[..., AvailabilityTrace]
TRACES: Registry[TraceBuilder] = Registry(
    "trace",
    modules=("felix.scenario.random_access",),
    key="trace.kind",
    call=CallShape(
        "trace builder(cfg: TraceCfg, num_clients: int, rng: np.random.Generator, **params) -> AvailabilityTrace",
        "trace.params",
        passed=3,
        injected=("class_counts",),
    ),
)


def make_trace(
    cfg: TraceCfg, num_clients: int, rng: np.random.Generator, class_counts: np.ndarray | None = None
) -> AvailabilityTrace:
    """The configured trace builder's trace, from ``cfg.offset_s`` seconds into it."""
    fn = TRACES.resolve(cfg.kind)
    extra = dict(cfg.params)
    try:
        if "class_counts" in inspect.signature(fn).parameters:
            extra["class_counts"] = class_counts
    except (TypeError, ValueError):  # a callable without a signature gets none
        pass
    try:
        trace = fn(cfg, num_clients, rng, **extra)
    except TypeError as exc:
        raise TRACES.wrong(cfg.kind, f"fails when called: {exc}") from None
    if not isinstance(trace, AvailabilityTrace):
        raise TRACES.wrong(
            cfg.kind, f"returned a {type(trace).__name__}, not a felix.scenario.traces.AvailabilityTrace"
        )
    return trace.shifted(cfg.offset_s)


@TRACES.register("always")
def _always(cfg: TraceCfg, num_clients: int, rng: np.random.Generator) -> AvailabilityTrace:
    return always_available(1)


@TRACES.register("slotted")
def _slotted(cfg: TraceCfg, num_clients: int, rng: np.random.Generator) -> AvailabilityTrace:
    return slotted_churn(num_clients, cfg.unavailable_fraction, rng, cfg.slot_s, cfg.horizon_s)


@TRACES.register("mobiperf")
def _mobiperf(cfg: TraceCfg, num_clients: int, rng: np.random.Generator) -> AvailabilityTrace:
    if cfg.path is None:
        raise ConfigError("trace.kind 'mobiperf' needs trace.path")
    return load_mobiperf(trace_file(cfg.path), cfg.series)


@TRACES.register("fedscale")
def _fedscale(cfg: TraceCfg, num_clients: int, rng: np.random.Generator) -> AvailabilityTrace:
    if cfg.path is None:
        raise ConfigError("trace.kind 'fedscale' needs trace.path")
    return load_fedscale(trace_file(cfg.path))
