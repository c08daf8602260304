"""Client objectives: what a local step minimises. One object per client task, hooks at the points
where published methods differ (the batch loss, the gradient before the step, state after it).

New objectives register in ``OBJECTIVES``; every run config picks one by name (or gives an import
path to an ``Objective`` subclass); ``client.objective_params`` is validated against the keyword
parameters of its constructor (``objective_params_model``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, TypeVar, get_type_hints

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, create_model
from torch import nn

from felix.core.validation import AuxDecl


@dataclass
class TaskContext:
    """What an objective may read or keep during one local task.

    ``state`` persists on the client between its tasks (FedeRage's beta, SCAFFOLD's c_i);
    ``aux_in`` is the server's reduced aux state that came with the task; ``aux_out`` goes back.
    """

    model: nn.Module
    global_params: torch.Tensor  # flat copy of the received weights
    lr: float
    num_classes: int
    class_counts: torch.Tensor  # samples per class on this client (after any augmentation)
    state: dict[str, Any]
    aux_in: dict[str, np.ndarray]
    aux_out: dict[str, np.ndarray] = field(default_factory=dict)
    steps: int = 0


class Objective:
    """Plain cross-entropy: FedAvg's local SGD. Subclasses override only the hooks they need."""

    name = "ce"

    @classmethod
    def declared_aux(cls, num_params: int) -> dict[str, AuxDecl]:
        """The aux entries this objective writes to ``aux_out``, with exact shapes and dtypes.

        The server admits no other: an undeclared key, shape or dtype is rejected (at decode in the
        MQTT shell), so a client cannot make aggregation raise or plant state that would be shipped
        to every client. An objective that sends aux must declare it here.
        """
        return {}

    def begin(self, ctx: TaskContext) -> None:
        """Before the first local step."""

    def batch_loss(self, logits: torch.Tensor, y: torch.Tensor, ctx: TaskContext) -> torch.Tensor:
        return F.cross_entropy(logits, y)

    def before_step(self, ctx: TaskContext) -> None:
        """After backward, before the optimiser step: gradient corrections go here."""

    def after_step(self, ctx: TaskContext) -> None:
        """After the optimiser step: extra state updates and projections go here."""

    def end(self, ctx: TaskContext) -> None:
        """After the last step: write ``ctx.aux_out`` and persist ``ctx.state``."""

    def loss_from_ce(
        self, per: torch.Tensor, logits: torch.Tensor, y: torch.Tensor, ctx: TaskContext
    ) -> torch.Tensor:
        """The batch loss given the batch's per-sample cross-entropies ``per`` (computed once, in the
        graph, and also used for Oort's utility). Objectives that keep the base ``batch_loss`` take
        the mean of ``per``; others override this or fall back to their ``batch_loss``."""
        if type(self).batch_loss is Objective.batch_loss:
            return per.mean()
        return self.batch_loss(logits, y, ctx)

    # -- Cohort hooks (felix.client.cohort): the same rule for a stack of clients trained together.
    # ``extra`` holds per-client tensors stacked on dim 0; the first ``a`` rows are the clients still
    # stepping. ``cohort = False`` on a subclass sends its tasks to the sequential trainer; a subclass
    # that leaves ``cohort`` unset gets it from the hooks it overrides (``__init_subclass__``).
    cohort = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """``cohort`` is False for a subclass that overrides a sequential hook below its cohort
        counterpart (``batch_loss`` but not ``cohort_loss``, say) without saying ``cohort`` itself:
        its cohorts would otherwise train the inherited rule, e.g. plain cross-entropy, and give a
        different model than its sequential tasks without a word. Such an objective trains one
        client at a time until it writes the cohort hooks (docs/python-api.md)."""
        super().__init_subclass__(**kwargs)
        if "cohort" in cls.__dict__:
            return
        mro = cls.__mro__

        def owner(hook: str) -> int:
            return next(i for i, c in enumerate(mro) if hook in c.__dict__)

        cls.cohort = all(
            owner(seq) >= owner(coh) or mro[owner(seq)] is Objective
            for seqs, coh in _COHORT_COUNTERPARTS
            for seq in seqs
        )

    def cohort_begin(self, ctxs: list[TaskContext]) -> dict[str, torch.Tensor]:
        """Per-client tensors the other cohort hooks read (``begin`` for K clients at once)."""
        return {}

    def cohort_loss(
        self, per: torch.Tensor, mask: torch.Tensor, y: torch.Tensor, extra: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One client's batch loss under ``vmap``, and a statistic for ``cohort_after_step`` (here the
        loss itself). ``mask`` (0/1) marks the real samples of a padded short batch, so the masked
        mean equals the sequential mean over the short batch."""
        loss = (per * mask).sum() / mask.sum()
        return loss, loss

    def cohort_before_step(
        self,
        grads: list[torch.Tensor],
        params: list[torch.Tensor],
        extra: dict[str, torch.Tensor],
        a: int,
        stats: torch.Tensor,
    ) -> None:
        """Gradient corrections, in place, on the active clients' stacked gradients; ``stats`` are
        their statistics from ``cohort_loss`` for this step (detached)."""

    def cohort_after_step(self, stats: torch.Tensor, extra: dict[str, torch.Tensor], a: int) -> None:
        """After the step, given the active clients' statistics from ``cohort_loss`` (detached)."""

    def cohort_end(
        self, ctxs: list[TaskContext], extra: dict[str, torch.Tensor], final: torch.Tensor
    ) -> None:
        """``end`` for every client; ``final`` is the clients' trained weights, flat, stacked [K, P]."""


# Each sequential hook and the cohort hook that carries the same rule for a stack of clients.
_COHORT_COUNTERPARTS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("batch_loss", "loss_from_ce"), "cohort_loss"),
    (("begin",), "cohort_begin"),
    (("before_step",), "cohort_before_step"),
    (("after_step",), "cohort_after_step"),
    (("end",), "cohort_end"),
)

OBJECTIVES: dict[str, type[Objective]] = {"ce": Objective}


@functools.cache
def objective_params_model(name: str) -> type[BaseModel]:
    """The typed ``client.objective_params`` of objective ``name``: a strict pydantic model with the
    keyword parameters of its constructor (types and defaults), so a misspelt key fails by name."""
    cls = objective_class(name)
    hints = get_type_hints(cls.__init__)
    spec: dict[str, Any] = {}
    for p in inspect.signature(cls.__init__).parameters.values():
        if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        spec[p.name] = (hints.get(p.name, Any), ... if p.default is p.empty else p.default)
    model: type[BaseModel] = create_model(  # type: ignore[call-overload]
        f"{cls.__name__}Params", __config__=ConfigDict(extra="forbid", frozen=True), **spec
    )
    return model


def objective_class(name: str) -> type[Objective]:
    """A registered objective, or an ``Objective`` subclass by import path (``mypkg.losses:MyLoss``)."""
    if name in OBJECTIVES:
        return OBJECTIVES[name]
    if ":" in name:
        mod_name, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot import client objective {name!r} ({exc})") from None
        if not (isinstance(cls, type) and issubclass(cls, Objective)):
            raise ValueError(f"client objective {name!r} is not an Objective subclass")
        return cls
    raise ValueError(
        f"unknown client objective {name!r}; choose one of {sorted(OBJECTIVES)} "
        f"or give an import path 'package.module:Class'"
    )


def make_objective(name: str, **params: Any) -> Objective:
    cls = objective_class(name)
    try:
        return cls(**params)
    except TypeError as exc:
        raise ValueError(f"bad parameters for objective {name!r}: {exc}") from None


# ---------------------------------------------------------------------------------------------
# Baselines and FedeRage. Each registers under the name a run config uses.
# ---------------------------------------------------------------------------------------------


def _param_views(model: nn.Module, flat: torch.Tensor) -> list[torch.Tensor]:
    """Views of a flat vector shaped like each parameter, in ``parameters_to_vector`` order.

    Hooks that add a flat correction to every ``p.grad`` use these instead of rebuilding a flat
    gradient each step (one allocation per task, not per step).
    """
    views, offset = [], 0
    for p in model.parameters():
        n = p.numel()
        views.append(flat[offset : offset + n].view_as(p))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"flat vector has {flat.numel()} entries, the model has {offset} parameters")
    return views


def stacked_views(shapes: list[torch.Size], flat: torch.Tensor) -> list[torch.Tensor]:
    """``_param_views`` for a stack of clients: views of ``flat`` [K, P] shaped [K, *shape] per parameter."""
    views, offset = [], 0
    for shape in shapes:
        n = shape.numel()
        views.append(flat[:, offset : offset + n].view(flat.shape[0], *shape))
        offset += n
    if offset != flat.shape[1]:
        raise ValueError(f"flat vectors have {flat.shape[1]} entries, the model has {offset} parameters")
    return views


def inverse_frequency_weights(class_counts: torch.Tensor) -> torch.Tensor:
    """The DAFL paper's WCEL baseline weights: ``w_c = n / (C_present * n_c)``, 0 for absent classes.

    DAFL names the baseline (weighted cross-entropy loss) but not its formula; this is the usual
    inverse-frequency ("balanced", as in scikit-learn's ``compute_class_weight``) form over the
    classes the client holds. With PyTorch's mean reduction the batch loss is
    ``sum_i w_{y_i} l_i / sum_i w_{y_i}``, so only the ratios between classes matter.
    """
    counts = class_counts.to(torch.float64)
    present = counts > 0
    n_present = int(present.sum())
    if n_present == 0:
        raise ValueError("weighted cross-entropy needs at least one sample")
    w = torch.zeros_like(counts)
    w[present] = counts.sum() / (n_present * counts[present])
    return w.to(torch.float32)


class WeightedCE(Objective):
    """Class-weighted cross-entropy (DAFL's WCEL baseline): up-weights the client's rare classes."""

    name = "wce"

    def __init__(self) -> None:
        self._weight: torch.Tensor | None = None

    def begin(self, ctx: TaskContext) -> None:
        # Moved to the training device once per task, not once per batch (on a GPU each move is a
        # host-to-device copy and a stream sync).
        self._weight = inverse_frequency_weights(ctx.class_counts).to(ctx.global_params.device)

    def batch_loss(self, logits: torch.Tensor, y: torch.Tensor, ctx: TaskContext) -> torch.Tensor:
        assert self._weight is not None, "begin() sets the class weights"
        return F.cross_entropy(logits, y, weight=self._weight)

    def loss_from_ce(
        self, per: torch.Tensor, logits: torch.Tensor, y: torch.Tensor, ctx: TaskContext
    ) -> torch.Tensor:
        assert self._weight is not None, "begin() sets the class weights"
        w = self._weight[y]
        return (per * w).sum() / w.sum()

    def cohort_begin(self, ctxs: list[TaskContext]) -> dict[str, torch.Tensor]:
        dev = ctxs[0].global_params.device
        return {
            "class_weight": torch.stack([inverse_frequency_weights(c.class_counts) for c in ctxs]).to(dev)
        }

    def cohort_loss(
        self, per: torch.Tensor, mask: torch.Tensor, y: torch.Tensor, extra: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        w = extra["class_weight"][y] * mask
        loss = (per * w).sum() / w.sum()
        return loss, loss


class FocalLoss(Objective):
    """Focal loss (Lin et al. 2017), ``-alpha_y (1 - p_y)^gamma log p_y`` averaged over the batch.

    ``gamma`` (default 2, the paper's value; DAFL does not state its own) damps well-classified
    samples; ``alpha`` is an optional per-class weight vector. ``gamma=0`` without ``alpha`` is
    plain cross-entropy.
    """

    name = "focal"

    def __init__(self, gamma: float = 2.0, alpha: tuple[float, ...] | list[float] | None = None) -> None:
        if not (gamma >= 0 and np.isfinite(gamma)):
            raise ValueError(f"focal gamma must be a finite value >= 0, not {gamma}")
        if alpha is not None and (len(alpha) == 0 or any(not (a >= 0 and np.isfinite(a)) for a in alpha)):
            raise ValueError("focal alpha must be a non-empty list of finite per-class weights >= 0")
        self.gamma = float(gamma)
        self.alpha = None if alpha is None else torch.tensor(alpha, dtype=torch.float32)
        self._alpha = self.alpha  # alpha on the training device (begin moves it once per task)

    def begin(self, ctx: TaskContext) -> None:
        if self.alpha is not None:
            if self.alpha.numel() != ctx.num_classes:
                raise ValueError(
                    f"focal alpha has {self.alpha.numel()} entries for {ctx.num_classes} classes"
                )
            self._alpha = self.alpha.to(ctx.global_params.device)

    def batch_loss(self, logits: torch.Tensor, y: torch.Tensor, ctx: TaskContext) -> torch.Tensor:
        logp = F.log_softmax(logits, dim=1).gather(1, y.unsqueeze(1)).squeeze(1)
        per = -((1.0 - logp.exp()) ** self.gamma) * logp
        if self._alpha is not None:
            per = per * self._alpha[y]
        return per.mean()

    def _focal(self, ce: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The focal loss from per-sample cross-entropies (``ce = -log p_y``)."""
        per = ((1.0 - (-ce).exp()) ** self.gamma) * ce
        if self._alpha is not None:
            per = per * self._alpha[y]
        return per

    def loss_from_ce(
        self, per: torch.Tensor, logits: torch.Tensor, y: torch.Tensor, ctx: TaskContext
    ) -> torch.Tensor:
        return self._focal(per, y).mean()

    def cohort_begin(self, ctxs: list[TaskContext]) -> dict[str, torch.Tensor]:
        for ctx in ctxs:
            self.begin(ctx)
        return {}

    def cohort_loss(
        self, per: torch.Tensor, mask: torch.Tensor, y: torch.Tensor, extra: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        loss = (self._focal(per, y) * mask).sum() / mask.sum()
        return loss, loss


class FedProx(Objective):
    """FedProx (Li et al. 2020): cross-entropy plus ``mu/2 ||w - w_global||^2``.

    The proximal term's gradient ``mu (w - w_global)`` is added to ``p.grad`` before the step
    rather than to the loss, which is the same SGD step without a graph over all parameters.
    The reported loss is therefore the data loss alone.
    """

    name = "fedprox"

    def __init__(self, mu: float = 0.01) -> None:
        if not (mu >= 0 and np.isfinite(mu)):
            raise ValueError(f"fedprox mu must be a finite value >= 0, not {mu}")
        self.mu = float(mu)
        self._anchor: list[torch.Tensor] = []

    def begin(self, ctx: TaskContext) -> None:
        self._anchor = _param_views(ctx.model, ctx.global_params)

    def before_step(self, ctx: TaskContext) -> None:
        with torch.no_grad():
            for p, g in zip(ctx.model.parameters(), self._anchor):
                prox = (p - g).mul_(self.mu)
                if p.grad is None:
                    p.grad = prox
                else:
                    p.grad.add_(prox)

    def cohort_begin(self, ctxs: list[TaskContext]) -> dict[str, torch.Tensor]:
        return {"anchor": torch.stack([c.global_params for c in ctxs])}

    def cohort_before_step(
        self,
        grads: list[torch.Tensor],
        params: list[torch.Tensor],
        extra: dict[str, torch.Tensor],
        a: int,
        stats: torch.Tensor,
    ) -> None:
        anchors = stacked_views([p.shape[1:] for p in params], extra["anchor"][:a])
        for g, p, w0 in zip(grads, params, anchors):
            g.add_((p - w0).mul_(self.mu))


class Scaffold(Objective):
    """SCAFFOLD (Karimireddy et al. 2020), option II control variates.

    Each step uses ``g + c - c_i``; at the end ``c_i+ = c_i - c + (x - y_i) / (K lr)``.
    The server's rule ``c <- c + (1/N) sum_{i in S} (c_i+ - c_i)`` is a sum over the round, not
    the weighted mean that ``reduce_aux`` applies by default, so the exchange uses two aux keys:

    * ``sum:scaffold_dc`` = ``(c_i+ - c_i) / N``: keys with the ``sum:`` prefix are summed over
      the updates (``reduce_aux``), which gives the server's increment ``(1/N) sum dc``;
    * ``scaffold_c`` = the ``c`` this task started from, echoed so the weighted mean hands the
      next task the same ``c`` (every update of a synchronous round echoes the same value).

    A task therefore starts from ``c = aux_in["scaffold_c"] + aux_in["sum:scaffold_dc"]`` (zeros
    when absent). ``num_clients`` is N, the population size the server divides by. With
    momentum or Adam in the trainer the correction is still added to the gradient, as in the
    reference code, but the option-II estimate assumes plain SGD.

    Step-size limit (docs/federage.md, "SCAFFOLD under the RAM"; ``benchmarks/scaffold_ram.py``):
    the correction is constant over the K local steps, so it moves the model by up to
    ``K lr ||c - c_i||``, and label-skewed clients have ``||c_i||`` of 5-20 where ``||c|| < 1``;
    the next ``c_i`` is the mean gradient along that trajectory, which closes a feedback loop.
    On the default ``federage-compare`` scenario (small CNN, K = 10, lr 0.05) it runs away and the
    model turns non-finite at round 69; the update norms then track ``||c - c_i||`` (correlation
    0.99), not the staleness of ``c_i`` (the largest updates came from clients seen one round
    before). At lr 0.02 the same run stays finite for 100 rounds. The bookkeeping is as published
    (pinned by tests); keep ``K lr`` small, as SCAFFOLD's analysis asks (local lr ~ 1/(K L)).
    """

    name = "scaffold"

    @classmethod
    def declared_aux(cls, num_params: int) -> dict[str, AuxDecl]:
        return {"scaffold_c": AuxDecl((num_params,), "<f4"), "sum:scaffold_dc": AuxDecl((num_params,), "<f4")}

    def __init__(self, num_clients: int) -> None:
        if num_clients < 1:
            raise ValueError(f"scaffold num_clients must be >= 1, not {num_clients}")
        self.num_clients = int(num_clients)
        self._c = torch.empty(0)
        self._ci = torch.empty(0)
        self._views: list[torch.Tensor] = []

    @staticmethod
    def _flat(value: np.ndarray | None, like: torch.Tensor, what: str) -> torch.Tensor:
        if value is None:
            return torch.zeros_like(like)
        arr = np.asarray(value, dtype=np.float32).reshape(-1)
        if arr.shape[0] != like.numel():
            raise ValueError(f"scaffold {what} has {arr.shape[0]} entries, the model has {like.numel()}")
        return torch.from_numpy(arr.copy()).to(like.device)

    def begin(self, ctx: TaskContext) -> None:
        x = ctx.global_params
        c = self._flat(ctx.aux_in.get("scaffold_c"), x, "server control")
        c += self._flat(ctx.aux_in.get("sum:scaffold_dc"), x, "server control increment")
        self._c = c
        self._ci = self._flat(ctx.state.get("scaffold_ci"), x, "client control")
        self._views = _param_views(ctx.model, self._c - self._ci)

    def before_step(self, ctx: TaskContext) -> None:
        with torch.no_grad():
            for p, corr in zip(ctx.model.parameters(), self._views):
                if p.grad is None:
                    p.grad = corr.clone()
                else:
                    p.grad.add_(corr)

    def end(self, ctx: TaskContext) -> None:
        if ctx.steps > 0:
            with torch.no_grad():
                y = torch.nn.utils.parameters_to_vector(ctx.model.parameters())
                ci_new = self._ci - self._c + (ctx.global_params - y) / (ctx.steps * ctx.lr)
        else:
            ci_new = self._ci
        dc = (ci_new - self._ci).cpu().numpy()
        ctx.state["scaffold_ci"] = ci_new.cpu().numpy()
        ctx.aux_out["scaffold_c"] = self._c.cpu().numpy()
        ctx.aux_out["sum:scaffold_dc"] = dc / np.float32(self.num_clients)

    def cohort_begin(self, ctxs: list[TaskContext]) -> dict[str, torch.Tensor]:
        cs, cis = [], []
        for ctx in ctxs:
            x = ctx.global_params
            c = self._flat(ctx.aux_in.get("scaffold_c"), x, "server control")
            c += self._flat(ctx.aux_in.get("sum:scaffold_dc"), x, "server control increment")
            cs.append(c)
            cis.append(self._flat(ctx.state.get("scaffold_ci"), x, "client control"))
        c, ci = torch.stack(cs), torch.stack(cis)
        return {"c": c, "ci": ci, "corr": c - ci, "anchor": torch.stack([ctx.global_params for ctx in ctxs])}

    def cohort_before_step(
        self,
        grads: list[torch.Tensor],
        params: list[torch.Tensor],
        extra: dict[str, torch.Tensor],
        a: int,
        stats: torch.Tensor,
    ) -> None:
        for g, corr in zip(grads, stacked_views([p.shape[1:] for p in params], extra["corr"][:a])):
            g.add_(corr)

    def cohort_end(
        self, ctxs: list[TaskContext], extra: dict[str, torch.Tensor], final: torch.Tensor
    ) -> None:
        for k, ctx in enumerate(ctxs):
            # ``c`` and ``ci`` are rows of the trainer's stack, which later tasks overwrite: what
            # leaves with the update is copied out (on a CPU ``.cpu().numpy()`` would share them).
            ci, c = extra["ci"][k], extra["c"][k]
            ci_new = ci - c + (extra["anchor"][k] - final[k]) / (ctx.steps * ctx.lr) if ctx.steps > 0 else ci
            ctx.state["scaffold_ci"] = ci_new.to("cpu", copy=True).numpy()
            ctx.aux_out["scaffold_c"] = c.to("cpu", copy=True).numpy()
            ctx.aux_out["sum:scaffold_dc"] = (ci_new - ci).cpu().numpy() / np.float32(self.num_clients)


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
        self._beta = torch.tensor(self.beta_init, dtype=torch.float64)  # the task's beta, on its device
        self._f = torch.zeros(())  # the step's data loss (its value), as the trainer computed it

    # Both forms keep beta on the device as float64 (Python floats are doubles) and take the risk
    # weight from the batch loss there, so a step makes no host sync (on a GPU a read of the loss
    # is one per batch): the sequential form is the cohort form's arithmetic for one client
    # (tests/test_cohort.py checks the two agree).
    @property
    def beta(self) -> float:
        """The current task's beta (a host read)."""
        return float(self._beta)

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

    def begin(self, ctx: TaskContext) -> None:
        device = ctx.global_params.device
        self._on(device)
        self._beta = torch.tensor(self._start(ctx), dtype=torch.float64, device=device)

    def batch_loss(self, logits: torch.Tensor, y: torch.Tensor, ctx: TaskContext) -> torch.Tensor:
        f = F.cross_entropy(logits, y)
        self._f = f.detach()  # its value only: the objective holds no graph (and stays copyable)
        return f

    def loss_from_ce(
        self, per: torch.Tensor, logits: torch.Tensor, y: torch.Tensor, ctx: TaskContext
    ) -> torch.Tensor:
        f = per.mean()  # the same data loss plain CE reports, from the one CE pass
        self._f = f.detach()
        return f

    def before_step(self, ctx: TaskContext) -> None:
        if self._unit:
            return
        weight = self._theta_weight(self._f, self._beta)
        scales: dict[torch.dtype, torch.Tensor] = {}  # the weight in each gradient's dtype, made once
        with torch.no_grad():
            for p in ctx.model.parameters():
                if p.grad is not None:
                    scale = scales.get(p.grad.dtype)
                    if scale is None:
                        scale = scales[p.grad.dtype] = weight.to(p.grad.dtype)
                    p.grad.mul_(scale)

    def after_step(self, ctx: TaskContext) -> None:
        self._beta = self._next_beta(self._f, self._beta, ctx.lr)

    def end(self, ctx: TaskContext) -> None:
        beta = self.beta
        ctx.state["federage_beta"] = beta
        ctx.aux_out["federage_beta"] = np.array(beta, dtype=np.float64)

    # Cohort form: beta per client, ``extra["beta"]`` ``[K]``. The batch loss is the base class's
    # cohort_loss (``batch_loss`` above only records f), so the cohort hooks are complete.
    cohort = True

    def cohort_begin(self, ctxs: list[TaskContext]) -> dict[str, torch.Tensor]:
        self._cohort_lr = ctxs[0].lr
        dev = ctxs[0].global_params.device
        self._on(dev)
        betas = [self._start(ctx) for ctx in ctxs]
        return {"beta": torch.tensor(betas, dtype=torch.float64, device=dev)}

    # The batch loss is the base class's (the data loss f, reported as is); the weight scales the
    # gradient, as ``before_step`` does.
    def cohort_before_step(
        self,
        grads: list[torch.Tensor],
        params: list[torch.Tensor],
        extra: dict[str, torch.Tensor],
        a: int,
        stats: torch.Tensor,
    ) -> None:
        if self._unit:
            return
        scale = self._theta_weight(stats, extra["beta"][:a]).to(grads[0].dtype)
        for g in grads:
            g.mul_(scale.view(-1, *([1] * (g.dim() - 1))))

    def cohort_after_step(self, stats: torch.Tensor, extra: dict[str, torch.Tensor], a: int) -> None:
        beta = extra["beta"][:a]
        beta.copy_(self._next_beta(stats, beta, self._cohort_lr))

    def cohort_end(
        self, ctxs: list[TaskContext], extra: dict[str, torch.Tensor], final: torch.Tensor
    ) -> None:
        for ctx, beta in zip(ctxs, extra["beta"].tolist()):
            ctx.state["federage_beta"] = beta
            ctx.aux_out["federage_beta"] = np.array(beta, dtype=np.float64)


OBJECTIVES.update({cls.name: cls for cls in (WeightedCE, FocalLoss, FedProx, Scaffold, FedeRage)})
