"""Server optimisers (felix.core.server_optim): each one's two-step trajectory against numbers worked
out by hand from Reddi et al.'s formulas, checkpoint and resume, the config's refusals, and sgd
being the plain step it always was."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from felix.config import ConfigError, validate
from felix.core.aggregation import Aggregator
from felix.core.server_optim import SERVER_OPTIMIZERS, ServerOptimizer
from felix.core.types import BufferedUpdate, ClientUpdate
from felix.deploy import checkpoint as ckpt
from felix.strategies.aggregation.fedavg import FedBuffAggregator
from felix.strategies.aggregation.robust import RobustAggregator

X0 = [1.0, -2.0]


def _opt(name: str, **params: float) -> ServerOptimizer:
    return SERVER_OPTIMIZERS.create(name, params)


def _buffer(*deltas: list[float]) -> list[BufferedUpdate]:
    return [
        BufferedUpdate(i, i, 0, 0.0, ClientUpdate(10, 1.0, 1.0, 1.0, np.array(d, dtype=np.float32)))
        for i, d in enumerate(deltas)
    ]


def _trajectory(agg: Aggregator, deltas: list[list[float]]) -> list[np.ndarray]:
    """Each delta as the only update of a fresh buffer: the aggregate (the pseudo-gradient) is the delta."""
    theta = np.array(X0, dtype=np.float32)
    out = []
    for d in deltas:
        theta = agg.aggregate(theta, _buffer(d))[0]
        assert theta.dtype == np.float32
        out.append(theta)
    return out


# Worked by hand (m_0 = 0, v_0 = tau^2, no bias correction):
# sgd, lr 0.5: x1 = x0 + 0.5 [0.2, -0.4]; x2 = x1 + 0.5 [0.1, 0.3].
# momentum, beta 0.5, lr 0.5: m1 = [0.2, -0.4], x1 = [1.1, -2.2]; m2 = 0.5 m1 + [0.1, 0.3] = [0.2, 0.1],
#   x2 = [1.2, -2.15].
# adam, b1 0.5, b2 0.5, tau 0.1, lr 1.2, deltas [0.1, -0.7], [-0.1, 0.5]:
#   m1 = [0.05, -0.35], v1 = 0.5 * 0.01 + 0.5 [0.01, 0.49] = [0.01, 0.25], sqrt = [0.1, 0.5],
#   x1 = x0 + 1.2 [0.05 / 0.2, -0.35 / 0.6] = [1.3, -2.7];
#   m2 = [0.025 - 0.05, -0.175 + 0.25] = [-0.025, 0.075], v2 = [0.005 + 0.005, 0.125 + 0.125] = [0.01, 0.25],
#   x2 = x1 + 1.2 [-0.025 / 0.2, 0.075 / 0.6] = [1.15, -2.55].
# adagrad, b1 0.5, tau 0.3, lr 0.8, deltas [0.4, -0.72], [-1.2, 1.04]:
#   m1 = [0.2, -0.36], v1 = 0.09 + [0.16, 0.5184] = [0.25, 0.6084], sqrt = [0.5, 0.78],
#   x1 = x0 + 0.8 [0.2 / 0.8, -0.36 / 1.08] = [1.2, -2 - 0.8 / 3];
#   m2 = [0.1 - 0.6, -0.18 + 0.52] = [-0.5, 0.34], v2 = v1 + [1.44, 1.0816] = [1.69, 1.69], sqrt = 1.3,
#   x2 = x1 + 0.8 [-0.5 / 1.6, 0.34 / 1.6] = [0.95, -2 - 0.8 / 3 + 0.17].
# yogi, b1 0.5, b2 0.75, tau 0.5, lr 2.1, deltas [0.75, -0.28], [-0.625, 0.72]:
#   v1 = 0.25 - 0.25 d^2 sign(0.25 - d^2) = [0.25 + 0.140625, 0.25 - 0.0196] = [0.390625, 0.2304],
#   sqrt = [0.625, 0.48]; m1 = [0.375, -0.14]; x1 = x0 + 2.1 [0.375 / 1.125, -0.14 / 0.98] = [1.7, -2.3];
#   v2: d^2 = [0.390625, 0.5184], sign(v1 - d^2) = [0, -1], v2 = [0.390625, 0.2304 + 0.1296] = [0.390625, 0.36],
#   sqrt = [0.625, 0.6]; m2 = [0.1875 - 0.3125, -0.07 + 0.36] = [-0.125, 0.29];
#   x2 = x1 + 2.1 [-0.125 / 1.125, 0.29 / 1.1] = [1.7 - 2.1 / 9, -2.3 + 0.609 / 1.1].
CASES = {
    "sgd": ({}, 0.5, [[0.2, -0.4], [0.1, 0.3]], [[1.1, -2.2], [1.15, -2.05]]),
    "momentum": ({"beta": 0.5}, 0.5, [[0.2, -0.4], [0.1, 0.3]], [[1.1, -2.2], [1.2, -2.15]]),
    "adam": (
        {"beta1": 0.5, "beta2": 0.5, "tau": 0.1},
        1.2,
        [[0.1, -0.7], [-0.1, 0.5]],
        [[1.3, -2.7], [1.15, -2.55]],
    ),
    "adagrad": (
        {"beta1": 0.5, "tau": 0.3},
        0.8,
        [[0.4, -0.72], [-1.2, 1.04]],
        [[1.2, -2.0 - 0.8 / 3], [0.95, -2.0 - 0.8 / 3 + 0.17]],
    ),
    "yogi": (
        {"beta1": 0.5, "beta2": 0.75, "tau": 0.5},
        2.1,
        [[0.75, -0.28], [-0.625, 0.72]],
        [[1.7, -2.3], [1.7 - 2.1 / 9, -2.3 + 0.609 / 1.1]],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_two_step_trajectory_matches_the_hand_computation(name: str) -> None:
    params, lr, deltas, expected = CASES[name]
    agg = FedBuffAggregator(lr, optimizer=_opt(name, **params))
    got = _trajectory(agg, deltas)
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        np.testing.assert_allclose(
            g, np.array(e, dtype=np.float32), rtol=2e-6, err_msg=f"{name} step {step + 1}"
        )


def test_adaptive_moments_match_the_hand_computation() -> None:
    """Adam's m and v after the two steps above, as the checkpoint holds them."""
    params, lr, deltas, _ = CASES["adam"]
    agg = FedBuffAggregator(lr, optimizer=_opt("adam", **params))
    _trajectory(agg, deltas)
    state = agg.state_dict()["server_optimizer"]
    assert state["name"] == "adam" and state["steps"] == 2
    np.testing.assert_allclose(state["m"], [-0.025, 0.075], rtol=1e-6)
    np.testing.assert_allclose(state["v"], [0.01, 0.25], rtol=1e-6)


def test_sgd_is_the_plain_float32_step() -> None:
    """The default keeps every existing run bit for bit: x + float32(lr) * (weighted mean of deltas)."""
    theta = np.array([0.3, -1.7, 2.2], dtype=np.float32)
    d1, d2 = [0.011, -0.2, 0.07], [0.5, 0.013, -0.3]
    for agg in (FedBuffAggregator(0.37), FedBuffAggregator(0.37, "count")):
        new = agg.aggregate(theta, _buffer(d1, d2))[0]
        half = np.float32(0.5)  # two fresh updates: weight 1/2 under either normalisation
        mean = half * np.array(d1, np.float32) + half * np.array(d2, np.float32)
        assert new.tobytes() == (theta + np.float32(0.37) * mean).tobytes()
        assert agg.state_dict() == {}


def test_the_optimizer_sees_the_normalised_aggregate() -> None:
    """FedBuff divided by K (the authors' normalisation): the pseudo-gradient is sum(w_i d_i) / K. Two
    fresh updates (w = 1) of [0.2, -0.4] and [0.0, 0.4] give Delta = [0.1, 0.0]; momentum's first step is
    lr * Delta, its second (the same buffer) lr * (beta * Delta + Delta)."""
    agg = FedBuffAggregator(2.0, "count", optimizer=_opt("momentum", beta=0.5))
    theta = np.array(X0, dtype=np.float32)
    theta = agg.aggregate(theta, _buffer([0.2, -0.4], [0.0, 0.4]))[0]
    np.testing.assert_allclose(theta, [1.2, -2.0], rtol=1e-6)
    theta = agg.aggregate(theta, _buffer([0.2, -0.4], [0.0, 0.4]))[0]
    np.testing.assert_allclose(theta, [1.5, -2.0], rtol=1e-6)


def test_robust_aggregation_keeps_the_inner_optimizer() -> None:
    """The median of one update is that update: the trajectory is momentum's, from the inner aggregator."""
    params, lr, deltas, expected = CASES["momentum"]
    agg = RobustAggregator(FedBuffAggregator(lr, optimizer=_opt("momentum", **params)), "median")
    np.testing.assert_allclose(_trajectory(agg, deltas)[-1], expected[-1], rtol=1e-6)
    assert agg.state_dict()["server_optimizer"]["name"] == "momentum"


@pytest.mark.parametrize("name", ["momentum", "adam", "yogi", "adagrad"])
def test_checkpoint_mid_trajectory_continues_identically(name: str, tmp_path: Path) -> None:
    params = CASES[name][0]
    rng = np.random.default_rng(7)
    deltas = [rng.normal(0, 0.1, 5).astype(np.float32).tolist() for _ in range(4)]
    live = FedBuffAggregator(0.3, optimizer=_opt(name, **params))
    theta = np.zeros(5, dtype=np.float32)
    for d in deltas[:2]:
        theta = live.aggregate(theta, _buffer(d))[0]
    ckpt.save_checkpoint(tmp_path / "ck", {"aggregator": live.state_dict()})
    restored = FedBuffAggregator(0.3, optimizer=_opt(name, **params))
    restored.load_state_dict(ckpt.load_checkpoint(tmp_path / "ck")["aggregator"])
    a = b = theta
    for d in deltas[2:]:
        a = live.aggregate(a, _buffer(d))[0]
        b = restored.aggregate(b, _buffer(d))[0]
    assert a.tobytes() == b.tobytes()
    # Without the restored moments the continuation differs: the state is what carries it.
    fresh = FedBuffAggregator(0.3, optimizer=_opt(name, **params))
    c = theta
    for d in deltas[2:]:
        c = fresh.aggregate(c, _buffer(d))[0]
    assert c.tobytes() != a.tobytes()


def test_old_checkpoints_load_and_a_mismatched_one_is_refused() -> None:
    adam = FedBuffAggregator(0.3, optimizer=_opt("adam"))
    adam.load_state_dict({})  # a checkpoint from before server optimisers: fresh moments
    assert adam.optimizer.state_dict() == {"name": "adam", "steps": 0}
    adam.aggregate(np.zeros(2, np.float32), _buffer([0.1, 0.2]))
    with pytest.raises(ValueError, match="'adam' server optimizer state; the config's .* is 'sgd'"):
        FedBuffAggregator(0.3).load_state_dict(adam.state_dict())
    with pytest.raises(ValueError, match="'adam' server optimizer state; the config's .* is 'yogi'"):
        FedBuffAggregator(0.3, optimizer=_opt("yogi")).load_state_dict(adam.state_dict())


@pytest.mark.parametrize(
    ("aggregator", "message"),
    [
        ({"server_optimizer": "adamw"}, "unknown server optimizer 'adamw'"),
        (
            {"server_optimizer": "adam", "server_optimizer_params": {"beta1": 1.0}},
            r"beta1 must lie in \[0, 1\)",
        ),
        (
            {"server_optimizer": "yogi", "server_optimizer_params": {"beta2": -0.1}},
            r"beta2 must lie in \[0, 1\)",
        ),
        ({"server_optimizer": "adagrad", "server_optimizer_params": {"tau": 0}}, "tau must be > 0"),
        (
            {"server_optimizer": "momentum", "server_optimizer_params": {"beta": 1.2}},
            r"beta must lie in \[0, 1\)",
        ),
        ({"server_optimizer": "adagrad", "server_optimizer_params": {"beta2": 0.9}}, "beta2: unknown key"),
        ({"server_optimizer_params": {"beta": 0.9}}, "beta: unknown key"),
        (
            {"name": "qffl", "params": {"q": 1.0}, "server_optimizer": "adam"},
            "'qffl' takes its own server step",
        ),
    ],
)
def test_bad_settings_are_refused_at_config_read(aggregator: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as exc:
        validate({"aggregator": aggregator})
    assert len(str(exc.value).splitlines()) == 1  # one line, naming the key


def test_good_settings_validate() -> None:
    cfg = validate({"aggregator": {"server_optimizer": "yogi", "server_optimizer_params": {"tau": 0.01}}})
    assert cfg.aggregator.server_optimizer == "yogi"
    assert validate({}).aggregator.server_optimizer == "sgd"
