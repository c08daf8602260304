"""The pluggable policies of a strategy, one per axis of DESIGN.md.

The base classes own the mechanism (eligibility, buffering, normalisation, staleness); a
subclass owns one policy decision (which clients, which weight). Policies are pure: randomness
and the current time reach them through ``SelectionContext``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from felix.core.client_map import ClientMap, ClientRecord, ClientView
from felix.core.registry import NoParams, Registry
from felix.core.types import BufferedUpdate, Tier
from felix.core.validation import AuxDecl


class AvailabilityOracle(Protocol):
    """Ground-truth availability (a trace); only oracle baselines may consult it."""

    def tier_at(self, client_id: int, t: float) -> Tier: ...

    def available_throughout(self, client_id: int, t0: float, t1: float) -> bool: ...


@dataclass(slots=True)
class SelectionContext:
    now: float
    round: int  # the current round (sync) or model version (async)
    clients: ClientMap
    rng: np.random.Generator
    oracle: AvailabilityOracle | None = None
    # model_path[r]: how far the model had moved when round r began (the sum over aggregations of
    # the step's norm relative to the new model's norm); model_path[round] - model_path[r] is the
    # movement since round r. None where no orchestrator keeps it (a bare test context).
    model_path: np.ndarray | None = None


class TrainSelector:
    """Chooses ``k`` trainers among eligible candidates; eligibility is decided by the orchestrator."""

    name = "base"

    def select(self, candidates: Sequence[int] | np.ndarray, k: int, ctx: SelectionContext) -> list[int]:
        raise NotImplementedError

    def on_update(self, record: ClientRecord | ClientView, ctx: SelectionContext) -> None:
        """Feedback after a training update or an eval refreshed ``record``'s utility and duration."""

    def on_round_end(self, round_: int, ctx: SelectionContext) -> None:
        """Called once per aggregation (pacers and round-based bookkeeping)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep of the selector (plain values and numpy arrays); a stateless
        selector keeps nothing. Configuration is rebuilt from the config, never saved."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned, onto a selector built from the same config."""


class EvalSelector:
    """Chooses clients for forward-pass utility probes (TierSelect's eval path)."""

    name = "none"
    per_round_budget: int = 0

    def select(self, candidates: Sequence[int] | np.ndarray, budget: int, ctx: SelectionContext) -> list[int]:
        return []

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint state, as ``TrainSelector.state_dict``; the eval selectors so far keep none."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""


class Aggregator:
    """Owns the buffer arithmetic: weighted mean of deltas, normalisation and the server step.

    ``normalize="weights"`` divides by the sum of weights (the paper's TierFuse, FedBuff as in
    FedScale); ``"count"`` divides by the number of buffered updates (the FeLiX authors' code).
    """

    name = "base"

    def __init__(self, server_lr: float = 1.0, normalize: str = "weights", clip_norm: float | None = None):
        if normalize not in ("weights", "count"):
            raise ValueError(f"normalize must be 'weights' or 'count', not {normalize!r}")
        if server_lr <= 0:
            raise ValueError("server_lr must be positive")
        self.server_lr = server_lr
        self.normalize = normalize
        self.clip_norm = clip_norm

    def declared_aux(self, num_params: int) -> dict[str, AuxDecl]:
        """Aux entries this aggregator reads from updates beyond the objective's (see
        ``felix.core.validation``); the server rejects any entry neither declares."""
        return {}

    def weight(self, item: BufferedUpdate) -> float:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint state, as ``TrainSelector.state_dict``; the aggregators so far keep none
        (their parameters come from the config)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""

    def weights(self, buffer: Sequence[BufferedUpdate]) -> np.ndarray:
        return np.array([self.weight(b) for b in buffer], dtype=np.float64)

    def aggregate(
        self, theta: np.ndarray, buffer: Sequence[BufferedUpdate]
    ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """Return the new parameters, the normalised weights and the reduced aux state."""
        w = self.weights(buffer)
        denom = float(w.sum()) if self.normalize == "weights" else float(len(buffer))
        if denom <= 0:
            raise ValueError(f"{self.name}: aggregation weights sum to {denom}")
        norm_w = w / denom
        step = np.zeros_like(theta)
        for wi, item in zip(norm_w, buffer):
            delta = item.update.delta
            assert delta is not None
            if self.clip_norm is not None:
                n = float(np.linalg.norm(delta))
                if n > self.clip_norm:
                    delta = delta * (self.clip_norm / n)
            step += np.float32(wi) * delta
        new_theta = theta + np.float32(self.server_lr) * step
        return new_theta, norm_w, reduce_aux(buffer, norm_w)


# The registries of each kind (``felix.core.registry``): a strategy module registers its factories
# next to its classes; the modules listed here are the built-in ones, imported on the first lookup.
TRAIN_SELECTORS: Registry[TrainSelector] = Registry(
    "selector",
    modules=(
        "felix.strategies.selection.random",
        "felix.strategies.selection.oort",
        "felix.strategies.selection.refl",
    ),
)
EVAL_SELECTORS: Registry[EvalSelector] = Registry(
    "eval_selector", modules=("felix.strategies.selection.tierselect",)
)
AGGREGATORS: Registry[Aggregator] = Registry(
    "aggregator",
    modules=(
        "felix.strategies.aggregation.fedavg",
        "felix.strategies.aggregation.tierfuse",
        "felix.strategies.aggregation.refl_saa",
        "felix.strategies.aggregation.qffl",
    ),
)


@EVAL_SELECTORS.register("none", params=NoParams)
def _no_eval(params: NoParams, ctx: Any) -> EvalSelector:
    """No forward-pass probes."""
    return EvalSelector()


def reduce_aux(buffer: Sequence[BufferedUpdate], norm_w: np.ndarray) -> dict[str, np.ndarray]:
    """Weighted mean of each aux entry over the updates that carry it (e.g. FedeRage's beta).

    Keys starting with ``"sum:"`` are summed instead, unweighted: a server rule that adds up
    the round's contributions (SCAFFOLD's ``c += (1/N) sum dc``, the client scaling by 1/N).
    """
    keys = sorted({k for b in buffer for k in b.update.aux})
    out: dict[str, np.ndarray] = {}
    for key in keys:
        if key.startswith("sum:"):
            parts = [np.asarray(b.update.aux[key], dtype=np.float64) for b in buffer if key in b.update.aux]
            total = parts[0].copy()
            for p in parts[1:]:
                total += p
            out[key] = total
            continue
        ws = [(w, b.update.aux[key]) for w, b in zip(norm_w, buffer) if key in b.update.aux]
        total = sum(w for w, _ in ws)
        if total > 0:
            out[key] = sum((w / total) * np.asarray(v, dtype=np.float64) for w, v in ws)
    return out
