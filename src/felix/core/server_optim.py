"""Server optimisers: how the aggregated update moves the global model.

An aggregator reduces a buffer to one update, the pseudo-gradient ``Delta`` (the weighted mean of
the deltas under its normalisation: the sum of the weights, or the buffer size). The server
optimiser turns ``Delta`` and the server learning rate ``eta`` into the next model. ``sgd`` is the
plain step every aggregator took so far; the others are the adaptive server optimisers of Reddi
et al., ICLR 2021, "Adaptive Federated Optimization" (Algorithm 2), and server momentum (FedAvgM,
Hsu et al. 2019; FedBuff's server optimiser). With ``Delta_t`` the t-th aggregation's update:

    sgd       x <- x + eta Delta
    momentum  m <- beta m + Delta;                                  x <- x + eta m
    adagrad   m <- b1 m + (1 - b1) Delta;  v <- v + Delta^2;          x <- x + eta m / (sqrt(v) + tau)
    adam      m <- b1 m + (1 - b1) Delta;  v <- b2 v + (1 - b2) Delta^2;  x <- ...
    yogi      m <- b1 m + (1 - b1) Delta;  v <- v - (1 - b2) Delta^2 sign(v - Delta^2);  x <- ...

with m starting at 0 and v at tau^2 (the paper's v_{-1} >= tau^2), element-wise, without Adam's bias
correction (the paper has none; Flower's FedAdam adds one). ``tau`` is the paper's adaptivity: the
larger it is, the closer the step is to ``eta m / tau``. The state (m, v) is kept in float64 and
belongs to the aggregator, so it is checkpointed with it (``Aggregator.state_dict``).

Pure numpy: the orchestrator core holds no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from felix.core.registry import NoParams, Registry, params_from_dataclass


class ServerOptimizer:
    """Plain server SGD: ``x + eta Delta``, in float32 as the model, with no state."""

    name = "sgd"

    def step(self, theta: np.ndarray, delta: np.ndarray, lr: float) -> np.ndarray:
        """The next model from the current one, the aggregated update and the server lr."""
        return theta + np.float32(lr) * delta

    def state_dict(self) -> dict[str, Any]:
        """Plain data for a checkpoint; empty for a stateless optimiser."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output; a state saved by another optimiser is refused."""
        if state:
            raise ValueError(
                f"the checkpoint holds {state.get('name')!r} server optimizer state; "
                f"the config's aggregator.server_optimizer is {self.name!r}"
            )


@dataclass(frozen=True, slots=True)
class MomentumParams:
    """``beta``: the momentum, 0.9 as in FedAvgM's and FedBuff's experiments (0: plain sgd)."""

    beta: float = 0.9

    def __post_init__(self) -> None:
        if not 0.0 <= self.beta < 1.0:
            raise ValueError(f"beta must lie in [0, 1), not {self.beta}")


@dataclass(frozen=True, slots=True)
class AdaptiveParams:
    """Reddi et al.'s settings: ``beta1`` 0.9, ``beta2`` 0.99, adaptivity ``tau`` 1e-3 (their
    tuned tau lies in 1e-5 .. 1e-1); ``adagrad`` reads no ``beta2``."""

    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3

    def __post_init__(self) -> None:
        for key in ("beta1", "beta2"):
            value = getattr(self, key)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{key} must lie in [0, 1), not {value}")
        if not self.tau > 0:
            raise ValueError(f"tau must be > 0, not {self.tau}")


@dataclass(frozen=True, slots=True)
class AdagradParams:
    """As ``AdaptiveParams`` without ``beta2`` (Adagrad sums the squares, undecayed)."""

    beta1: float = 0.9
    tau: float = 1e-3

    def __post_init__(self) -> None:
        AdaptiveParams(beta1=self.beta1, tau=self.tau)


class _Stateful(ServerOptimizer):
    """Element-wise state vectors, created at the first step with the model's shape."""

    _keys: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.steps = 0
        self.state: dict[str, np.ndarray] = {}

    def _vectors(self, delta: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        d = np.asarray(delta, dtype=np.float64)
        for k, v in self.state.items():
            if v.shape != d.shape:
                raise ValueError(f"{self.name}: state {k} has shape {v.shape}, the update {d.shape}")
        return d, self.state

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "steps": self.steps, **{k: v.copy() for k, v in self.state.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(
                f"the checkpoint holds {state.get('name')!r} server optimizer state; "
                f"the config's aggregator.server_optimizer is {self.name!r}"
            )
        self.steps = int(state["steps"])
        self.state = {k: np.array(state[k], dtype=np.float64) for k in self._keys if k in state}


class Momentum(_Stateful):
    """Server momentum (FedAvgM): ``m <- beta m + Delta; x <- x + eta m``."""

    name = "momentum"
    _keys = ("m",)

    def __init__(self, params: MomentumParams) -> None:
        super().__init__()
        self.params = params

    def step(self, theta: np.ndarray, delta: np.ndarray, lr: float) -> np.ndarray:
        d, s = self._vectors(delta)
        s["m"] = self.params.beta * s["m"] + d if "m" in s else d.copy()
        self.steps += 1
        return (theta.astype(np.float64) + lr * s["m"]).astype(theta.dtype)


class _Adaptive(_Stateful):
    """FedAdagrad / FedAdam / FedYogi: ``x <- x + eta m / (sqrt(v) + tau)``; subclasses give v's update."""

    _keys = ("m", "v")

    def __init__(self, beta1: float, beta2: float, tau: float) -> None:
        super().__init__()
        self.beta1, self.beta2, self.tau = beta1, beta2, tau

    def second_moment(self, v: np.ndarray, sq: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def step(self, theta: np.ndarray, delta: np.ndarray, lr: float) -> np.ndarray:
        d, s = self._vectors(delta)
        m = s.get("m", np.zeros_like(d))
        v = s.get("v", np.full_like(d, self.tau * self.tau))
        s["m"] = self.beta1 * m + (1.0 - self.beta1) * d
        s["v"] = self.second_moment(v, d * d)
        self.steps += 1
        return (theta.astype(np.float64) + lr * s["m"] / (np.sqrt(s["v"]) + self.tau)).astype(theta.dtype)


class Adagrad(_Adaptive):
    name = "adagrad"

    def second_moment(self, v: np.ndarray, sq: np.ndarray) -> np.ndarray:
        return v + sq


class Adam(_Adaptive):
    name = "adam"

    def second_moment(self, v: np.ndarray, sq: np.ndarray) -> np.ndarray:
        return self.beta2 * v + (1.0 - self.beta2) * sq


class Yogi(_Adaptive):
    name = "yogi"

    def second_moment(self, v: np.ndarray, sq: np.ndarray) -> np.ndarray:
        return v - (1.0 - self.beta2) * sq * np.sign(v - sq)


SERVER_OPTIMIZERS: Registry[ServerOptimizer] = Registry("server optimizer", key="aggregator.server_optimizer")


@SERVER_OPTIMIZERS.register("sgd", params=NoParams)
def _sgd(params: Any, ctx: Any) -> ServerOptimizer:
    return ServerOptimizer()


@SERVER_OPTIMIZERS.register("momentum", params=params_from_dataclass(MomentumParams, "MomentumModel"))
def _momentum(params: Any, ctx: Any) -> Momentum:
    return Momentum(MomentumParams(**params.model_dump()))


@SERVER_OPTIMIZERS.register("adagrad", params=params_from_dataclass(AdagradParams, "AdagradModel"))
def _adagrad(params: Any, ctx: Any) -> Adagrad:
    p = AdagradParams(**params.model_dump())
    return Adagrad(p.beta1, 0.0, p.tau)


@SERVER_OPTIMIZERS.register("adam", params=params_from_dataclass(AdaptiveParams, "AdamModel"))
def _adam(params: Any, ctx: Any) -> Adam:
    p = AdaptiveParams(**params.model_dump())
    return Adam(p.beta1, p.beta2, p.tau)


@SERVER_OPTIMIZERS.register("yogi", params=params_from_dataclass(AdaptiveParams, "YogiModel"))
def _yogi(params: Any, ctx: Any) -> Yogi:
    p = AdaptiveParams(**params.model_dump())
    return Yogi(p.beta1, p.beta2, p.tau)


__all__ = [
    "SERVER_OPTIMIZERS",
    "Adagrad",
    "AdagradParams",
    "Adam",
    "AdaptiveParams",
    "Momentum",
    "MomentumParams",
    "ServerOptimizer",
    "Yogi",
]
