"""The training contract: what a client objective writes, once, and how both trainers call it.

An objective changes what a local step minimises at a few points (the batch loss, the gradient
before the optimiser step, state after it, what the task sends back). It writes each hook once,
for a *stack* of clients (a leading client dimension ``K``):

* :meth:`Objective.begin` ``(ctxs) -> extra``: per-client tensors, stacked ``[K, ...]``;
* :meth:`Objective.loss` ``(per, mask, y, extra) -> (loss, stat)``: one client's batch loss from
  its per-sample cross-entropies (the cohort trainer maps it over the stack with ``vmap``);
* :meth:`Objective.before_step` ``(grads, params, extra, stats)``: gradient corrections, in place;
* :meth:`Objective.after_step` ``(stats, extra)``: state updates after the optimiser step;
* :meth:`Objective.end` ``(ctxs, extra, final)``: write each client's ``aux_out`` and ``state``.

The cohort trainer (:mod:`felix.client.cohort`) calls them with every client it steps together;
the sequential trainer (:mod:`felix.client.trainer`) calls the very same hooks through
:class:`OneClient`, with a stack of one: views of the model's own parameters and gradients with a
leading dimension of 1, so its model call and optimiser are unchanged. There is no second form of
a rule to forget: an objective that overrides one hook trains the same on both paths
(:func:`felix.client.conformance.check_objective` checks a user's own).

``OBJECTIVES`` is the registry (``felix.core.registry``) a config's ``client.objective`` names;
an objective registers next to its class and owns its typed parameters (:meth:`Objective.params`,
from its constructor's keywords unless it declares a ``Params`` model of its own).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, get_type_hints

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, create_model
from torch import nn

from felix.core.registry import Registry, RegistryError
from felix.core.validation import AuxDecl


@dataclass
class TaskContext:
    """What an objective may read or keep during one client's local task.

    ``state`` persists on the client between its tasks (FedeRage's beta, SCAFFOLD's c_i);
    ``aux_in`` is the server's reduced aux state that came with the task; ``aux_out`` goes back.
    ``steps`` is the number of local steps the task takes (set before ``end``).
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


def masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The mean of one client's per-sample ``values`` over its real samples.

    ``mask`` is ``None`` when every sample is real (the sequential trainer: its plain ``mean``),
    else 0/1 marking the real samples of a padded short batch (the cohort trainer), so that the
    masked mean equals the sequential mean over the short batch."""
    return values.mean() if mask is None else (values * mask).sum() / mask.sum()


def stacked_views(shapes: list[torch.Size], flat: torch.Tensor) -> list[torch.Tensor]:
    """Views of ``flat`` ``[K, P]`` (K clients' flat vectors) shaped ``[K, *shape]`` per parameter,
    in ``parameters_to_vector`` order: a flat correction added to stacked gradients."""
    views, offset = [], 0
    for shape in shapes:
        n = shape.numel()
        views.append(flat[:, offset : offset + n].view(flat.shape[0], *shape))
        offset += n
    if offset != flat.shape[1]:
        raise ValueError(f"flat vectors have {flat.shape[1]} entries, the model has {offset} parameters")
    return views


# The hooks of the contract, with their arguments after ``self`` (checked on every subclass).
HOOKS: dict[str, tuple[str, ...]] = {
    "begin": ("ctxs",),
    "loss": ("per", "mask", "y", "extra"),
    "before_step": ("grads", "params", "extra", "stats"),
    "after_step": ("stats", "extra"),
    "end": ("ctxs", "extra", "final"),
}
# Hooks of the two-form contract felix had before: a subclass that writes one is refused, as its
# rule would otherwise be silently ignored.
_RETIRED = {
    "batch_loss": "loss",
    "loss_from_ce": "loss",
    "cohort_begin": "begin",
    "cohort_loss": "loss",
    "cohort_before_step": "before_step",
    "cohort_after_step": "after_step",
    "cohort_end": "end",
}


class Objective:
    """Plain cross-entropy: FedAvg's local SGD. Subclasses override only the hooks they need.

    Every hook sees a stack of clients; the sequential trainer's stack has one. ``cohort = False``
    on a subclass whose ``loss`` cannot run under ``vmap`` (it reads a value on the host, say)
    sends its tasks to the sequential trainer on every path."""

    name: ClassVar[str] = "ce"
    cohort: ClassVar[bool] = True
    # What the objective declares about itself for the builder's checks (no tests of its name):
    # ``parameters_only`` keeps per-parameter state (SCAFFOLD's controls), so a model with buffers
    # needs ``client.buffers: local``; ``fixed_batch`` asks the trainer for ``drop_last``.
    parameters_only: ClassVar[bool] = False
    fixed_batch: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse hooks that would be silently ignored: one of the retired per-path hooks, or a
        contract hook with the wrong arguments (a per-client ``begin(ctx)``, ``before_step(ctx)``)."""
        super().__init_subclass__(**kwargs)
        for old, new in _RETIRED.items():
            if old in cls.__dict__:
                raise TypeError(
                    f"{cls.__qualname__}.{old}: objectives write each hook once, for a stack of "
                    f"clients; write {new}{HOOKS[new]} instead (docs/python-api.md)"
                )
        for hook, args in HOOKS.items():
            fn = cls.__dict__.get(hook)
            if fn is None:
                continue
            got = tuple(inspect.signature(fn).parameters)[1:]
            if len(got) != len(args) or (hook == "begin" and got == ("ctx",)):
                raise TypeError(
                    f"{cls.__qualname__}.{hook}{got}: the contract's hook is "
                    f"{hook}{args}, on stacked tensors (docs/python-api.md)"
                )

    # ------------------------------------------------------------------ typed parameters
    @classmethod
    def params(cls) -> type[BaseModel]:
        """The objective's typed parameters (``client.objective_params``): its ``Params`` model when
        it declares one, else a strict model of its constructor's keyword parameters (types and
        defaults), so a misspelt key fails by name."""
        own = cls.__dict__.get("Params")
        if isinstance(own, type) and issubclass(own, BaseModel):
            return own
        cached = cls.__dict__.get("_params_model")
        if cached is not None:
            return cached  # type: ignore[no-any-return]
        hints = get_type_hints(cls.__init__)
        spec: dict[str, Any] = {}
        for p in inspect.signature(cls.__init__).parameters.values():
            if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            spec[p.name] = (hints.get(p.name, Any), ... if p.default is p.empty else p.default)
        model: type[BaseModel] = create_model(  # type: ignore[call-overload]
            f"{cls.__name__}Params", __config__=ConfigDict(extra="forbid", frozen=True), **spec
        )
        cls._params_model = model  # type: ignore[attr-defined]
        return model

    @classmethod
    def from_params(cls, params: BaseModel, ctx: Any = None) -> Objective:
        """Build from validated parameters (the registry's factory); ``ctx`` is the run's
        facts (``felix.core.run_facts.RunFacts``), for objectives whose defaults come from the run
        (SCAFFOLD's population size)."""
        return cls(**params.model_dump(exclude_unset=True))

    @classmethod
    def declared_aux(cls, num_params: int) -> dict[str, AuxDecl]:
        """The aux entries this objective writes to ``aux_out``, with exact shapes and dtypes.

        The server admits no other: an undeclared key, shape or dtype is rejected (at decode in the
        MQTT shell), so a client cannot make aggregation raise or plant state that would be shipped
        to every client. An objective that sends aux must declare it here.
        """
        return {}

    @classmethod
    def overrides(cls, hook: str) -> bool:
        """Whether this objective writes ``hook`` itself (the trainers call only those)."""
        return getattr(cls, hook) is not getattr(Objective, hook)

    # ------------------------------------------------------------------ the hooks
    def begin(self, ctxs: list[TaskContext]) -> dict[str, torch.Tensor]:
        """Before the first local step of the clients ``ctxs``: per-client tensors, stacked on
        dim 0 (``[K, ...]``), that the other hooks read and may update in place."""
        return {}

    def loss(
        self,
        per: torch.Tensor,
        mask: torch.Tensor | None,
        y: torch.Tensor,
        extra: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One client's batch loss from its per-sample cross-entropies ``per`` ``[B]`` (computed
        once, in the graph, and also used for Oort's utility), and a statistic the step hooks get
        as ``stats`` (here the loss itself). ``extra`` holds this client's rows; ``mask`` is None
        or marks the real samples of a padded batch (:func:`masked_mean`). The cohort trainer maps
        this over the stack with ``vmap``: no host reads, no data-dependent Python branches."""
        loss = masked_mean(per, mask)
        return loss, loss

    def before_step(
        self,
        grads: list[torch.Tensor],
        params: list[torch.Tensor],
        extra: dict[str, torch.Tensor],
        stats: torch.Tensor,
    ) -> None:
        """After backward, before the optimiser step: gradient corrections, in place, on the
        stepping clients' gradients ``[A, *shape]`` per parameter; ``params``, ``extra`` and
        ``stats`` (detached, ``[A]``) are theirs too (views: in-place updates land)."""

    def after_step(self, stats: torch.Tensor, extra: dict[str, torch.Tensor]) -> None:
        """After the optimiser step, given the stepping clients' statistics ``[A]`` (detached)
        and their ``extra`` rows (update them in place)."""

    def end(self, ctxs: list[TaskContext], extra: dict[str, torch.Tensor], final: torch.Tensor) -> None:
        """After the last step of the clients ``ctxs``: write ``ctx.aux_out`` and persist
        ``ctx.state``; ``final`` is their trained weights, flat, stacked ``[K, P]``, and ``extra``
        their rows (rows of a trainer's stack, which later tasks overwrite: copy what you keep)."""


OBJECTIVES: Registry[Objective] = Registry(
    "objective",
    modules=("felix.strategies.objectives.baselines", "felix.strategies.objectives.federage"),
    key="client.objective",
)


OBJECTIVES.register(Objective.name)(Objective)  # plain cross-entropy, registered as its subclasses are


def objective_class(name: str) -> type[Objective]:
    """A registered objective, or an ``Objective`` subclass by import path (``mypkg.losses:MyLoss``)."""
    try:
        cls = OBJECTIVES.entry(name).factory
    except RegistryError as exc:
        raise ValueError(str(exc)) from None
    if not (isinstance(cls, type) and issubclass(cls, Objective)):
        raise ValueError(f"client.objective {name!r} is not an Objective subclass")  # noqa: TRY004 - a config value
    return cls


def objective_params_model(name: str) -> type[BaseModel]:
    """The typed ``client.objective_params`` of objective ``name``."""
    return objective_class(name).params()


def make_objective(name: str, **params: Any) -> Objective:
    """The objective ``name`` with keyword parameters (validated by its own model)."""
    try:
        return OBJECTIVES.create(name, params, where="client.objective_params")
    except RegistryError as exc:
        raise ValueError(str(exc)) from None


class OneClient:
    """One client's task driven through the stacked hooks, as a stack of one.

    The sequential trainer and a Flower handler's loop use it: the hooks see views with a leading
    dimension of 1 of the model's own parameters and gradients, so the model call and the
    optimiser are those of plain PyTorch, and each rule is the objective's one form."""

    def __init__(
        self, objective: Objective, ctx: TaskContext, params: Sequence[torch.Tensor] | None = None
    ) -> None:
        """``params``: ``list(ctx.model.parameters())`` when the caller has it (walking the modules
        for it costs tens of microseconds, on a task of one or two steps)."""
        self.objective = objective
        self.ctx = ctx
        self.params: Sequence[torch.Tensor] = list(ctx.model.parameters()) if params is None else params
        self.extra = objective.begin([ctx])
        self.row = {k: v[0] for k, v in self.extra.items()}  # views: updates of ``extra`` show
        kind = type(objective)
        self._before, self._after, self._end = (
            kind.overrides("before_step"),
            kind.overrides("after_step"),
            kind.overrides("end"),
        )
        self._stat: torch.Tensor | None = None

    def loss(self, per: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The batch loss from the batch's per-sample cross-entropies (all samples real)."""
        loss, stat = self.objective.loss(per, None, y, self.row)
        self._stat = stat.detach()
        return loss

    def _stats(self) -> torch.Tensor:
        assert self._stat is not None, "loss() comes before the step hooks"
        return self._stat.reshape(1)

    def before_step(self) -> None:
        """After ``backward``, before the optimiser step (a parameter without a gradient gets
        zeros, as the cohort trainer's gradient of an unused parameter is)."""
        if not self._before:
            return
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad.unsqueeze(0) for p in self.params]  # type: ignore[union-attr]
        with torch.no_grad():
            self.objective.before_step(
                grads, [p.unsqueeze(0) for p in self.params], self.extra, self._stats()
            )

    def after_step(self) -> None:
        """After the optimiser step."""
        if self._after:
            with torch.no_grad():
                self.objective.after_step(self._stats(), self.extra)

    def end(self) -> None:
        """After the last step: the objective writes ``ctx.aux_out`` and ``ctx.state``."""
        if not self._end:
            return
        with torch.no_grad():
            final = torch.nn.utils.parameters_to_vector(self.params).unsqueeze(0)
            self.objective.end([self.ctx], self.extra, final)
