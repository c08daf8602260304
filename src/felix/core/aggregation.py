"""The aggregation axis: how the buffered updates become the next model.

``Aggregator`` owns the buffer arithmetic (weighted mean of deltas, normalisation, the server
step through its server optimiser, ``felix.core.server_optim``); a subclass owns one decision,
each update's weight. Built-in aggregators live in
``felix.strategies.aggregation`` and register in ``AGGREGATORS`` next to their classes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from felix.core.registry import Registry
from felix.core.server_optim import ServerOptimizer
from felix.core.types import BufferedUpdate
from felix.core.validation import AuxDecl


class SumMechanism(Protocol):
    """What a privacy mechanism offers the aggregation (``felix.privacy.CentralGaussian``): the
    noised mean update of a buffer from its weights, and each update's effective weight; its state
    (the noise generator) rides in the aggregator's checkpoint."""

    def noised_step(
        self, buffer: Sequence[BufferedUpdate], weights: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Aggregator:
    """Owns the buffer arithmetic: weighted mean of deltas, normalisation and the server step.

    ``normalize="weights"`` divides by the sum of weights (the paper's TierFuse, FedBuff as in
    FedScale); ``"count"`` divides by the number of buffered updates (the FeLiX authors' code).
    ``optimizer`` turns that normalised update and ``server_lr`` into the next model (plain
    ``x + server_lr * update`` by default); the run's builder sets the configured one
    (``aggregator.server_optimizer``) after the aggregator is made, and ``privacy``, the
    mechanism that forms the sum instead when ``privacy:`` is on (None: the plain weighted mean).
    """

    name = "base"

    def __init__(
        self,
        server_lr: float = 1.0,
        normalize: str = "weights",
        clip_norm: float | None = None,
        optimizer: ServerOptimizer | None = None,
    ):
        if normalize not in ("weights", "count"):
            raise ValueError(f"normalize must be 'weights' or 'count', not {normalize!r}")
        if server_lr <= 0:
            raise ValueError("server_lr must be positive")
        self.server_lr = server_lr
        self.normalize = normalize
        self.clip_norm = clip_norm
        self.optimizer = optimizer if optimizer is not None else ServerOptimizer()
        self.privacy: SumMechanism | None = None

    def declared_aux(self, num_params: int) -> dict[str, AuxDecl]:
        """Aux entries this aggregator reads from updates beyond the objective's (see
        ``felix.core.validation``); the server rejects any entry neither declares."""
        return {}

    def weight(self, item: BufferedUpdate) -> float:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint state, as ``TrainSelector.state_dict``: the server optimiser's moments, if
        it keeps any (the weights' parameters come from the config)."""
        opt = self.optimizer.state_dict()
        state: dict[str, Any] = {"server_optimizer": opt} if opt else {}
        if self.privacy is not None:
            state["privacy"] = self.privacy.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned. A checkpoint from before server optimisers (or
        saved before the first aggregation) has no optimiser state: the moments start afresh."""
        if "server_optimizer" in state:
            self.optimizer.load_state_dict(state["server_optimizer"])
        if self.privacy is not None and "privacy" in state:
            self.privacy.load_state_dict(state["privacy"])

    def weights(self, buffer: Sequence[BufferedUpdate]) -> np.ndarray:
        return np.array([self.weight(b) for b in buffer], dtype=np.float64)

    def aggregate(
        self, theta: np.ndarray, buffer: Sequence[BufferedUpdate]
    ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """Return the new parameters, the normalised weights and the reduced aux state."""
        w = self.weights(buffer)
        if self.privacy is not None:
            step, norm_w = self.privacy.noised_step(buffer, w)
            new_theta = self.optimizer.step(theta, step, self.server_lr)
            return new_theta, norm_w, reduce_aux(buffer, norm_w)
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
        new_theta = self.optimizer.step(theta, step, self.server_lr)
        return new_theta, norm_w, reduce_aux(buffer, norm_w)


AGGREGATORS: Registry[Aggregator] = Registry(
    "aggregator",
    modules=(
        "felix.strategies.aggregation.fedavg",
        "felix.strategies.aggregation.tierfuse",
        "felix.strategies.aggregation.refl_saa",
        "felix.strategies.aggregation.qffl",
    ),
)


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


__all__ = ["AGGREGATORS", "Aggregator", "SumMechanism", "reduce_aux"]
