"""The baseline client objectives: class-weighted cross-entropy (DAFL's WCEL), focal loss, FedProx
and SCAFFOLD, each written once on stacked tensors (:mod:`felix.strategies.objectives.base`) and
registered under the name a run config uses."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from felix.core.validation import AuxDecl
from felix.strategies.objectives.base import (
    OBJECTIVES,
    Objective,
    TaskContext,
    masked_mean,
    stacked_views,
)


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


@OBJECTIVES.register("wce")
class WeightedCE(Objective):
    """Class-weighted cross-entropy (DAFL's WCEL baseline): up-weights the client's rare classes."""

    name = "wce"

    def begin(self, ctxs: list[TaskContext]) -> dict[str, torch.Tensor]:
        # Moved to the training device once per task, not once per batch (on a GPU each move is a
        # host-to-device copy and a stream sync).
        dev = ctxs[0].global_params.device
        return {
            "class_weight": torch.stack([inverse_frequency_weights(c.class_counts) for c in ctxs]).to(dev)
        }

    def loss(
        self,
        per: torch.Tensor,
        mask: torch.Tensor | None,
        y: torch.Tensor,
        extra: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        w = extra["class_weight"][y]
        if mask is not None:
            w = w * mask
        loss = (per * w).sum() / w.sum()
        return loss, loss


@OBJECTIVES.register("focal")
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

    def begin(self, ctxs: list[TaskContext]) -> dict[str, torch.Tensor]:
        if self.alpha is not None:
            for ctx in ctxs:
                if self.alpha.numel() != ctx.num_classes:
                    raise ValueError(
                        f"focal alpha has {self.alpha.numel()} entries for {ctx.num_classes} classes"
                    )
            self._alpha = self.alpha.to(ctxs[0].global_params.device)
        return {}

    def focal(self, ce: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The per-sample focal loss from per-sample cross-entropies (``ce = -log p_y``)."""
        per = ((1.0 - (-ce).exp()) ** self.gamma) * ce
        if self._alpha is not None:
            per = per * self._alpha[y]
        return per

    def loss(
        self,
        per: torch.Tensor,
        mask: torch.Tensor | None,
        y: torch.Tensor,
        extra: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        loss = masked_mean(self.focal(per, y), mask)
        return loss, loss


@OBJECTIVES.register("fedprox")
class FedProx(Objective):
    """FedProx (Li et al. 2020): cross-entropy plus ``mu/2 ||w - w_global||^2``.

    The proximal term's gradient ``mu (w - w_global)`` is added to the gradient before the step
    rather than to the loss, which is the same SGD step without a graph over all parameters.
    The reported loss is therefore the data loss alone.
    """

    name = "fedprox"

    def __init__(self, mu: float = 0.01) -> None:
        if not (mu >= 0 and np.isfinite(mu)):
            raise ValueError(f"fedprox mu must be a finite value >= 0, not {mu}")
        self.mu = float(mu)

    def begin(self, ctxs: list[TaskContext]) -> dict[str, torch.Tensor]:
        return {"anchor": torch.stack([c.global_params for c in ctxs])}

    def before_step(
        self,
        grads: list[torch.Tensor],
        params: list[torch.Tensor],
        extra: dict[str, torch.Tensor],
        stats: torch.Tensor,
    ) -> None:
        anchors = stacked_views([p.shape[1:] for p in params], extra["anchor"])
        for g, p, w0 in zip(grads, params, anchors):
            g.add_((p - w0).mul_(self.mu))


class ScaffoldParams(BaseModel):
    """SCAFFOLD's parameters: ``num_clients`` is N, the population the server divides by."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    num_clients: int | None = Field(
        None, ge=1, description="N, the population size (null: the run's partition.num_clients)"
    )


@OBJECTIVES.register("scaffold")
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
    when absent). ``num_clients`` is N, the population size the server divides by (in a run
    config it defaults to ``partition.num_clients``). With momentum or Adam in the trainer the
    correction is still added to the gradient, as in the reference code, but the option-II
    estimate assumes plain SGD. Its control variates cover the parameters only
    (``parameters_only``): a model with buffers needs ``client.buffers: local``.

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
    Params = ScaffoldParams
    parameters_only: ClassVar[bool] = True

    @classmethod
    def declared_aux(cls, num_params: int) -> dict[str, AuxDecl]:
        return {"scaffold_c": AuxDecl((num_params,), "<f4"), "sum:scaffold_dc": AuxDecl((num_params,), "<f4")}

    @classmethod
    def from_params(cls, params: BaseModel, ctx: Any = None) -> Scaffold:
        n = getattr(params, "num_clients", None)
        if n is None and ctx is not None:
            n = ctx.num_clients
        if n is None:
            raise ValueError("scaffold needs num_clients (the population size N)")
        return cls(int(n))

    def __init__(self, num_clients: int) -> None:
        if num_clients < 1:
            raise ValueError(f"scaffold num_clients must be >= 1, not {num_clients}")
        self.num_clients = int(num_clients)

    @staticmethod
    def _flat(value: np.ndarray | None, like: torch.Tensor, what: str) -> torch.Tensor:
        if value is None:
            return torch.zeros_like(like)
        arr = np.asarray(value, dtype=np.float32).reshape(-1)
        if arr.shape[0] != like.numel():
            raise ValueError(f"scaffold {what} has {arr.shape[0]} entries, the model has {like.numel()}")
        return torch.from_numpy(arr.copy()).to(like.device)

    def begin(self, ctxs: list[TaskContext]) -> dict[str, torch.Tensor]:
        cs, cis = [], []
        for ctx in ctxs:
            x = ctx.global_params
            c = self._flat(ctx.aux_in.get("scaffold_c"), x, "server control")
            c += self._flat(ctx.aux_in.get("sum:scaffold_dc"), x, "server control increment")
            cs.append(c)
            cis.append(self._flat(ctx.state.get("scaffold_ci"), x, "client control"))
        c, ci = torch.stack(cs), torch.stack(cis)
        return {"c": c, "ci": ci, "corr": c - ci, "anchor": torch.stack([ctx.global_params for ctx in ctxs])}

    def before_step(
        self,
        grads: list[torch.Tensor],
        params: list[torch.Tensor],
        extra: dict[str, torch.Tensor],
        stats: torch.Tensor,
    ) -> None:
        for g, corr in zip(grads, stacked_views([p.shape[1:] for p in params], extra["corr"])):
            g.add_(corr)

    def end(self, ctxs: list[TaskContext], extra: dict[str, torch.Tensor], final: torch.Tensor) -> None:
        for k, ctx in enumerate(ctxs):
            # ``c`` and ``ci`` are rows of the trainer's stack, which later tasks overwrite: what
            # leaves with the update is copied out (on a CPU ``.cpu().numpy()`` would share them).
            ci, c = extra["ci"][k], extra["c"][k]
            ci_new = ci - c + (extra["anchor"][k] - final[k]) / (ctx.steps * ctx.lr) if ctx.steps > 0 else ci
            ctx.state["scaffold_ci"] = ci_new.to("cpu", copy=True).numpy()
            ctx.aux_out["scaffold_c"] = c.to("cpu", copy=True).numpy()
            ctx.aux_out["sum:scaffold_dc"] = (ci_new - ci).cpu().numpy() / np.float32(self.num_clients)
