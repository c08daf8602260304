"""q-FFL (q-FedAvg) and the IPS oracle aggregator, pinned to hand-computed steps."""

from __future__ import annotations

import numpy as np
import pytest

from felix.core.types import BufferedUpdate, ClientUpdate
from felix.strategies.aggregation.ips import IPSAggregator
from felix.strategies.aggregation.qffl import QFFLAggregator


def _item(cid: int, delta: list[float], loss: float, n: int = 10, aux: dict | None = None) -> BufferedUpdate:
    return BufferedUpdate(
        cid, cid, 0, 0.0, ClientUpdate(n, 0.0, loss, 0.0, np.array(delta, np.float32), aux or {})
    )


def test_qffl_hand_computed_step() -> None:
    # q = 1, L = 2; A: delta [1, 0], F = 2;  B: delta [0, 2], F = 0.5
    # Delta_A = -L delta = [-2, 0], |.|^2 = 4;  Delta_B = [0, -4], |.|^2 = 16
    # h_A = q F^0 4 + L F = 4 + 4 = 8;  h_B = 16 + 2 * 0.5 = 17;  sum h = 25
    # sum F^q Delta = 2 [-2, 0] + 0.5 [0, -4] = [-4, -2];  w = 0 - [-4, -2] / 25 = [0.16, 0.08]
    agg = QFFLAggregator(q=1.0, lipschitz=2.0)
    buf = [
        _item(0, [1, 0], 9.9, aux={"qffl_loss": np.array(2.0)}),
        _item(1, [0, 2], 9.9, aux={"qffl_loss": np.array(0.5)}),
    ]
    theta, w, aux = agg.aggregate(np.zeros(2, np.float32), buf)
    np.testing.assert_allclose(theta, [0.16, 0.08], rtol=1e-6)
    assert theta.dtype == np.float32
    np.testing.assert_allclose(w, [0.8, 0.2])  # F^q shares: 2 / 2.5, 0.5 / 2.5
    assert "qffl_loss" not in aux  # consumed by the server, not broadcast


def test_qffl_q_zero_is_the_uniform_mean_of_deltas() -> None:
    # q = 0: h_k = L, so w - sum(-L delta_k) / (K L) = w + mean(delta)
    agg = QFFLAggregator(q=0.0, lipschitz=25.0)
    buf = [_item(0, [1, 0], 3.0, n=1), _item(1, [0, 2], 0.1, n=100), _item(2, [3, 1], 0.0, n=5)]
    theta, _, _ = agg.aggregate(np.ones(2, np.float32), buf)
    np.testing.assert_allclose(theta, [1 + 4 / 3, 1 + 1.0], rtol=1e-6)


def test_qffl_falls_back_to_the_mean_training_loss_and_passes_other_aux() -> None:
    agg = QFFLAggregator(q=1.0, lipschitz=2.0)
    buf = [
        _item(0, [1, 0], 2.0, aux={"federage_beta": np.array(1.0)}),
        _item(1, [0, 2], 0.5, aux={"federage_beta": np.array(3.0)}),
    ]
    theta, _, aux = agg.aggregate(np.zeros(2, np.float32), buf)
    np.testing.assert_allclose(theta, [0.16, 0.08], rtol=1e-6)
    assert float(aux["federage_beta"]) == pytest.approx(0.8 * 1.0 + 0.2 * 3.0)


def test_qffl_validation() -> None:
    with pytest.raises(ValueError, match="q must be"):
        QFFLAggregator(q=-1.0, lipschitz=1.0)
    with pytest.raises(ValueError, match="lipschitz"):
        QFFLAggregator(q=1.0, lipschitz=0.0)
    with pytest.raises(ValueError, match="reported loss"):
        QFFLAggregator(q=1.0, lipschitz=1.0).aggregate(
            np.zeros(2, np.float32), [_item(0, [1, 0], float("nan"))]
        )


def test_ips_weights_by_samples_over_probability() -> None:
    # weights n / p: 10 / 0.5 = 20 and 10 / 0.05 = 200 -> normalised 1/11, 10/11
    agg = IPSAggregator({0: 0.5, 1: 0.05})
    theta, w, _ = agg.aggregate(np.zeros(2, np.float32), [_item(0, [1.1, 0], 0.0), _item(1, [0, 1.1], 0.0)])
    np.testing.assert_allclose(w, [1 / 11, 10 / 11])
    np.testing.assert_allclose(theta, [0.1, 1.0], rtol=1e-6)


def test_ips_validation() -> None:
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        IPSAggregator({0: 0.0})
    with pytest.raises(ValueError, match="no participation probability for client 3"):
        IPSAggregator({0: 0.5}).aggregate(np.zeros(2, np.float32), [_item(3, [1, 0], 0.0)])


def test_qffl_falls_back_to_the_data_loss_of_a_federage_client() -> None:
    """A FedeRage client reports its data loss, not w * f: q-FFL's fallback weight F^q is the same
    as for a plain-CE client whose first batch (the whole task here) saw the same data."""
    import torch
    from torch import nn
    from torch.nn.utils import parameters_to_vector

    from felix.client.trainer import ClientData, LocalTrainer, TrainConfig
    from felix.strategies.objectives import make_objective

    g = torch.Generator().manual_seed(0)
    data = ClientData(torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g))
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    w0 = parameters_to_vector(model.parameters()).detach().numpy().copy()
    cfg = TrainConfig(lr=0.1, batch_size=16, max_steps=1)
    agg = QFFLAggregator(q=2.0, lipschitz=10.0)
    weights = []
    for name, params in (("ce", {}), ("federage", {"alpha": 0.05, "gamma": 1.0, "step_rule": "paper"})):
        upd = LocalTrainer(model, make_objective(name, **params), cfg, 2).train(
            w0, data, {}, {}, torch.Generator().manual_seed(1)
        )
        weights.append(agg.weight(BufferedUpdate(0, 0, 0, 0.0, upd)))
    assert weights[0] == weights[1] > 0  # beta0 = 0: the batch is above beta, w = 20, yet F is f
