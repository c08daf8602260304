"""FedeRage's mean-CVaR local objective (Algorithm 2) and its step rules, written once on stacked
tensors (:mod:`felix.strategies.objectives.base`): beta is one float64 per client in ``extra``."""

from __future__ import annotations

import math
from typing import TypeVar

import numpy as np
import torch

from felix.core.validation import AuxDecl
from felix.strategies.objectives.base import OBJECTIVES, Objective, TaskContext


def risk_weight(loss: float, beta: float, alpha: float, gamma: float) -> float:
    """FedeRage's scalar risk weight (Algorithm 2, line 8): ``(1 - gamma) + (gamma/alpha) 1{f >= beta}``."""
    return (1.0 - gamma) + (gamma / alpha) * float(loss >= beta)


def max_risk_weight(alpha: float, gamma: float) -> float:
    """``kappa(alpha, gamma) = (1 - gamma) + gamma/alpha``: the largest risk weight, the paper's
    bound on how much a high-loss mini-batch's gradient is amplified."""
    return (1.0 - gamma) + gamma / alpha


def balanced_low_weight(alpha: float, high: float) -> float:
    """The ``balanced`` rule's weight below beta: ``(1 - alpha * high) / (1 - alpha)``, so that with
    a fraction alpha of the batches at weight ``high`` (beta at the loss's (1-alpha)-quantile) the
    mean weight is 1, FedAvg's average step, as the paper's own weights have
    (``(1-alpha)(1-gamma) + alpha kappa = 1``). Needs ``alpha < 1`` and ``alpha * high <= 1``."""
    if not (0.0 < alpha < 1.0 and 0.0 <= alpha * high <= 1.0):
        raise ValueError(f"balanced weights need 0 < alpha < 1 and alpha * high <= 1, not {alpha}, {high}")
    return (1.0 - alpha * high) / (1.0 - alpha)


B = TypeVar("B", float, torch.Tensor)


def beta_step(beta: B, weight: B, lr: float, lo: float, hi: float) -> B:
    """One projected subgradient step on beta: ``Proj_[lo,hi](beta - lr (1 - w))``, on floats or on
    float64 tensors (FedeRage keeps beta on the device, one per client in a cohort).

    ``1 - w = gamma (1 - 1{f >= beta}/alpha)`` is the subgradient of
    ``gamma (beta + (f - beta)_+ / alpha)`` in beta: a batch above the threshold pushes beta up
    by ``lr gamma (1/alpha - 1)``, one below pulls it down by ``lr gamma``, so at equilibrium a
    fraction alpha of the batches lies above beta (beta tracks the loss's (1-alpha)-quantile).
    """
    moved = beta - lr * (1.0 - weight)
    return moved.clamp(lo, hi) if isinstance(moved, torch.Tensor) else min(max(moved, lo), hi)


FEDERAGE_STEP_RULES = ("paper", "normalised", "capped", "balanced")


@OBJECTIVES.register("federage")
class FedeRage(Objective):
    """FedeRage's mean-CVaR local objective (Algorithm 2) over ``(theta, beta)``.

    Per local step on one mini-batch with mean loss ``f``: ``w = (1-gamma) + (gamma/alpha) 1{f >= beta}``
    with the beta held before the step; theta steps along ``w grad f`` and beta along its
    subgradient ``1 - w``, projected onto ``B = [beta_min, beta_max]``. ``gamma = 0`` gives
    ``w = 1`` exactly, i.e. FedAvg's local SGD bit for bit, and leaves beta still.

    ``step_rule`` sizes the two steps:

    * ``"paper"``: Algorithm 2 as printed, theta by ``lr w grad f`` and beta by ``beta_lr (1 - w)``.
      The weight reaches ``kappa = (1-gamma) + gamma/alpha`` (5.5 at alpha 0.1, gamma 0.5; 20 at
      alpha 0.05, gamma 1), so a high-loss batch moves theta up to kappa times further than one
      FedAvg step and beta up to ``beta_lr gamma (1/alpha - 1)`` in one step: at small alpha this
      destabilises training.
    * ``"normalised"``: the same rule on the objective divided by kappa, i.e. the weight
      ``w / kappa`` in ``[(1-gamma)/kappa, 1]`` for theta and ``(1 - w)/kappa`` for beta. Scaling an
      objective by a constant keeps its minimiser ``(theta*, beta*)`` and the relative weighting
      of batches (a batch above beta still counts ``kappa/(1-gamma)`` times one below), but no
      step of theta is ever longer than a FedAvg step at the same learning rate, and beta moves by
      at most ``beta_lr`` (up ``beta_lr (1 - alpha)``, down ``beta_lr alpha``) whatever alpha is.
      The price: a batch below beta moves theta by only ``(1-gamma)/kappa`` of a FedAvg step, so
      at small alpha the model learns kappa times more slowly on average.
    * ``"capped"``: theta's weight is ``min(w, weight_cap)`` (default 2), beta steps as under
      ``"normalised"``. Batches below beta keep the paper's ``1 - gamma``; a batch above it is
      amplified by at most ``weight_cap`` instead of kappa. For ``kappa <= weight_cap`` this is
      the paper's theta step; below that alpha, theta follows the exact gradient of
      ``(1-gamma) f + (weight_cap - 1 + gamma) (f - beta)_+``, a mean-upper-semideviation
      objective whose threshold beta is still the (1-alpha)-quantile of the loss. In the
      alpha x gamma sweep of docs/federage.md it never collapsed (alpha 0.1, gamma 0.5:
      -0.008 +- 0.011 mean accuracy against FedAvg, paired over 8 seeds, where the paper's rule
      lost 0.18 and the normalised one 0.027), and at (0.2, 0.5) it keeps more tail-class accuracy
      than ``"balanced"``. Its mean theta weight,
      ``(1-alpha)(1-gamma) + alpha min(kappa, weight_cap)``, is below 1 once kappa exceeds the cap
      (0.65 at alpha 0.1, gamma 0.5): it learns more slowly than FedAvg on average, and at alpha
      <= 0.1 falls below FedAvg (use ``"balanced"`` there).
    * ``"balanced"`` (default): above beta as ``"capped"`` (``h = min(kappa, weight_cap)``); below beta the
      weight ``(1 - alpha h) / (1 - alpha)``, so that with a fraction alpha of the batches above
      beta the mean weight is 1, FedAvg's average step, as the paper's weights have
      (``(1-alpha)(1-gamma) + alpha kappa = 1``). The paper's step when ``kappa <= weight_cap``;
      below that alpha, the gradient of ``l f + (h - l) (f - beta)_+`` with ``l`` the low weight.
      Beta steps as under ``"normalised"``. At alpha 0.1 it keeps FedAvg's mean accuracy
      (-0.001 +- 0.008 over 8 seeds, where ``"capped"`` loses 0.008 at gamma 0.5 and 0.033 at 1);
      the default because it is the one rule that neither collapses nor slows down at small alpha
      (at alpha >= 0.3, gamma 0.5 and at the default (0.5, 0.5) it equals ``"capped"``; at
      (0.2, 0.5) capped keeps a little more tail-class accuracy, docs/federage.md).

    ``beta_lr`` is beta's own learning rate (``None``: the model's, as in the paper). Beta lives in
    loss units, theta in weight units; a separate rate lets the quantile estimate settle at its
    own pace.

    The gradient is scaled in ``before_step`` rather than in the loss, so the batch loss (and the
    trainer's reported loss, which q-FFL and TierFuse ``utility: loss`` read) is always the data
    loss ``f``. ``fixed_batch`` (default on) asks the trainer for ``drop_last``: the paper's model
    mini-batch size b is part of the problem, so every step must see exactly b samples (a client
    with fewer than b samples then takes no step).

    Beta is part of the optimisation variable, like theta: the server averages it with the model
    weights (``aux_out["federage_beta"]``) and a task starts from that average when the server
    sends one (``beta_from_server=True``, the default). The paper describes beta as "maintained
    locally as beta_i between communication rounds and averaged at the server"; since beta is a
    quantile of the loss under the *global* mixture and the server's average is otherwise unused,
    we read it as FedAvg on ``(theta, beta)``. The client's last beta is kept in ``ctx.state`` and
    is the starting point before any server average exists, or always with
    ``beta_from_server=False`` (the other reading). ``beta_init`` starts a client that has neither.
    """

    name = "federage"

    @classmethod
    def declared_aux(cls, num_params: int) -> dict[str, AuxDecl]:
        return {"federage_beta": AuxDecl((), "<f8")}

    def __init__(
        self,
        alpha: float = 0.5,
        gamma: float = 0.5,
        beta_min: float = 0.0,
        beta_max: float = 10.0,
        beta_init: float = 0.0,
        beta_from_server: bool = True,
        step_rule: str = "balanced",
        beta_lr: float | None = None,
        fixed_batch: bool = True,
        weight_cap: float = 2.0,
    ) -> None:
        if not (0.0 < alpha <= 1.0):
            raise ValueError(f"federage alpha must lie in (0, 1], not {alpha}")
        if not (0.0 <= gamma <= 1.0):
            raise ValueError(f"federage gamma must lie in [0, 1], not {gamma}")
        if not (np.isfinite(beta_min) and np.isfinite(beta_max) and beta_min <= beta_max):
            raise ValueError(
                f"federage needs a finite interval beta_min <= beta_max, not [{beta_min}, {beta_max}]"
            )
        if not (beta_min <= beta_init <= beta_max):
            raise ValueError(f"federage beta_init {beta_init} lies outside [{beta_min}, {beta_max}]")
        if step_rule not in FEDERAGE_STEP_RULES:
            raise ValueError(f"federage step_rule must be one of {FEDERAGE_STEP_RULES}, not {step_rule!r}")
        if not (weight_cap >= 1.0 and np.isfinite(weight_cap)):
            raise ValueError(f"federage weight_cap must be a finite value >= 1, not {weight_cap}")
        if beta_lr is not None and not (beta_lr > 0 and np.isfinite(beta_lr)):
            raise ValueError(
                f"federage beta_lr must be a finite value > 0 (or None: the model's), not {beta_lr}"
            )
        self.alpha = float(alpha)
        self.gamma = float(gamma)
        self.beta_min = float(beta_min)
        self.beta_max = float(beta_max)
        self.beta_init = float(beta_init)
        self.beta_from_server = bool(beta_from_server)
        self.step_rule = step_rule
        self.beta_lr = None if beta_lr is None else float(beta_lr)
        self.fixed_batch = bool(fixed_batch)
        self.weight_cap = float(weight_cap)
        # theta's weight: _theta_hi for a batch at or above beta, _theta_lo below it (the paper's w
        # times _scale, capped at _cap; "balanced" raises the low one so their mean stays 1); beta's
        # step is beta_lr (1 - w) * _beta_scale
        kappa = max_risk_weight(self.alpha, self.gamma)
        scale = 1.0 / kappa if step_rule == "normalised" else 1.0
        cap = self.weight_cap if step_rule in ("capped", "balanced") else math.inf
        self._theta_hi = min(risk_weight(1.0, 0.0, self.alpha, self.gamma) * scale, cap)
        self._theta_lo = min(risk_weight(0.0, 1.0, self.alpha, self.gamma) * scale, cap)
        if step_rule == "balanced" and kappa > cap:  # then alpha < 1 (kappa = 1 at alpha 1)
            self._theta_lo = balanced_low_weight(self.alpha, self._theta_hi)
        self._beta_scale = 1.0 if step_rule == "paper" else 1.0 / kappa
        # theta's two weights as one tensor for the per-step choice, moved to the task's device once
        # per task (on a GPU a tensor made from host values is a host-to-device copy and a sync)
        self._theta_hi_lo = torch.tensor([self._theta_hi, self._theta_lo], dtype=torch.float64)
        self._unit = self._theta_hi == self._theta_lo == 1.0  # gamma = 0: theta's step is FedAvg's
        self._lr = 0.0  # the tasks' learning rate (begin), beta's unless beta_lr is set

    # Beta stays on the device as float64 (Python floats are doubles) and the risk weight is taken
    # from the batch loss there, so a step makes no host sync (on a GPU a read of the loss is one
    # per batch). One client's task is a stack of one: the same arithmetic, element by element.
    def _start(self, ctx: TaskContext) -> float:
        server = ctx.aux_in.get("federage_beta")
        if self.beta_from_server and server is not None:
            start = float(np.asarray(server, dtype=np.float64).reshape(-1)[0])
        else:
            start = float(ctx.state.get("federage_beta", self.beta_init))
        return min(max(start, self.beta_min), self.beta_max)

    def _on(self, device: torch.device) -> None:
        if self._theta_hi_lo.device != device:
            self._theta_hi_lo = self._theta_hi_lo.to(device)

    def _risk_weight(self, f: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        return (1.0 - self.gamma) + (self.gamma / self.alpha) * (f.detach().double() >= beta).double()

    def _theta_weight(self, f: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        return torch.where(f.detach().double() >= beta, self._theta_hi_lo[0], self._theta_hi_lo[1])

    def _next_beta(self, f: torch.Tensor, beta: torch.Tensor, lr: float) -> torch.Tensor:
        lr = lr if self.beta_lr is None else self.beta_lr
        return beta_step(
            beta, self._risk_weight(f, beta), lr * self._beta_scale, self.beta_min, self.beta_max
        )

    def begin(self, ctxs: list[TaskContext]) -> dict[str, torch.Tensor]:
        self._lr = ctxs[0].lr
        dev = ctxs[0].global_params.device
        self._on(dev)
        betas = [self._start(ctx) for ctx in ctxs]
        return {"beta": torch.tensor(betas, dtype=torch.float64, device=dev)}

    # The batch loss is the base class's: the data loss f, reported as is and handed to the step
    # hooks as ``stats``; the weight scales the gradient instead.
    def before_step(
        self,
        grads: list[torch.Tensor],
        params: list[torch.Tensor],
        extra: dict[str, torch.Tensor],
        stats: torch.Tensor,
    ) -> None:
        if self._unit:
            return
        scale = self._theta_weight(stats, extra["beta"]).to(grads[0].dtype)
        for g in grads:
            g.mul_(scale.view(-1, *([1] * (g.dim() - 1))))

    def after_step(self, stats: torch.Tensor, extra: dict[str, torch.Tensor]) -> None:
        beta = extra["beta"]
        beta.copy_(self._next_beta(stats, beta, self._lr))

    def end(self, ctxs: list[TaskContext], extra: dict[str, torch.Tensor], final: torch.Tensor) -> None:
        for ctx, beta in zip(ctxs, extra["beta"].tolist()):
            ctx.state["federage_beta"] = beta
            ctx.aux_out["federage_beta"] = np.array(beta, dtype=np.float64)
