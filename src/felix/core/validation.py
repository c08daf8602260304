"""Update validation: what a client's result must satisfy before the orchestrator buffers it.

Every client message is hostile until validated, and one client must not be able to poison the
model, crash the server or bloat what the server ships to everyone. The orchestrator's own checks
(known client, task, shape, dtype, finite values) say a result is *well-formed*; this module says
it is *plausible*, with bounds that a single client cannot move:

- ``num_samples`` at most what the client registered, plus what its data-plan row adds (DAFL/LB
  augmentation grows a client's data by exactly that). Sample counts weight FedAvg-style
  aggregators, so an unbounded count would hand one client the whole step.
- loss, statistical utility and duration non-negative (every objective's loss is; q-FFL raises on
  a negative one).
- aux entries: only the keys the objective and the aggregator in use declare, each with its
  declared shape and dtype (``AuxDecl``). An undeclared key is refused, so a client can neither
  make aggregation raise with shapes that do not broadcast nor plant a large entry that the server
  would then ship with every later task. The MQTT shell applies the same check at decode.
- aux values, by size: a declared entry of the right shape holding 1e30 (SCAFFOLD's
  ``sum:scaffold_dc``, say) would be summed into the server's aux state and shipped to every
  client with its next training task. Each key's L2 norm (a scalar's magnitude) is screened like
  the update's, with the same policy, factor, window, minimum history and floor, over the latest
  accepted value of each of the last ``norm_window`` clients for that key; no step count enters
  (a control variate or a loss does not grow with the local steps). Before ``norm_min_history``
  clients have sent a key, its bound is ``norm_factor`` x max(1, the model's norm): the declared
  entries are gradients, losses and loss quantiles, and the first SCAFFOLD controls measured
  5-20 (``benchmarks/scaffold_ram.py``). Non-finite values are refused whatever the policy.
  ``norm_policy: clip`` scales a float entry down to its bound; ``off`` turns this off with the
  update screen (the FedeRage comparisons run the methods as published, unscreened). Honest
  runs (digits, 200-400 aggregations) had their largest entry at 8.9x its basis (SCAFFOLD's
  ``sum:scaffold_dc``; FedeRage's beta 4.9x) and warm-up entries below 0.02 x max(1, ||model||).
- the update's L2 norm against a robust statistic of recently accepted updates. An update is the
  sum of its client's local steps, ``k = min(ceil(num_samples / batch_size) * epochs, max_steps)``
  from the client config, so its norm grows with k: like sqrt(k) for noisy steps, up to k for
  aligned ones. The statistic is ``norm / sqrt(k)``, and the history keeps its latest value for
  each of the last ``norm_window`` distinct clients. One client holds one entry, so it cannot drag
  the median; an update above ``norm_factor`` x the median x sqrt(k) is rejected
  (``norm_policy="reject"``) or scaled down to that bound (``"clip"``). Measured on honest runs
  (digits/small_cnn felix; Fashion-MNIST/MLP 300 clients Dirichlet 0.1, felix and fedavg; DAFL's
  D2 table partition), the largest update was 3.9x its bound's basis; but a 100-client digits
  run (``benchmarks/ray_sweep.py``) had honest updates at 13x, so the default factor is 30 (a
  poisoned update is orders of magnitude above any of these); with the raw norm, D2's few large clients sat above 10x the median of the many small
  ones, and with ``norm / k`` the one-step clients of the Dirichlet population did. Until
  ``norm_min_history`` clients have contributed, the bound is ``warmup_factor`` times the norm of
  the current model (an honest update moved the model by at most 0.2 of its norm there).
- an update that moved nothing is accepted and not remembered: a client with fewer samples than
  one batch takes no step under ``drop_last`` or FedeRage's fixed batches, and its zero says
  nothing about the size of honest updates. Counted, such clients (most of a Dirichlet
  population of the bundled digits under FedeRage) made the median 0, and with it the bound: every
  later update was refused and the run never aggregated.
- a floor under that median: it never counts below ``norm_floor`` (0.5) times its peak so far.
  As the model converges the updates shrink and the median with them, so late in a long run an
  honest update computed on an older model (a client back from a long absence, a stale task) or
  from unusual data stood above ``norm_factor`` x the current median and was refused. The peak
  is itself a median (one client cannot raise it), so the floor keeps the bound at least
  ``norm_factor x norm_floor`` = 15 times the largest typical update of the run: above the
  largest honest ratio measured (13x, above; 3.3-5.7x in 300 aggregations of felix-cpu-100,
  seeds 0-2, whose median fell to 0.36-0.37 of its peak, ``benchmarks/norm_floor.py``,
  ``docs/results/norm_floor_felix-cpu-100.jsonl``), and still orders of magnitude below a
  poisoned update.

The validator is sans-I/O and deterministic; its only state is the norm history, which
``state_dict`` / ``load_state_dict`` expose for checkpoints.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from felix.core.settings import Settings
from felix.core.types import ClientUpdate, TaskKind

# The declared range of every number a client reports. Finite is not enough: two utilities of
# 1.7e308 are finite, and their sum overflows (Oort's pacer raised inside an aggregation). Each
# bound is far above any honest value (an Oort utility is at most a client's samples times its
# loss; a diverged model's cross-entropy reached 1e9-1e12 at lr 100; a task lasts seconds to
# hours), and small enough that sums, squares and means over a million clients stay finite. The MQTT shell checks
# them at decode (``felix.deploy.wire``), and the orchestrator again (``malformed``), so that the
# simulator's clients and any other shell are held to the same.
MAX_UTILITY = 1e36  # stat_utility
MAX_LOSS = 1e30  # loss
MAX_DURATION = 1e9  # duration, seconds
MAX_SAMPLES = 2**40  # num_samples and each class count
MAX_TIME = 1e12  # a data span's arrival times, run seconds (either sign)
MAX_UNIX_TIME = 1e11  # a message's "sent" stamp, Unix seconds (year 5138)
MAX_ID = 2**62  # client, task and version numbers (kept in int64 columns and checkpoints)
REPORTED_RANGES: dict[str, tuple[float, float]] = {
    "stat_utility": (0.0, MAX_UTILITY),
    "loss": (0.0, MAX_LOSS),
    "duration": (0.0, MAX_DURATION),
}


def out_of_range(upd: ClientUpdate) -> str | None:
    """Why a result's reported numbers are outside their declared magnitudes, or None. Negative
    values are left to ``UpdateValidator`` (its own reason); non-finite ones are named as such."""
    if not (math.isfinite(upd.stat_utility) and math.isfinite(upd.loss) and math.isfinite(upd.duration)):
        return "non-finite loss, utility or duration"
    for name, (_, hi) in REPORTED_RANGES.items():
        if abs(getattr(upd, name)) > hi:
            return f"{name} outside its declared range (|value| <= {hi:g})"
    if not (0 <= upd.num_samples <= MAX_SAMPLES):
        return f"num_samples outside its declared range (0 to {MAX_SAMPLES})"
    span = upd.data_span
    if span is not None and not all(math.isfinite(v) and abs(v) <= MAX_TIME for v in span):
        return "data span not finite or outside its declared range"
    return None


def malformed(kind: TaskKind, upd: ClientUpdate, theta: np.ndarray) -> str | None:
    """Why a result is not well-formed (the orchestrator's own checks, before ``UpdateValidator``
    judges whether it is plausible), or None: finite scalars, samples behind a training update,
    a float32 delta of the model's shape with finite values, finite aux entries and data span."""
    problem = out_of_range(upd)
    if problem is not None:
        return problem
    if upd.num_samples <= 0 and kind is TaskKind.TRAIN:
        return "training update over no samples"
    if kind is not TaskKind.TRAIN:
        return None
    d = upd.delta
    if d is None:
        return "training result without a model update"
    if d.shape != theta.shape or d.dtype != np.float32:
        return f"model update of shape {d.shape}/{d.dtype}, expected {theta.shape}/float32"
    if not np.isfinite(d).all():
        return "model update holds non-finite values"
    for key, val in upd.aux.items():
        if not np.isfinite(np.asarray(val, dtype=np.float64)).all():
            return f"aux {key!r} holds non-finite values"
    span = upd.data_span
    # (Not checked against the server's clock: a deployed client's clock is its own.)
    if span is not None and not (
        len(span) == 2 and all(math.isfinite(v) for v in span) and span[0] <= span[1]
    ):
        return "data span not finite or reversed"
    return None


@dataclass(frozen=True, slots=True)
class AuxDecl:
    """One aux entry an objective or aggregator uses: its exact shape and numpy dtype string."""

    shape: tuple[int, ...]
    dtype: str  # "<f4", "<f8" or "<i8": what travels on the wire

    def __post_init__(self) -> None:
        if any(d < 0 for d in self.shape):
            raise ValueError(f"aux shape {self.shape} has a negative dimension")
        np.dtype(self.dtype)


AuxSpec = Mapping[str, AuxDecl]


def aux_problem(aux: Mapping[str, np.ndarray], spec: AuxSpec) -> str | None:
    """Why ``aux`` does not fit ``spec`` (undeclared key, wrong shape or dtype), or None if it does.

    Declared keys may be absent (an eval result has none; q-FFL's ``qffl_loss`` is optional).
    """
    for key, value in aux.items():
        decl = spec.get(key)
        if decl is None:
            allowed = ", ".join(sorted(spec)) or "none"
            return f"undeclared aux entry {key[:40]!r} (declared: {allowed})"
        arr = np.asarray(value)
        if arr.shape != decl.shape or arr.dtype != np.dtype(decl.dtype):
            return (
                f"aux {key!r} of shape {arr.shape}/{arr.dtype.str}, "
                f"declared {decl.shape}/{np.dtype(decl.dtype).str}"
            )
    return None


class ValidationConfig(Settings):
    """Bounds on client results (the config's ``validation`` section); on by default in simulation
    and deployment, and leave every honest update of the presets untouched (the module docstring
    has the measured margins)."""

    max_samples_factor: float = Field(
        1.0, ge=1, description="num_samples <= factor x the registered count (+ the data-plan row)"
    )
    norm_policy: Literal["reject", "clip", "off"] = "reject"
    norm_factor: float = Field(30.0, gt=1, description="norm bound: factor x median of recent accepted norms")
    norm_window: int = Field(
        50, ge=1, description="distinct clients whose latest accepted norm forms the median"
    )
    norm_min_history: int = Field(5, ge=1, description="clients needed before the median rule applies")
    warmup_factor: float = Field(
        1.0, ge=0, description="bound before that: factor x the model's norm (0: none)"
    )
    norm_floor: float = Field(
        0.5,
        ge=0,
        le=1,
        description="the median never counts below this fraction of its peak so far, so that the "
        "bound does not shrink with the updates as the model converges (0: no floor)",
    )

    @model_validator(mode="after")
    def _history(self) -> ValidationConfig:
        if self.norm_min_history > self.norm_window:
            raise ValueError("need norm_min_history <= norm_window")
        return self


@dataclass(frozen=True, slots=True)
class LocalSteps:
    """The clients' local schedule (the config's ``client.batch_size``, ``epochs``, ``max_steps``),
    which counts the local steps behind an update of ``num_samples`` samples."""

    batch_size: int = 1
    epochs: int = 1
    max_steps: int | None = None

    def __call__(self, num_samples: int) -> int:
        steps = max(1, -(-num_samples // self.batch_size)) * self.epochs
        return steps if self.max_steps is None else min(steps, self.max_steps)

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.epochs < 1 or (self.max_steps is not None and self.max_steps < 1):
            raise ValueError("batch_size, epochs and max_steps must be >= 1")


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of ``UpdateValidator.check``: a rejection reason, or the update to buffer
    (the same object, or a clipped copy)."""

    update: ClientUpdate | None
    reason: str = ""
    clipped: bool = False


def l2_norm(a: np.ndarray) -> float:
    """The L2 norm; in float64 when float32 overflows (squares of values near 3e38 are inf)."""
    arr = np.asarray(a).reshape(-1)
    with np.errstate(over="ignore"):
        sq = float(np.dot(arr, arr))
    if not math.isfinite(sq):
        sq = float(np.dot(arr.astype(np.float64), arr.astype(np.float64)))
    return math.sqrt(sq)


class RecentScale:
    """The typical size of recent accepted values: the latest value of each of the last ``window``
    distinct clients (one client holds one entry, so it cannot drag the median), their median,
    and the peak of that median once ``min_history`` clients have contributed."""

    def __init__(self, window: int, min_history: int) -> None:
        self.window = window
        self.min_history = min_history
        self.norms: dict[int, float] = {}  # client id -> its latest accepted value, oldest first
        # The values of ``norms``, sorted: the median without a sort per update.
        self._sorted: list[float] = []
        self.peak = 0.0  # the highest median of ``norms`` since it had min_history entries

    @property
    def ready(self) -> bool:
        return len(self.norms) >= self.min_history

    def median(self) -> float:
        """The median of ``norms`` (as ``np.median``: the mean of the middle two when even)."""
        v, n = self._sorted, len(self._sorted)
        return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2

    def basis(self, floor: float) -> float:
        """The median, never below ``floor`` x its peak (only when ``ready``)."""
        return max(self.median(), floor * self.peak)

    def remember(self, client_id: int, norm: float) -> None:
        old = self.norms.pop(client_id, None)
        if old is not None:
            self._unsort(old)
        self.norms[client_id] = norm
        bisect.insort(self._sorted, norm)
        while len(self.norms) > self.window:
            self._unsort(self.norms.pop(next(iter(self.norms))))
        if self.ready:
            self.peak = max(self.peak, self.median())

    def _unsort(self, norm: float) -> None:
        del self._sorted[bisect.bisect_left(self._sorted, norm)]

    def state_dict(self) -> dict[str, Any]:
        return {"norms": [[int(c), float(n)] for c, n in self.norms.items()], "peak": self.peak}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        norms = {int(c): float(n) for c, n in state["norms"]}
        if not all(math.isfinite(n) and n >= 0 for n in norms.values()):
            raise ValueError("validator norms must be finite and non-negative")
        self.norms, self._sorted = norms, sorted(norms.values())
        self.peak = float(state.get("peak", 0.0))  # absent in checkpoints from before the floor


class UpdateValidator:
    """Checks one result against the client's registration, the declared aux, recent update norms
    and recent aux values."""

    def __init__(
        self,
        config: ValidationConfig | None = None,
        aux_spec: AuxSpec | None = None,
        local_steps: LocalSteps | None = None,
    ) -> None:
        self.config = config if config is not None else ValidationConfig()
        self.local_steps = local_steps if local_steps is not None else LocalSteps()
        self.aux_spec: dict[str, AuxDecl] = dict(aux_spec or {})
        c = self.config
        # Update norm / sqrt(steps), and each declared aux key's norm.
        self.updates = RecentScale(c.norm_window, c.norm_min_history)
        # privacy on (set by felix.privacy.setup): the norm no private update exceeds, which
        # replaces the median rule (a private update is clipped on the device, then perhaps noised)
        self.privacy_bound: float | None = None
        self.aux_scales = {k: RecentScale(c.norm_window, c.norm_min_history) for k in self.aux_spec}

    @property
    def norms(self) -> dict[int, float]:
        """Client id -> its latest accepted update norm / sqrt(steps), oldest first."""
        return self.updates.norms

    @property
    def peak(self) -> float:
        return self.updates.peak

    # ------------------------------------------------------------------ checks
    def check(
        self,
        client_id: int,
        kind: TaskKind,
        upd: ClientUpdate,
        registered_samples: int,
        planned_extra: int,
        theta: np.ndarray,
    ) -> Verdict:
        if upd.loss < 0 or upd.stat_utility < 0 or upd.duration < 0:
            return Verdict(None, "negative loss, utility or duration")
        limit = self.config.max_samples_factor * (registered_samples + planned_extra)
        if upd.num_samples > limit:
            return Verdict(
                None,
                f"num_samples {upd.num_samples} exceeds the {registered_samples} the client "
                f"registered (+{planned_extra} planned)",
            )
        problem = aux_problem(upd.aux, self.aux_spec)
        if problem is not None:
            return Verdict(None, problem)
        aux_norms: dict[str, float] = {}
        aux_clipped = False
        if upd.aux:
            screened = self._screen_aux(upd, theta, aux_norms)
            if isinstance(screened, str):
                return Verdict(None, screened)
            aux_clipped = screened is not upd
            upd = screened
        screen = self.config.norm_policy != "off" or self.privacy_bound is not None
        if kind is not TaskKind.TRAIN or upd.delta is None or not screen:
            self._remember_aux(client_id, aux_norms)
            return Verdict(upd, clipped=aux_clipped)
        norm = l2_norm(upd.delta)
        steps = self.local_steps(upd.num_samples)
        bound = self.norm_bound(theta, steps)
        clipped = False
        if bound is not None and norm > bound:
            if self.config.norm_policy != "clip":
                return Verdict(
                    None, f"update norm {norm:.3g} exceeds the bound {bound:.3g} ({self._bound_basis()})"
                )
            scale = bound / norm if math.isfinite(norm) else 0.0
            delta = (upd.delta.astype(np.float64) * scale).astype(np.float32)
            upd, norm, clipped = replace(upd, delta=delta), bound, True
        if norm > 0:
            self.updates.remember(client_id, norm / math.sqrt(steps))
        self._remember_aux(client_id, aux_norms)
        return Verdict(upd, clipped=clipped or aux_clipped)

    def _screen_aux(
        self, upd: ClientUpdate, theta: np.ndarray, norms: dict[str, float]
    ) -> ClientUpdate | str:
        """The update with its aux entries within their bounds (a copy with clipped entries under
        ``clip``), or why it is refused. Fills ``norms`` with each entry's accepted norm, to be
        remembered once the whole update is accepted."""
        policy = self.config.norm_policy
        clipped: dict[str, np.ndarray] = {}
        for key, value in upd.aux.items():
            arr = np.asarray(value)
            norm = l2_norm(arr)
            if not math.isfinite(norm):
                return f"aux {key!r} holds non-finite values"
            bound = None if policy == "off" else self.aux_bound(key, theta)
            if bound is not None and norm > bound:
                if policy == "reject" or arr.dtype.kind != "f":
                    return (
                        f"aux {key!r} norm {norm:.3g} exceeds the bound {bound:.3g} ({self._aux_basis(key)})"
                    )
                clipped[key] = (arr.astype(np.float64) * (bound / norm)).astype(arr.dtype)
                norm = bound
            norms[key] = norm
        return replace(upd, aux={**upd.aux, **clipped}) if clipped else upd

    def aux_bound(self, key: str, theta: np.ndarray) -> float | None:
        """The bound on the norm of aux entry ``key``, or None while there is no basis for one."""
        c = self.config
        scale = self.aux_scales.get(key)
        if scale is not None and scale.ready:
            return c.norm_factor * scale.basis(c.norm_floor)
        return c.norm_factor * max(1.0, l2_norm(theta)) if c.warmup_factor > 0 else None

    def _aux_basis(self, key: str) -> str:
        c = self.config
        scale = self.aux_scales.get(key)
        if scale is not None and scale.ready:
            return f"{c.norm_factor:g} x the median of {len(scale.norms)} clients' latest {key!r} norms"
        return f"{c.norm_factor:g} x max(1, the model's norm), until {c.norm_min_history} clients have sent {key!r}"

    def _remember_aux(self, client_id: int, norms: dict[str, float]) -> None:
        for key, norm in norms.items():
            scale = self.aux_scales.get(key)
            if scale is not None and norm > 0:
                scale.remember(client_id, norm)

    def norm_bound(self, theta: np.ndarray, steps: int = 1) -> float | None:
        """The bound on the norm of an update of ``steps`` local steps, or None while there is no
        basis for one."""
        c = self.config
        if self.privacy_bound is not None:
            return self.privacy_bound
        if self.updates.ready:
            return c.norm_factor * self.updates.basis(c.norm_floor) * math.sqrt(steps)
        model = l2_norm(theta)
        return c.warmup_factor * model if c.warmup_factor > 0 and model > 0 else None

    def _bound_basis(self) -> str:
        c = self.config
        if self.privacy_bound is not None:
            return "privacy: the clip norm, plus the local noise's tail bound under local DP"
        if self.updates.ready:
            floor = f" (at least {c.norm_floor:g} x its peak {self.peak:.3g})" if c.norm_floor > 0 else ""
            return (
                f"{c.norm_factor:g} x the median of {len(self.norms)} clients' norm/sqrt(steps){floor} "
                "x sqrt(its steps)"
            )
        return f"{c.warmup_factor:g} x the model's norm, until {c.norm_min_history} clients have sent updates"

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            **self.updates.state_dict(),
            "aux": {k: scale.state_dict() for k, scale in self.aux_scales.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.updates.load_state_dict(state)
        for key, scale_state in state.get("aux", {}).items():  # absent before aux values were screened
            if key in self.aux_scales:
                self.aux_scales[key].load_state_dict(scale_state)
