"""Local work on one client: a training task and a forward-pass eval task.

Shared by the simulation engine and the MQTT client so both shells train identically. Weights
travel as flat float32 vectors; the model here is only a workspace they are loaded into. Which
buffers travel with the parameters and which are kept per client is ``TrainConfig.buffers``
(:mod:`felix.client.weights`): nothing of one client's task is left in the workspace for the next.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from felix.client.schedule import epoch_batches
from felix.client.settings import Buffers, TrainSettings, buffers_field
from felix.client.weights import ModelWeights
from felix.core.types import ClientUpdate
from felix.strategies.objectives import Objective, OneClient, TaskContext


class TrainConfig(TrainSettings):
    """The trainer's settings: the client section's local schedule and optimiser (one declaration,
    :class:`~felix.client.settings.TrainSettings`), where buffers live, and whether to send the
    loss at the received model as an aux entry (q-FFL's F_k)."""

    buffers: Buffers = buffers_field()
    probe_loss_key: str | None = None

    @classmethod
    def of(cls, client: Any) -> TrainConfig:
        """The trainer's settings from a config's ``client`` section, each field by its name (the
        section declares them all, with the same meaning); ``probe_loss`` asks for q-FFL's loss at
        the received model as aux ``qffl_loss``."""
        names = [n for n in cls.model_fields if n != "probe_loss_key"]
        return cls(
            **{n: getattr(client, n) for n in names},
            probe_loss_key="qffl_loss" if client.probe_loss else None,
        )


@dataclass
class ClientData:
    x: torch.Tensor
    y: torch.Tensor
    _counts: torch.Tensor | None = field(default=None, repr=False, compare=False)
    _on: tuple[torch.device, torch.Tensor, torch.Tensor] | None = field(
        default=None, repr=False, compare=False
    )

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (Ray's object store, a deep copy) with its own rows only: a client's data may be
        a view of the whole partitioned training set, whose storage torch would pickle entire."""
        state = dict(self.__dict__)
        state.update(x=_compact(self.x), y=_compact(self.y), _on=None)
        return state

    def class_counts(self, num_classes: int) -> torch.Tensor:
        """Samples per class, computed once: the data only changes by replacing x and y."""
        if self._counts is None or self._counts.numel() != num_classes:
            self._counts = torch.bincount(self.y, minlength=num_classes)
        return self._counts

    def on(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` on ``device``, copied there once (a GPU run keeps every client's data resident;
        augmentation replaces the ``ClientData``, which drops the copy)."""
        device = torch.device(device)
        if self.x.device == device:
            return self.x, self.y
        if self._on is None or self._on[0] != device:
            self._on = (device, self.x.to(device), self.y.to(device))
        return self._on[1], self._on[2]


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a copy of its elements when it views a larger storage."""
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


def oort_utility(sq_loss_sum: float, n_seen: int, n_data: int) -> float:
    """Oort's statistical utility |D| * sqrt(mean squared per-sample loss)."""
    if n_seen == 0:
        return 0.0
    return float(n_data) * math.sqrt(sq_loss_sum / n_seen)


def autocast(device: torch.device | str, dtype: torch.dtype | None) -> AbstractContextManager[Any]:
    """Mixed precision for forward passes when ``dtype`` is set (``run.precision: bf16``), else nothing."""
    return torch.autocast(torch.device(device).type, dtype=dtype) if dtype is not None else nullcontext()


@contextmanager
def one_thread(when: bool = True) -> Iterator[None]:
    """torch on one intra-op thread inside (``run.threads`` restored after), when ``when``.

    MKL splits a single small product over the threads it is given, and then rounds it
    differently: a client's ``[10, 32] x [32, 64]`` weight gradient has other bits on two threads
    than on one. A product over a cohort's clients splits by client instead, each client's part on
    one thread, with the same bits at any thread count. So a model without convolutions runs its
    single-client products on one thread (:func:`thread_invariant`), and its run gives the same
    bits at any ``run.threads``: the threads go to the cohorts and the evaluation, which gain from
    them. Setting the thread count costs well under a microsecond."""
    n = torch.get_num_threads()
    if not when or n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def thread_invariant(model: nn.Module, device: torch.device | str) -> bool:
    """Whether ``model`` on ``device`` keeps its single-client products on one thread
    (:func:`one_thread`): on a CPU, a model without convolutions, whose products are too small to
    gain from more (the sequential MLP loop ran as fast on two threads as on one). A convolution's
    threads are worth their other bits."""
    return torch.device(device).type == "cpu" and not has_convolutions(model)


def has_convolutions(model: nn.Module) -> bool:
    """Whether any of ``model``'s modules is a convolution (of any dimension)."""
    return any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())


def local_loop(
    model: nn.Module,
    params: Sequence[torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: TrainConfig,
    hooks: OneClient,
    generator: torch.Generator,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[float, float]:
    """felix's sequential local training of one client, on ``model`` as loaded with the received
    weights: a fresh optimiser over ``params`` (``cfg``'s), ``cfg``'s epochs of batches in an
    order drawn from ``generator`` (:func:`~felix.client.schedule.epoch_batches`, the cohort
    trainer's schedule too), the objective's ``hooks`` around each step (the step count in
    ``hooks.ctx.steps``; ``hooks.end()`` is the caller's). Returns Oort's statistical utility
    (over the first epoch's samples) and the mean batch loss. :class:`LocalTrainer` and the
    Flower helper :func:`felix.flower.helpers.local_train` both run it: one loop, the same updates."""
    opt: torch.optim.Optimizer
    if cfg.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    else:
        opt = torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    ctx = hooks.ctx
    if not model.training:  # a recursive walk over modules; only after an eval probe
        model.train()
    device = x.device
    n = int(y.shape[0])
    # One forward pass and one cross-entropy per batch: the per-sample losses feed both the
    # objective and Oort's utility. Sums stay tensors on the device: one sync at the end.
    sq_sum = torch.zeros((), device=device)
    loss_sum = torch.zeros((), device=device)
    seen, batches = 0, 0
    mixed = autocast_dtype is not None
    bs = cfg.batch_size
    for epoch, (take, nb) in enumerate(epoch_batches(n, cfg)):
        order = torch.randperm(n, generator=generator).to(device)
        for start in range(0, nb * bs, bs):
            idx = order[start : min(start + bs, take)]
            yb = y[idx]
            if mixed:
                with autocast(device, autocast_dtype):
                    logits = model(x[idx]).float()
            else:
                logits = model(x[idx])
            per = F.cross_entropy(logits, yb, reduction="none")
            if epoch == 0:
                sq_sum += per.detach().square().sum()
                seen += int(idx.shape[0])
            loss = hooks.loss(per, yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            hooks.before_step()
            opt.step()
            ctx.steps += 1
            hooks.after_step()
            loss_sum += loss.detach()
            batches += 1
    utility = oort_utility(float(sq_sum.cpu()), seen, n)
    return utility, float(loss_sum.cpu()) / batches if batches else 0.0


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _single_client(method: _Method) -> _Method:
    """A :class:`LocalTrainer` method, on one thread where its model keeps single-client work
    there (:func:`one_thread`)."""

    @functools.wraps(method)
    def on_its_threads(self: LocalTrainer, *args: Any, **kwargs: Any) -> Any:
        with one_thread(self._one_thread):
            return method(self, *args, **kwargs)

    return cast(_Method, on_its_threads)


class LocalTrainer:
    def __init__(
        self,
        model: nn.Module,
        objective: Objective,
        cfg: TrainConfig,
        num_classes: int,
        device: str = "cpu",
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model.to(device)
        self.objective = objective
        self.cfg = cfg
        self.num_classes = num_classes
        self.device = device
        self.autocast_dtype = autocast_dtype
        self.weights = ModelWeights(self.model, cfg.buffers)
        self._params = self.weights.params
        self._one_thread = thread_invariant(self.model, device)

    def load(self, weights: np.ndarray) -> torch.Tensor:
        """Load the received vector (parameters, and buffers under ``aggregate``) into the
        workspace; the kept buffers are reset to the factory's values (a task sets its own)."""
        flat = torch.from_numpy(np.array(weights, dtype=np.float32, copy=True)).to(self.device)
        # The parameters become views of the loaded vector: give it its own copy so that ``flat``
        # keeps the received weights for the delta.
        self.weights.load(flat.clone())
        self.weights.set_kept(None)
        return flat

    @_single_client
    def train(
        self,
        weights: np.ndarray,
        data: ClientData,
        state: dict[str, Any],
        aux_in: dict[str, np.ndarray],
        generator: torch.Generator,
    ) -> ClientUpdate:
        """Run the local epochs; the utility comes from the losses seen in the first epoch."""
        cfg = self.cfg
        received_loss = None if cfg.probe_loss_key is None else self.probe(weights, data).loss
        flat = self.load(weights)
        self.weights.begin_task(state)
        n = len(data)
        num_params = self.weights.num_params
        ctx = TaskContext(
            model=self.model,
            global_params=flat if num_params == flat.numel() else flat[:num_params],
            lr=cfg.lr,
            num_classes=self.num_classes,
            class_counts=data.class_counts(self.num_classes),
            state=state,
            aux_in=aux_in,
        )
        # The objective's hooks, for a stack of one client (hooks it does not override are not called).
        hooks = OneClient(self.objective, ctx, self._params)
        x, y = data.on(self.device)
        utility, loss = local_loop(self.model, self._params, x, y, cfg, hooks, generator, self.autocast_dtype)
        hooks.end()
        self.weights.end_task(state)
        if cfg.probe_loss_key is not None:
            ctx.aux_out[cfg.probe_loss_key] = np.array(received_loss, dtype=np.float64)
        with torch.no_grad():
            delta = (self.weights.vector() - flat).cpu().numpy()
        return ClientUpdate(
            num_samples=n, stat_utility=utility, loss=loss, duration=0.0, delta=delta, aux=ctx.aux_out
        )

    @_single_client
    @torch.no_grad()
    def probe(self, weights: np.ndarray, data: ClientData, batch_size: int = 256) -> ClientUpdate:
        """TierSelect's eval task: one forward pass, reply with the statistical utility only (kept
        buffers at the factory's values, as the global model is evaluated)."""
        self.load(weights)
        self.model.eval()
        x, y = data.on(self.device)
        n = len(data)
        sq_sum = torch.zeros((), device=self.device)
        loss_sum = torch.zeros((), device=self.device)
        for start in range(0, n, batch_size):
            with autocast(self.device, self.autocast_dtype):
                logits = self.model(x[start : start + batch_size]).float()
            per = F.cross_entropy(logits, y[start : start + batch_size], reduction="none")
            sq_sum += (per * per).sum()
            loss_sum += per.sum()
        return ClientUpdate(
            num_samples=n,
            stat_utility=oort_utility(float(sq_sum.cpu()), n, n),
            loss=float(loss_sum.cpu()) / n if n else 0.0,
            duration=0.0,
        )
