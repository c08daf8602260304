"""Client objectives: FedeRage's risk weight and beta step, and the baselines' losses and hooks."""

from __future__ import annotations

import copy
import math
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector

from felix.client.trainer import ClientData, LocalTrainer, TrainConfig
from felix.core.policies import reduce_aux
from felix.core.types import BufferedUpdate, ClientUpdate
from felix.strategies.objectives import (
    FedeRage,
    OneClient,
    TaskContext,
    balanced_low_weight,
    beta_step,
    inverse_frequency_weights,
    make_objective,
    max_risk_weight,
    risk_weight,
)


def _ctx(
    model: nn.Module,
    num_classes: int = 2,
    lr: float = 0.1,
    aux_in: dict | None = None,
    state: dict | None = None,
    counts: list[int] | None = None,
) -> TaskContext:
    flat = parameters_to_vector(model.parameters()).detach().clone()
    return TaskContext(
        model=model,
        global_params=flat,
        lr=lr,
        num_classes=num_classes,
        class_counts=torch.tensor(counts or [1] * num_classes),
        state={} if state is None else state,
        aux_in={} if aux_in is None else aux_in,
    )


def _per(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, y, reduction="none")


def _beta(hooks: OneClient) -> float:
    return float(hooks.extra["beta"][0])


def _data(n: int = 40, d: int = 5, classes: int = 3, seed: int = 0) -> ClientData:
    g = torch.Generator().manual_seed(seed)
    return ClientData(torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g))


def _mlp(d: int = 5, classes: int = 3, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 8), nn.ReLU(), nn.Linear(8, classes))


def _train(
    objective_name: str,
    seed: int = 0,
    state: dict | None = None,
    aux_in: dict | None = None,
    lr: float = 0.1,
    epochs: int = 3,
    **params,
) -> tuple[ClientUpdate, dict]:
    model = _mlp()
    w0 = parameters_to_vector(model.parameters()).detach().numpy().copy()
    trainer = LocalTrainer(
        model,
        make_objective(objective_name, **params),
        TrainConfig(lr=lr, batch_size=8, epochs=epochs),
        num_classes=3,
    )
    state = {} if state is None else state
    upd = trainer.train(w0, _data(), state, aux_in or {}, torch.Generator().manual_seed(seed))
    return upd, state


# ------------------------------------------------------------------ FedeRage
def test_risk_weight_hand_values() -> None:
    # alpha = 0.25, gamma = 0.6: (1 - 0.6) + (0.6 / 0.25) * 1{f >= beta} = 0.4 + 2.4 * 1{...}
    assert risk_weight(2.0, 1.5, alpha=0.25, gamma=0.6) == pytest.approx(2.8)  # above: 0.4 + 2.4
    assert risk_weight(1.0, 1.5, alpha=0.25, gamma=0.6) == pytest.approx(0.4)  # below: 0.4 + 0
    assert risk_weight(1.5, 1.5, alpha=0.25, gamma=0.6) == pytest.approx(2.8)  # f == beta counts as above
    assert risk_weight(7.0, 0.0, alpha=0.3, gamma=0.0) == 1.0  # gamma = 0: FedAvg's weight, exactly
    assert risk_weight(7.0, 0.0, alpha=1.0, gamma=0.9) == pytest.approx(1.0)  # alpha = 1: CVaR_1 = mean


def test_beta_subgradient_step_and_projection() -> None:
    # beta <- Proj_[0,10](beta - lr (1 - w)), lr = 0.1
    assert beta_step(1.5, 2.8, 0.1, 0.0, 10.0) == pytest.approx(1.68)  # 1.5 - 0.1 * (1 - 2.8) = 1.5 + 0.18
    assert beta_step(1.5, 0.4, 0.1, 0.0, 10.0) == pytest.approx(1.44)  # 1.5 - 0.1 * (1 - 0.4) = 1.5 - 0.06
    assert beta_step(9.95, 2.8, 0.1, 0.0, 10.0) == 10.0  # 9.95 + 0.18 = 10.13 -> projected to 10
    assert beta_step(0.03, 0.4, 0.1, 0.0, 10.0) == 0.0  # 0.03 - 0.06 = -0.03 -> projected to 0


def test_federage_one_step_scales_gradient_and_moves_beta() -> None:
    torch.manual_seed(1)
    model = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    y = torch.tensor([0, 1, 1, 0])
    ref = nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    f = F.cross_entropy(ref(x), y)
    f.backward()
    lr, alpha, gamma = 0.1, 0.25, 0.6
    beta0 = float(f.detach()) - 0.01  # the batch is above beta: w = 0.4 + 2.4 = 2.8
    obj = FedeRage(alpha=alpha, gamma=gamma, beta_init=beta0, step_rule="paper")
    ctx = _ctx(model, lr=lr)
    hooks = OneClient(obj, ctx)
    loss = hooks.loss(_per(model(x), y), y)
    assert float(loss.detach()) == pytest.approx(float(f.detach()))  # the data loss, never w * f
    loss.backward()
    hooks.before_step()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    hooks.after_step()
    hooks.end()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q.detach() - lr * 2.8 * q.grad)
    assert _beta(hooks) == pytest.approx(beta0 + 0.1 * 1.8)  # beta - lr (1 - 2.8)
    assert ctx.state["federage_beta"] == pytest.approx(beta0 + 0.18)
    assert ctx.aux_out["federage_beta"].dtype == np.float64
    assert float(ctx.aux_out["federage_beta"]) == pytest.approx(beta0 + 0.18)


def _one_federage_step(obj: FedeRage, lr: float, above: bool) -> tuple[nn.Module, nn.Module, float]:
    """One hand-driven step of ``obj`` on a fixed batch; returns the stepped model, a copy of the
    start with its plain CE gradient, and the batch loss (the beta after the step: ``obj.beta``)."""
    torch.manual_seed(1)
    model = nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    ref = nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    f = F.cross_entropy(ref(x), y)
    f.backward()
    obj.beta_init = float(f.detach()) + (-0.01 if above else 0.01)
    ctx = _ctx(model, lr=lr)
    hooks = OneClient(obj, ctx)
    hooks.loss(_per(model(x), y), y).backward()
    hooks.before_step()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    hooks.after_step()
    obj.beta = _beta(hooks)  # type: ignore[attr-defined]
    return model, ref, float(f.detach())


@pytest.mark.parametrize("above", [True, False])
def test_federage_normalised_rule_is_the_paper_step_over_kappa(above: bool) -> None:
    lr, alpha, gamma = 0.1, 0.25, 0.6
    kappa = max_risk_weight(alpha, gamma)
    assert kappa == pytest.approx(2.8)
    w = 2.8 if above else 0.4
    obj = FedeRage(alpha=alpha, gamma=gamma, step_rule="normalised")
    model, ref, f = _one_federage_step(obj, lr, above)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q.detach() - lr * (w / kappa) * q.grad)
    beta0 = f + (-0.01 if above else 0.01)
    assert obj.beta == pytest.approx(beta0 - lr * (1 - w) / kappa)


def test_federage_normalised_steps_stay_bounded_at_small_alpha() -> None:
    """At alpha 0.05, gamma 1 the paper's step is 20x FedAvg's; the normalised one never exceeds it,
    and beta moves by at most beta_lr a step whatever alpha is."""
    lr = 0.1
    paper, ref, _ = _one_federage_step(FedeRage(alpha=0.05, gamma=1.0, step_rule="paper"), lr, above=True)
    norm_obj = FedeRage(alpha=0.05, gamma=1.0, step_rule="normalised", beta_lr=0.02)
    normed, _, f = _one_federage_step(norm_obj, lr, above=True)
    sgd = [q.detach() - lr * q.grad for q in ref.parameters()]
    for p, n, s in zip(paper.parameters(), normed.parameters(), sgd):
        torch.testing.assert_close(n, s)  # w / kappa = 1 for a batch above beta
        torch.testing.assert_close(
            p,
            s
            - 19
            * lr
            * (ref.get_parameter("weight").grad if p.dim() == 2 else ref.get_parameter("bias").grad),
        )
    assert norm_obj.beta - (f - 0.01) == pytest.approx(0.02 * 0.95)  # beta_lr (1 - alpha)


@pytest.mark.parametrize("above, alpha, w_theta", [(True, 0.1, 2.0), (False, 0.1, 0.5), (True, 0.5, 1.5)])
def test_federage_capped_rule(above: bool, alpha: float, w_theta: float) -> None:
    """Capped: theta's weight is min(w, 2) (the paper's step when kappa <= 2, e.g. alpha 0.5, gamma
    0.5); beta steps as under the normalised rule."""
    lr, gamma = 0.1, 0.5
    w = risk_weight(1.0 if above else 0.0, 0.5, alpha, gamma)
    obj = FedeRage(alpha=alpha, gamma=gamma, step_rule="capped")
    model, ref, f = _one_federage_step(obj, lr, above)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q.detach() - lr * w_theta * q.grad)
    beta0 = f + (-0.01 if above else 0.01)
    assert obj.beta == pytest.approx(beta0 - lr * (1 - w) / max_risk_weight(alpha, gamma))


@pytest.mark.parametrize(
    "above, alpha, gamma, w_theta",
    [
        (True, 0.1, 0.5, 2.0),
        (False, 0.1, 0.5, 0.8 / 0.9),  # (1 - alpha cap) / (1 - alpha)
        (True, 0.05, 1.0, 2.0),
        (False, 0.05, 1.0, 0.9 / 0.95),  # gamma 1: the paper gives a batch below beta no step at all
        (True, 0.5, 0.5, 1.5),  # kappa = 1.5 <= cap: the paper's weights
        (False, 0.5, 0.5, 0.5),
    ],
)
def test_federage_balanced_rule(above: bool, alpha: float, gamma: float, w_theta: float) -> None:
    """Balanced: above beta min(kappa, cap), below it the weight that keeps the mean at 1; beta steps
    as under the normalised rule."""
    lr = 0.1
    w = risk_weight(1.0 if above else 0.0, 0.5, alpha, gamma)
    obj = FedeRage(alpha=alpha, gamma=gamma, step_rule="balanced")
    model, ref, f = _one_federage_step(obj, lr, above)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q.detach() - lr * w_theta * q.grad)
    beta0 = f + (-0.01 if above else 0.01)
    assert obj.beta == pytest.approx(beta0 - lr * (1 - w) / max_risk_weight(alpha, gamma))


@pytest.mark.parametrize("cap", [1.0, 2.0, 3.0])
@pytest.mark.parametrize("alpha", [0.05, 0.1, 0.2, 0.3, 0.5, 0.9])
@pytest.mark.parametrize("gamma", [0.25, 0.5, 1.0])
def test_federage_balanced_and_paper_weights_average_one(alpha: float, gamma: float, cap: float) -> None:
    """With a fraction alpha of the batches above beta, the paper's and the balanced weights both
    average 1 (FedAvg's mean step); capped's average less once kappa > cap. Balanced stays within
    [1 - gamma, cap]."""

    def mean_weight(rule: str) -> float:
        obj = FedeRage(alpha=alpha, gamma=gamma, step_rule=rule, weight_cap=cap)
        return (1 - alpha) * obj._theta_lo + alpha * obj._theta_hi

    assert mean_weight("paper") == pytest.approx(1.0)
    assert mean_weight("balanced") == pytest.approx(1.0)
    bal = FedeRage(alpha=alpha, gamma=gamma, step_rule="balanced", weight_cap=cap)
    assert 1 - gamma - 1e-12 <= bal._theta_lo <= 1.0 <= bal._theta_hi <= max(cap, 1.0)
    if max_risk_weight(alpha, gamma) > cap:
        assert mean_weight("capped") < 1.0
    with pytest.raises(ValueError, match="balanced weights"):
        balanced_low_weight(1.0, 1.0)


def test_federage_after_a_task_is_still_copyable_and_holds_no_graph() -> None:
    """The objective keeps no task's tensors or graph (beta lives in the trainer's ``extra``): a
    trained objective deep-copies and pickles (Ray ships objectives to actors) and trains on as
    before, and the task's last beta is what the update reports and the state keeps."""
    objective = make_objective("federage", alpha=0.3, gamma=0.5)
    trainer = LocalTrainer(_mlp(), objective, TrainConfig(lr=0.1, batch_size=8), num_classes=3)
    w0 = parameters_to_vector(trainer.model.parameters()).detach().numpy().copy()
    state: dict = {}
    upd = trainer.train(w0, _data(), state, {}, torch.Generator().manual_seed(0))
    assert not any(isinstance(v, torch.Tensor) and v.requires_grad for v in vars(objective).values())
    for clone in (copy.deepcopy(objective), pickle.loads(pickle.dumps(objective))):
        again = LocalTrainer(_mlp(), clone, TrainConfig(lr=0.1, batch_size=8), num_classes=3)
        twin = again.train(w0, _data(), {}, {}, torch.Generator().manual_seed(0))
        assert np.array_equal(twin.delta, upd.delta) and twin.aux["federage_beta"] == upd.aux["federage_beta"]
    assert state["federage_beta"] == float(upd.aux["federage_beta"])


def test_federage_separate_beta_learning_rate() -> None:
    obj = FedeRage(alpha=0.25, gamma=0.6, step_rule="paper", beta_lr=0.01)
    model, ref, f = _one_federage_step(obj, 0.1, above=True)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q.detach() - 0.1 * 2.8 * q.grad)  # theta keeps the model lr
    assert obj.beta == pytest.approx(f - 0.01 + 0.01 * 1.8)


@pytest.mark.parametrize("rule", ["paper", "normalised", "capped", "balanced"])
def test_federage_reports_the_data_loss(rule: str) -> None:
    """The trainer's loss is the data loss (q-FFL and TierFuse read it), identical to plain CE's on
    the same first batch from the same weights."""
    ce, _ = _train("ce", seed=2, epochs=1, lr=0.1)
    model = _mlp()
    w0 = parameters_to_vector(model.parameters()).detach().numpy().copy()
    cfg = TrainConfig(lr=0.1, batch_size=8, max_steps=1)
    upd_ce = LocalTrainer(_mlp(), make_objective("ce"), cfg, 3).train(
        w0, _data(), {}, {}, torch.Generator().manual_seed(2)
    )
    upd_fr = LocalTrainer(
        model, make_objective("federage", alpha=0.1, gamma=1.0, step_rule=rule), cfg, 3
    ).train(w0, _data(), {}, {}, torch.Generator().manual_seed(2))
    assert upd_fr.loss == upd_ce.loss > 0  # beta0 = 0: the batch is above beta, w = 10, yet loss = f
    assert ce.loss > 0


def test_federage_asks_for_a_fixed_model_batch() -> None:
    assert FedeRage().fixed_batch and not FedeRage(fixed_batch=False).fixed_batch
    assert not getattr(make_objective("ce"), "fixed_batch", False)


def test_federage_gamma_zero_is_fedavg_bit_for_bit() -> None:
    ce, _ = _train("ce", seed=7)
    fr, state = _train("federage", seed=7, alpha=0.1, gamma=0.0, beta_init=0.5)
    assert ce.delta is not None and fr.delta is not None
    assert np.abs(ce.delta).max() > 0
    assert np.array_equal(ce.delta, fr.delta)
    other, _ = _train("federage", seed=7, alpha=0.5, gamma=0.5, step_rule="paper")
    assert other.delta is not None and not np.array_equal(ce.delta, other.delta)  # gamma > 0 does change it
    assert ce.loss == fr.loss
    assert state["federage_beta"] == 0.5  # 1 - w = 0 every step


def test_federage_starts_from_server_beta_else_its_own() -> None:
    model = _mlp()
    obj = FedeRage(beta_max=5.0)
    ctx = _ctx(model, aux_in={"federage_beta": np.array(3.25)}, state={"federage_beta": 1.0})
    assert obj.begin([ctx])["beta"].tolist() == [3.25]  # Algorithm 2's averaged beta, like theta
    assert obj.begin([_ctx(model, aux_in={"federage_beta": np.array([9.0])})])["beta"].tolist() == [
        5.0
    ]  # on B
    # no server average yet: the client's kept beta; a stack of clients, each its own
    two = [_ctx(model, state={"federage_beta": 1.0}), ctx]
    assert obj.begin(two)["beta"].tolist() == [1.0, 3.25]
    local = FedeRage(beta_from_server=False)
    local_ctx = _ctx(model, aux_in={"federage_beta": np.array(3.25)}, state={"federage_beta": 1.0})
    assert local.begin([local_ctx])["beta"].tolist() == [1.0]


def test_federage_keeps_beta_across_tasks_and_server_averages_it() -> None:
    _, state = _train("federage", seed=3, alpha=0.5, gamma=1.0, epochs=1)
    assert 0.0 < state["federage_beta"] <= 10.0  # losses ~1.1 > beta0 = 0: beta rose
    upd_a, _ = _train("federage", seed=3, epochs=1)
    upd_b, _ = _train("federage", seed=4, epochs=1, aux_in={"federage_beta": np.array(2.0)})
    buf = [BufferedUpdate(0, 1, 0, 0.0, upd_a), BufferedUpdate(1, 2, 0, 0.0, upd_b)]
    aux = reduce_aux(buf, np.array([0.25, 0.75]))
    expect = 0.25 * float(upd_a.aux["federage_beta"]) + 0.75 * float(upd_b.aux["federage_beta"])
    assert float(aux["federage_beta"]) == pytest.approx(expect)


@pytest.mark.parametrize(
    "params",
    [
        {"alpha": 0.0},
        {"alpha": 1.5},
        {"gamma": -0.1},
        {"gamma": 1.1},
        {"beta_min": 2.0, "beta_max": 1.0},
        {"beta_init": 11.0},
        {"step_rule": "nope"},
        {"beta_lr": 0.0},
        {"beta_lr": float("nan")},
        {"weight_cap": 0.5},
        {"weight_cap": float("inf")},
    ],
)
def test_federage_validation(params: dict) -> None:
    with pytest.raises(ValueError, match="federage"):
        FedeRage(**params)


def test_unknown_objective_and_bad_params() -> None:
    with pytest.raises(ValueError, match="unknown objective 'nope'"):
        make_objective("nope")
    with pytest.raises(ValueError, match=r"objective 'fedprox': client\.objective_params\.nu: unknown key"):
        make_objective("fedprox", nu=1.0)


# ------------------------------------------------------------------ weighted CE and focal
def test_wce_inverse_frequency_weights() -> None:
    # counts [6, 3, 0, 1]: n = 10 over 3 present classes -> w_c = 10 / (3 n_c); absent class 0
    w = inverse_frequency_weights(torch.tensor([6, 3, 0, 1]))
    torch.testing.assert_close(w, torch.tensor([10 / 18, 10 / 9, 0.0, 10 / 3]))


def test_wce_loss_is_the_weighted_mean() -> None:
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    y = torch.tensor([0, 1, 1])
    obj = make_objective("wce")
    ctx = _ctx(nn.Linear(1, 2), counts=[3, 1])  # w = 4/(2*3), 4/(2*1) = 2/3, 2
    per = _per(logits, y)
    expect = (2 / 3 * per[0] + 2 * per[1] + 2 * per[2]) / (2 / 3 + 2 + 2)
    torch.testing.assert_close(OneClient(obj, ctx).loss(per, y), expect)
    # padded (the cohort trainer's masked batch): the pad's weight drops out
    row = {k: v[0] for k, v in obj.begin([ctx]).items()}
    padded, _ = obj.loss(torch.cat([per, per[:1]]), torch.tensor([1.0, 1, 1, 0]), torch.cat([y, y[:1]]), row)
    torch.testing.assert_close(padded, expect)


def test_focal_gamma_zero_is_cross_entropy_and_hand_value() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 5, generator=g)
    y = torch.randint(0, 5, (16,), generator=g)
    ctx = _ctx(nn.Linear(1, 5), num_classes=5)
    torch.testing.assert_close(
        OneClient(make_objective("focal", gamma=0.0), ctx).loss(_per(logits, y), y),
        F.cross_entropy(logits, y),
    )
    # one sample with p_y = 0.8 (logits log 0.8, log 0.2): -(1 - 0.8)^2 log 0.8 = 0.04 * 0.22314 = 0.0089257
    two = torch.tensor([[math.log(0.8), math.log(0.2)]])
    y0 = torch.tensor([0])
    ctx2 = _ctx(nn.Linear(1, 2))
    assert float(OneClient(make_objective("focal"), ctx2).loss(_per(two, y0), y0)) == pytest.approx(
        0.0089257, rel=1e-4
    )
    obj = make_objective("focal", alpha=[0.25, 1.0])
    assert float(OneClient(obj, ctx2).loss(_per(two, y0), y0)) == pytest.approx(0.25 * 0.0089257, rel=1e-4)
    with pytest.raises(ValueError, match="focal alpha has 2 entries for 5 classes"):
        obj.begin([ctx])


# ------------------------------------------------------------------ FedProx
def test_fedprox_adds_the_proximal_gradient() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    ctx = _ctx(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)  # w - w_global = 0.5 everywhere
            p.grad = torch.ones_like(p)  # the data gradient
    hooks = OneClient(make_objective("fedprox", mu=0.2), ctx)
    hooks.loss(torch.ones(1), torch.zeros(1, dtype=torch.long))  # the step's statistic
    hooks.before_step()
    for p in model.parameters():
        torch.testing.assert_close(p.grad, torch.full_like(p, 1.0 + 0.2 * 0.5))  # g + mu (w - w_g)


def test_fedprox_mu_zero_matches_ce() -> None:
    ce, _ = _train("ce", seed=2)
    fp, _ = _train("fedprox", seed=2, mu=0.0)
    assert ce.delta is not None and fp.delta is not None
    np.testing.assert_array_equal(ce.delta, fp.delta)
    strong, _ = _train("fedprox", seed=2, mu=1.0)
    assert strong.delta is not None
    assert np.linalg.norm(strong.delta) < np.linalg.norm(ce.delta)  # the proximal pull shortens the step


# ------------------------------------------------------------------ SCAFFOLD
def test_scaffold_correction_and_control_update() -> None:
    torch.manual_seed(0)
    model = nn.Linear(2, 1, bias=False)  # 2 parameters
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -1.0]]))
    lr, n_clients = 0.1, 4
    aux_in = {"scaffold_c": np.array([0.5, 0.0], np.float32), "sum:scaffold_dc": np.array([0.0, 0.25])}
    state = {"scaffold_ci": np.array([0.25, 0.25], np.float32)}
    ctx = _ctx(model, lr=lr, aux_in=aux_in, state=state)
    # c = [0.5, 0.25], c_i = [0.25, 0.25]: correction c - c_i = [0.25, 0]
    hooks = OneClient(make_objective("scaffold", num_clients=n_clients), ctx)
    x = torch.tensor([[2.0, 1.0]])
    loss = model(x).sum()  # gradient = x = [2, 1]
    hooks.loss(loss.detach().reshape(1), torch.zeros(1, dtype=torch.long))  # the step's statistic
    loss.backward()
    hooks.before_step()
    torch.testing.assert_close(model.weight.grad, torch.tensor([[2.25, 1.0]]))
    with torch.no_grad():
        model.weight -= lr * model.weight.grad  # y = [1 - 0.225, -1 - 0.1] = [0.775, -1.1]
    ctx.steps = 1
    hooks.end()
    # c_i+ = c_i - c + (x - y) / (K lr) = [0.25, 0.25] - [0.5, 0.25] + [0.225, 0.1] / 0.1 = [2.0, 1.0]
    np.testing.assert_allclose(state["scaffold_ci"], [2.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(ctx.aux_out["scaffold_c"], [0.5, 0.25])
    # dc / N = ([2, 1] - [0.25, 0.25]) / 4
    np.testing.assert_allclose(ctx.aux_out["sum:scaffold_dc"], [1.75 / 4, 0.75 / 4], rtol=1e-6)


def test_scaffold_server_control_is_c_plus_sum_dc_over_n() -> None:
    def upd(c: list[float], dc_over_n: list[float]) -> ClientUpdate:
        return ClientUpdate(
            10,
            0.0,
            0.0,
            0.0,
            np.zeros(2, np.float32),
            {"scaffold_c": np.array(c), "sum:scaffold_dc": np.array(dc_over_n)},
        )

    buf = [
        BufferedUpdate(0, 1, 0, 0.0, upd([1.0, 2.0], [0.1, 0.0])),
        BufferedUpdate(1, 2, 0, 0.0, upd([1.0, 2.0], [0.2, -0.5])),
    ]
    aux = reduce_aux(buf, np.array([0.9, 0.1]))
    np.testing.assert_allclose(aux["scaffold_c"], [1.0, 2.0])  # the echoed c, weighted mean
    np.testing.assert_allclose(aux["sum:scaffold_dc"], [0.3, -0.5])  # summed, not averaged
    model = nn.Linear(2, 1, bias=False)
    ctx = _ctx(model, aux_in=aux)
    ctx.steps = 0
    OneClient(make_objective("scaffold", num_clients=10), ctx).end()
    np.testing.assert_allclose(ctx.aux_out["scaffold_c"], [1.3, 1.5], rtol=1e-6)  # next task's c


def test_scaffold_zero_controls_is_fedavg() -> None:
    ce, _ = _train("ce", seed=5)
    sc, state = _train("scaffold", seed=5, num_clients=3)
    assert ce.delta is not None and sc.delta is not None
    np.testing.assert_array_equal(ce.delta, sc.delta)
    assert state["scaffold_ci"].dtype == np.float32
    # option II with c = 0: c_i+ = -delta / (K lr), K = 3 epochs x 5 batches
    np.testing.assert_allclose(state["scaffold_ci"], -ce.delta / (15 * 0.1), rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ SCAFFOLD's correction loop
def _scaffold_delta(ci: np.ndarray | None, steps: int = 5, lr: float = 0.1) -> np.ndarray:
    model = _mlp()
    w0 = parameters_to_vector(model.parameters()).detach().numpy().copy()
    state = {} if ci is None else {"scaffold_ci": ci.astype(np.float32)}
    trainer = LocalTrainer(
        model,
        make_objective("scaffold", num_clients=4),
        TrainConfig(lr=lr, batch_size=8, max_steps=steps),
        num_classes=3,
    )
    upd = trainer.train(w0, _data(), state, {}, torch.Generator().manual_seed(0))
    assert upd.delta is not None and np.isfinite(state["scaffold_ci"]).all()
    return upd.delta


def test_scaffold_correction_moves_the_model_by_k_lr_ci() -> None:
    """The lever of SCAFFOLD's divergence under the RAM (docs/federage.md): the correction is
    constant over the local steps, so a client control c_i moves the model by about K lr ||c_i||
    whatever the data gradient (here ||delta|| < 1 without one); the next c_i is the mean gradient
    along that trajectory, which closes the loop."""
    plain = _scaffold_delta(None)
    u = np.random.default_rng(0).standard_normal(plain.size)
    u /= np.linalg.norm(u)
    assert np.linalg.norm(plain) < 1.0
    for scale in (10.0, 100.0):
        stale = _scaffold_delta(scale * u)
        assert np.linalg.norm(stale) == pytest.approx(5 * 0.1 * scale, rel=0.15)


def test_run_config_trains_federage_on_full_batches() -> None:
    """A run config with the FedeRage objective gets drop_last (the fixed model mini-batch b)."""
    from felix.config import Config
    from felix.engine.plan import plan_run

    fr = Config.model_validate({"client": {"objective": "federage", "objective_params": {"alpha": 0.2}}})
    assert plan_run(fr).trainers.trainer().cfg.drop_last
    ce = Config.model_validate({"client": {"objective": "ce"}})
    assert not plan_run(ce).trainers.trainer().cfg.drop_last
