"""The training contract: user objectives, defined here, that override one hook or several train
the same one client at a time and in cohorts (update by update), and the conformance check finds
the ones that break the contract."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from felix.client.cohort import CohortTask, CohortTrainer
from felix.client.conformance import ObjectiveMismatch, check_objective
from felix.client.trainer import ClientData, LocalTrainer, TrainConfig
from felix.core.validation import AuxDecl
from felix.strategies.objectives import OBJECTIVES, Objective, TaskContext, make_objective, masked_mean


class SquaredCE(Objective):
    """``loss`` only: the mean of squared per-sample cross-entropies (hard samples count more)."""

    name = "squared_ce"

    def loss(
        self, per: torch.Tensor, mask: torch.Tensor | None, y: torch.Tensor, extra: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        loss = masked_mean(per * per, mask)
        return loss, loss


class LossScaledStep(Objective):
    """``before_step`` only: each client's gradient scaled by ``1 / (1 + its batch loss)``."""

    name = "loss_scaled_step"

    def before_step(
        self,
        grads: list[torch.Tensor],
        params: list[torch.Tensor],
        extra: dict[str, torch.Tensor],
        stats: torch.Tensor,
    ) -> None:
        scale = 1.0 / (1.0 + stats)
        for g in grads:
            g.mul_(scale.view(-1, *([1] * (g.dim() - 1))))


class LossTracker(Objective):
    """Every hook: a per-client running loss that damps the step, sent back as aux and kept as
    state (the next task starts from it)."""

    name = "loss_tracker"

    def __init__(self, decay: float = 0.5) -> None:
        self.decay = decay

    @classmethod
    def declared_aux(cls, num_params: int) -> dict[str, AuxDecl]:
        return {"tracked_loss": AuxDecl((), "<f8")}

    def begin(self, ctxs: list[TaskContext]) -> dict[str, torch.Tensor]:
        dev = ctxs[0].global_params.device
        start = [float(c.state.get("tracked_loss", 1.0)) for c in ctxs]
        return {"tracked": torch.tensor(start, dtype=torch.float64, device=dev)}

    def before_step(
        self,
        grads: list[torch.Tensor],
        params: list[torch.Tensor],
        extra: dict[str, torch.Tensor],
        stats: torch.Tensor,
    ) -> None:
        scale = (1.0 / (1.0 + extra["tracked"])).to(grads[0].dtype)
        for g in grads:
            g.mul_(scale.view(-1, *([1] * (g.dim() - 1))))

    def after_step(self, stats: torch.Tensor, extra: dict[str, torch.Tensor]) -> None:
        extra["tracked"].mul_(self.decay).add_(stats.double(), alpha=1.0 - self.decay)

    def end(self, ctxs: list[TaskContext], extra: dict[str, torch.Tensor], final: torch.Tensor) -> None:
        for ctx, v in zip(ctxs, extra["tracked"].tolist()):
            ctx.state["tracked_loss"] = v
            ctx.aux_out["tracked_loss"] = np.array(v, dtype=np.float64)


class PerTaskOnSelf(Objective):
    """Breaks the contract: keeps one task's value on the objective, which a cohort shares."""

    name = "per_task_on_self"

    def begin(self, ctxs: list[TaskContext]) -> dict[str, torch.Tensor]:
        self.first_count = float(ctxs[0].class_counts.sum())  # the first client's only
        return {}

    def before_step(
        self,
        grads: list[torch.Tensor],
        params: list[torch.Tensor],
        extra: dict[str, torch.Tensor],
        stats: torch.Tensor,
    ) -> None:
        for g in grads:
            g.mul_(10.0 / self.first_count)


class UndeclaredAux(Objective):
    name = "undeclared_aux"

    def end(self, ctxs: list[TaskContext], extra: dict[str, torch.Tensor], final: torch.Tensor) -> None:
        for ctx in ctxs:
            ctx.aux_out["secret"] = np.zeros(3, dtype=np.float32)


def _ragged() -> tuple[nn.Module, list[np.ndarray], list[ClientData]]:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))
    w0 = parameters_to_vector(model.parameters()).detach().numpy()
    rng = np.random.default_rng(4)
    datas = [
        ClientData(
            torch.from_numpy(rng.standard_normal((n, 6), dtype=np.float32)),
            torch.from_numpy(rng.integers(0, 3, n)),
        )
        for n in (2, 9, 16, 30)
    ]
    weights = [w0 + 0.01 * rng.standard_normal(w0.size).astype(np.float32) for _ in datas]
    return model, weights, datas


@pytest.mark.parametrize("objective", [SquaredCE(), LossScaledStep(), LossTracker(0.7)], ids=lambda o: o.name)
@pytest.mark.parametrize(
    "cfg",
    [
        TrainConfig(lr=0.1, batch_size=8, epochs=2),
        TrainConfig(lr=0.05, batch_size=8, momentum=0.9, max_steps=3),
        TrainConfig(lr=0.01, batch_size=8, optimizer="adam", drop_last=True),
    ],
    ids=["sgd", "momentum", "adam"],
)
def test_a_user_objective_trains_the_same_alone_and_in_a_cohort(
    objective: Objective, cfg: TrainConfig
) -> None:
    """Update by update: the sequential trainer (a stack of one) and the cohort trainer (the loss
    under vmap) call the same hooks; each changes the model away from plain cross-entropy's."""
    model, weights, datas = _ragged()
    alone = LocalTrainer(copy.deepcopy(model), copy.deepcopy(objective), cfg, 3)
    together = CohortTrainer(copy.deepcopy(model), copy.deepcopy(objective), cfg, 3)
    plain = LocalTrainer(copy.deepcopy(model), Objective(), cfg, 3)
    states_a: list[dict[str, Any]] = [{} for _ in datas]
    states_b: list[dict[str, Any]] = [{} for _ in datas]
    for task in range(2):
        seq = [
            alone.train(weights[k], d, states_a[k], {}, torch.Generator().manual_seed(task * 10 + k))
            for k, d in enumerate(datas)
        ]
        coh = together.train(
            [
                CohortTask(weights[k], d, states_b[k], {}, torch.Generator().manual_seed(task * 10 + k))
                for k, d in enumerate(datas)
            ]
        )
        ce = plain.train(weights[3], datas[3], {}, {}, torch.Generator().manual_seed(task * 10 + 3))
        for k, (a, b) in enumerate(zip(seq, coh)):
            assert a.delta is not None and b.delta is not None
            np.testing.assert_allclose(a.delta, b.delta, rtol=0, atol=1e-6, err_msg=f"client {k}")
            assert a.loss == pytest.approx(b.loss, abs=1e-6)
            assert sorted(a.aux) == sorted(b.aux)
            for key in a.aux:
                np.testing.assert_allclose(a.aux[key], b.aux[key], rtol=1e-6)
            assert states_a[k].keys() == states_b[k].keys()
            for key in states_a[k]:
                assert states_a[k][key] == pytest.approx(states_b[k][key], rel=1e-6)
        # away from plain CE by far more than the two paths differ (Adam undoes much of a scale)
        gap_ce = float(np.abs(seq[3].delta - ce.delta).max())  # type: ignore[operator]
        gap_paths = float(np.abs(seq[3].delta - coh[3].delta).max())  # type: ignore[operator]
        assert gap_ce > max(10 * gap_paths, 1e-6)
    if isinstance(objective, LossTracker):
        assert all(s["tracked_loss"] != 1.0 for s in states_a[1:])  # clients that stepped kept theirs


@pytest.mark.parametrize("objective", [SquaredCE(), LossScaledStep(), LossTracker()], ids=lambda o: o.name)
def test_the_conformance_check_passes_objectives_that_keep_the_contract(objective: Objective) -> None:
    report = check_objective(objective)
    assert report.cohort and report.tasks == 10
    assert 0 < report.largest["delta"] < 1e-6 or report.largest["delta"] == 0.0


def test_the_conformance_check_finds_an_objective_that_breaks_it() -> None:
    with pytest.raises(ObjectiveMismatch, match=r"client \d, task 0: delta differs"):
        check_objective(PerTaskOnSelf())
    with pytest.raises(ObjectiveMismatch, match=r"aux_out\['secret'\] is not in declared_aux"):
        check_objective(UndeclaredAux())


def test_the_builtin_objectives_pass_the_conformance_check() -> None:
    for name in OBJECTIVES.names():
        params = {"num_clients": 5} if name == "scaffold" else {}
        assert check_objective(make_objective(name, **params)).cohort


def test_an_objective_that_opts_out_of_cohorts_trains_alone_on_every_path() -> None:
    class HostRead(SquaredCE):
        name = "host_read"
        cohort = False

    report = check_objective(HostRead())
    assert not report.cohort and report.tasks == 10 and report.largest == {}
    model, _, _ = _ragged()
    with pytest.raises(ValueError, match="sets cohort = False"):
        CohortTrainer(model, HostRead(), TrainConfig(), 3)


def test_hooks_of_the_old_two_form_contract_are_refused() -> None:
    """A hook that would be silently ignored is an error when the class is defined."""
    with pytest.raises(TypeError, match=r"OldLoss\.batch_loss: .* write loss\('per', 'mask', 'y', 'extra'\)"):

        class OldLoss(Objective):
            def batch_loss(self, logits: torch.Tensor, y: torch.Tensor, ctx: Any) -> torch.Tensor:
                return logits.sum()

    with pytest.raises(
        TypeError, match=r"OldStep\.before_step\('ctx',\): the contract's hook is before_step"
    ):

        class OldStep(Objective):
            def before_step(self, ctx: Any) -> None:  # type: ignore[override]
                pass

    with pytest.raises(TypeError, match=r"OldBegin\.begin\('ctx',\)"):

        class OldBegin(Objective):
            def begin(self, ctx: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
                return {}
