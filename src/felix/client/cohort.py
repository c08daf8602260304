"""Cohort training: many clients' local tasks in one vectorised pass (``torch.func``).

The clients' parameters (and optimiser state) are stacked on a leading dimension and one
``vmap(grad(...))`` call computes every client's gradient for its own batch. Each client does
exactly the steps it would do alone in :meth:`LocalTrainer.train` (one batch schedule,
:mod:`felix.client.schedule`) and the objective's same hooks: its own batch order from its own generator, its own number of steps, its own last partial batch (padded and masked, so the
masked mean equals the mean over the short batch). Clients are ordered by remaining steps,
longest first, so at every step the clients still stepping are a prefix of the stack: a finished
client costs nothing and needs no masking of its update.

Two ways in: :meth:`CohortTrainer.train` trains a group to the end (remote executors, tests);
:meth:`~CohortTrainer.join` / :meth:`~CohortTrainer.advance` keep a live stack that tasks join
whenever they are dispatched and leave when done, stepping only as far as the task that is due
needs (the simulator's continuous batching).

A model that is a chain of Flatten / Linear / ReLU / Conv2d / MaxPool2d (the MLP and both CNNs)
skips functorch: a hand-written stacked forward and backward (:mod:`felix.client.stacked_chain`)
issues the same batched operations, bit-identical and without vmap's fixed cost per step. The
stack (:mod:`felix.client.cohort_stack`) keeps its tensors in a slab with spare capacity, so a
task joins by one copy into a free row.

One forward pass per batch gives the objective's loss and Oort's per-sample losses; sums stay on
the device and come back in one transfer at the end. On a GPU this is where the speed is; on a
CPU it pays for small dense models and loses on convolutions (see :func:`resolve_cohort`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from felix.client.cohort_stack import CohortTask, DataPool, LiveStack
from felix.client.stacked_chain import Aux, StackedChain, autograd_head, masked_ce_grad
from felix.client.trainer import (
    ClientData,
    TrainConfig,
    autocast,
    has_convolutions,
    oort_utility,
    thread_invariant,
)
from felix.core.types import ClientUpdate
from felix.strategies.objectives import Objective

log = logging.getLogger("felix.cohort")

# Below this many ready tasks, the sequential trainer is faster (vmap has a fixed cost per step).
MIN_COHORT_CPU = 8
MIN_COHORT_GPU = 2
AUTO_COHORT = 64  # clients per pass when ``run.cohort`` is auto; async runs have about 30 in flight


def cohort_blocker(model: nn.Module, objective: Objective | None = None) -> str | None:
    """Why ``model`` (with ``objective``) cannot be trained in cohorts, or None when it can."""
    if any(True for _ in model.buffers()):
        return (
            "the model has buffers (e.g. BatchNorm running statistics), which vmap cannot update per client"
        )
    for m in model.modules():
        if isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.Dropout, nn.modules.dropout._DropoutNd)):
            return f"the model has a {type(m).__name__} layer, whose training-mode behaviour differs per call"
    if objective is not None and not objective.cohort:
        return f"objective {objective.name!r} sets cohort = False (its loss does not run under vmap)"
    return None


def conv_macs(model: nn.Module, sample_shape: tuple[int, ...]) -> int:
    """Multiply-accumulates of the model's convolutions for one sample (one forward pass, hooked)."""
    total = 0

    def count(m: nn.Module, _: Any, out: torch.Tensor) -> None:
        nonlocal total
        assert isinstance(m, nn.modules.conv._ConvNd)
        total += out.numel() * (m.in_channels // m.groups) * math.prod(m.kernel_size)

    hooks = [
        m.register_forward_hook(count) for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)
    ]
    try:
        if hooks:
            with torch.no_grad():
                p = next(model.parameters())
                model(torch.zeros(1, *sample_shape, dtype=p.dtype, device=p.device))
    finally:
        for h in hooks:
            h.remove()
    return total


# On a CPU, vmap turns a batch of clients' convolutions into one grouped convolution, slower than
# the clients' own convolutions once they are big: measured on 2 cores (fp32, batch 32), the small
# CNN on 8x8 inputs (83k conv MACs per sample) ran at 0.54-0.73x the sequential time per client
# step, on 16x16 (332k) at 0.90-1.00x, on 28x28 (1M) at 1.2-2.0x; the FeLiX CNN (19M) at 1.3-1.9x.
CPU_CONV_MACS_LIMIT = 150_000


def resolve_cohort(
    setting: str | int,
    model: nn.Module,
    objective: Objective,
    device: str,
    sample_shape: tuple[int, ...] | None = None,
) -> tuple[int, int]:
    """``run.cohort`` to (cohort size, smallest cohort worth a vectorised pass); size 1 = sequential.

    ``auto`` is a fixed rule of the model and device (never a timing, so a config gives the same
    run on every machine): vectorised on a GPU; on a CPU for models whose convolutions, if any,
    cost at most ``CPU_CONV_MACS_LIMIT`` per sample (dense layers gain from batched matrix
    products, large convolutions lose; see benchmarks/engine_speed.py).
    """
    on_gpu = not str(device).startswith("cpu")
    min_k = MIN_COHORT_GPU if on_gpu else MIN_COHORT_CPU
    if setting == 1 or setting == "1":
        return 1, 1
    blocker = cohort_blocker(model, objective)
    if blocker is not None:
        log.warning("run.cohort=%s: training sequentially, since %s", setting, blocker)
        return 1, 1
    if setting == "auto":
        if not on_gpu and has_convolutions(model):
            macs = None if sample_shape is None else conv_macs(model, sample_shape)
            if macs is None or macs > CPU_CONV_MACS_LIMIT:
                log.info(
                    "run.cohort=auto: sequential training (convolutions of %s MACs per sample are faster "
                    "unvectorised on CPU)",
                    macs if macs is not None else "unknown",
                )
                return 1, 1
        return AUTO_COHORT, min_k
    return int(setting), 2


@dataclass
class CohortStats:
    """How a cohort trainer's work was shaped (for the engine benchmark: on a GPU the cost of a
    lockstep step is mostly fixed, so rows per step is what cohorts buy)."""

    advances: int = 0  # stack advances (each until one task is done)
    lockstep_steps: int = 0  # stacked optimiser steps
    client_steps: int = 0  # client steps they did (rows summed over lockstep steps)
    probe_calls: int = 0  # stacked eval-task passes
    probe_rows: int = 0  # eval tasks they computed

    @property
    def mean_rows(self) -> float:
        """Clients per lockstep step, on average."""
        return self.client_steps / self.lockstep_steps if self.lockstep_steps else 0.0


class CohortTrainer:
    """Trains a list of tasks of one model and objective together; see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        objective: Objective,
        cfg: TrainConfig,
        num_classes: int,
        device: str = "cpu",
        autocast: torch.dtype | None = None,
        sample_shape: tuple[int, ...] | None = None,
    ) -> None:
        """``sample_shape`` (one sample's, e.g. ``(3, 32, 32)``) lets a convolutional chain use the
        stacked-chain kernel, which is checked against vmap on an input of that shape."""
        blocker = cohort_blocker(model, objective)
        if blocker is not None:
            raise ValueError(f"cannot train in cohorts: {blocker}")
        self.device = torch.device(device)
        self.model = model.to(self.device).train()
        self.objective = objective
        self.cfg = cfg
        self.num_classes = num_classes
        self.autocast = autocast
        self.sample_shape = sample_shape
        self.pool = DataPool(self.device)
        self.names = [n for n, _ in self.model.named_parameters()]
        self.shapes = [p.shape for _, p in self.model.named_parameters()]
        self.numels = [p.numel() for _, p in self.model.named_parameters()]
        # A chain of plain layers (the MLP, the CNNs) gets the hand-written stacked kernel,
        # bit-identical to vmap.
        # The plain cross-entropy objective's loss is stacked arithmetic; any other runs per client.
        plain = not type(objective).overrides("loss")
        head = masked_ce_grad if plain else autograd_head(vmap(self._head))
        self.chain = StackedChain.of(self.model, head, sample_shape) if autocast is None else None
        # (stacked parameters, x, y, mask, extra) -> (gradients by name, aux); the kernel also takes
        # its bound parameters and a mask of None (every sample real)
        self.grad: Callable[..., tuple[dict[str, torch.Tensor], Aux]] = (
            self.chain.grad if self.chain is not None else vmap(grad(self._loss, has_aux=True))
        )
        self._forward = self.chain.forward if self.chain is not None else vmap(self._logits)
        # A step of one client is a single-client product: on one thread, as in the sequential
        # trainer (felix.client.trainer.one_thread), so that the run's bits do not depend on run.threads.
        self.one_thread = thread_invariant(self.model, self.device)
        obj = type(objective)
        self.has_before = obj.overrides("before_step")
        self.has_after = obj.overrides("after_step")
        self._live = LiveStack(self)
        self.stats = CohortStats()

    # ------------------------------------------------------------------ per-client functions (vmapped)
    def _logits(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        with autocast(self.device, self.autocast):
            return functional_call(self.model, params, (x,)).float()

    def _loss(
        self,
        params: dict[str, torch.Tensor],
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor,
        extra: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        return self._head(self._logits(params, x), y, mask, extra)

    def _head(
        self, logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, extra: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, Aux]:
        per = F.cross_entropy(logits, y, reduction="none")
        loss, stat = self.objective.loss(per, mask, y, extra)
        return loss, (per.detach(), loss.detach(), stat.detach())

    # ------------------------------------------------------------------ training
    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Stacked flat weights ``[K, P]`` as stacked parameters, one tensor per parameter."""
        return [
            t.reshape(flat.shape[0], *s).clone() for t, s in zip(flat.split(self.numels, dim=1), self.shapes)
        ]

    def train(self, tasks: list[CohortTask]) -> list[ClientUpdate]:
        """Train ``tasks`` together to the end, one update per task in order (a one-off stack:
        the continuous stack of :meth:`join` / :meth:`advance` is not touched)."""
        stack = LiveStack(self)
        for k, t in enumerate(tasks):
            stack.join(k, t)
        done: dict[int, ClientUpdate] = {}
        while len(done) < len(tasks):
            done.update(stack.advance(stack.longest()))
        return [done[k] for k in range(len(tasks))]

    # ------------------------------------------------------------------ continuous batching
    def join(self, key: int, task: CohortTask) -> None:
        """Add ``task`` (under ``key``, e.g. its task id) to the live stack; it trains, a step at a
        time beside the others, whenever :meth:`advance` runs."""
        self._live.join(key, task)

    def advance(self, key: int) -> dict[int, ClientUpdate]:
        """Step every live task in lockstep until ``key``'s is done; return the updates of all tasks
        that finished (``key``'s among them), which leave the stack. The others keep their progress."""
        return self._live.advance(key)

    def advance_steps(self, steps: int) -> dict[int, ClientUpdate]:
        """Step every live task ``steps`` times or until it is done (one share of a split stack);
        the updates of the tasks that finished, which leave the stack."""
        return self._live.steps(steps)

    def live_work(self) -> int:
        """Steps the live tasks have left, summed."""
        return self._live.work()

    def remaining(self, key: int) -> int:
        """Steps ``key``'s live task has left (``KeyError`` when it is not in the live stack)."""
        return self._live.remaining(key)

    def drop(self, key: int) -> bool:
        """Remove ``key``'s task from the live stack unfinished (cancelled, or its data changed)."""
        return self._live.drop(key)

    def live(self, key: int) -> CohortTask | None:
        """``key``'s task while it is in the live stack."""
        return self._live.task(key)

    @property
    def live_count(self) -> int:
        return len(self._live.rows)

    @torch.no_grad()
    def probe(
        self, weights: list[np.ndarray], datas: list[ClientData], batch_size: int = 256
    ) -> list[ClientUpdate]:
        """TierSelect's eval task for several clients at once: one forward pass over each client's data.

        A dense chain (Linear and ReLU layers: each sample's logits are its own row of the products)
        runs the clients that were sent the same weights (usually all: eval tasks carry the global
        model) as one batch of all their samples, with no padding; other models run the clients
        stacked, each padded to whole chunks of ``batch_size`` samples (on Dirichlet(0.1) clients
        about half of those rows are padding). Both give the same sums, in the same order: per client,
        chunk by chunk of ``batch_size`` samples."""
        K = len(datas)
        self.stats.probe_calls += 1
        self.stats.probe_rows += K
        offsets = self.pool.offsets(datas)
        sizes = [len(d) for d in datas]
        if self.chain is not None and self.chain.dense:
            groups: dict[int, list[int]] = {}
            for k, w in enumerate(weights):
                groups.setdefault(id(w), []).append(k)
            parts = [
                self._probe_packed(weights[ks[0]], ks, sizes, offsets, batch_size) for ks in groups.values()
            ]
            sums = {k: (sq, ls) for ks, part in zip(groups.values(), parts) for k, sq, ls in zip(ks, *part)}
        else:
            sums = self._probe_stacked(weights, sizes, offsets, batch_size)
        return [
            ClientUpdate(
                num_samples=n,
                stat_utility=oort_utility(sums[k][0], n, n),
                loss=sums[k][1] / n if n else 0.0,
                duration=0.0,
            )
            for k, n in enumerate(sizes)
        ]

    def _chunk_sums(
        self, per: torch.Tensor, sizes: list[int], batch_size: int
    ) -> tuple[list[float], list[float]]:
        """Per client, the sums of squared and of plain per-sample losses, added up chunk by chunk.

        ``per`` is ``[K, chunks * batch_size]``, zero past each client's samples. Each chunk's sum
        runs over all ``batch_size`` entries (pads add zero), and a client's chunk sums are added in
        order in float32, as the stacked probe does them on the device."""
        chunks = per.view(len(sizes), -1, batch_size)
        sq = (chunks * chunks).sum(2).cpu().numpy()
        ls = chunks.sum(2).cpu().numpy()
        sq_acc, ls_acc = sq[:, 0].copy(), ls[:, 0].copy()
        used = -(-np.asarray(sizes) // batch_size)
        for c in range(1, sq.shape[1]):
            more = used > c
            sq_acc[more] += sq[more, c]
            ls_acc[more] += ls[more, c]
        return sq_acc.tolist(), ls_acc.tolist()

    def _probe_packed(
        self, weights: np.ndarray, ks: list[int], sizes: list[int], offsets: list[int], batch_size: int
    ) -> tuple[list[float], list[float]]:
        """:meth:`probe` for the clients ``ks``, sent the same ``weights``: their samples in one batch
        (padded to a whole number of chunks, as small batches take other kernels), forwarded in
        pieces of at most ``AUTO_COHORT`` chunks."""
        x_all, y_all = self.pool.x, self.pool.y
        assert x_all is not None and y_all is not None
        n = [sizes[k] for k in ks]
        total = sum(n)
        rows = -(-max(total, 1) // batch_size) * batch_size
        ix = np.zeros(rows, dtype=np.int64)  # pads read sample 0 of the pool; their losses are dropped
        if total:
            ix[:total] = np.concatenate([np.arange(offsets[k], offsets[k] + sizes[k]) for k in ks])
        ix_dev = torch.from_numpy(ix).to(self.device)
        flat = torch.from_numpy(np.array(weights, dtype=np.float32)).to(self.device).unsqueeze(0)
        params = dict(zip(self.names, self.split(flat)))
        per = torch.empty(rows, device=self.device)
        piece = AUTO_COHORT * batch_size
        for start in range(0, rows, piece):
            part = ix_dev[start : start + piece]
            xb = x_all.index_select(0, part).unsqueeze(0)
            logits = self._forward(params, xb)[0]
            per[start : start + piece] = F.cross_entropy(
                logits, y_all.index_select(0, part), reduction="none"
            )
        width = -(-max(n, default=1) // batch_size) * batch_size
        padded = torch.zeros(len(ks), max(width, batch_size), device=self.device)
        cols = np.concatenate([np.arange(m) for m in n]) if total else np.zeros(0, dtype=np.int64)
        which = np.repeat(np.arange(len(ks)), n)
        padded[torch.from_numpy(which).to(self.device), torch.from_numpy(cols).to(self.device)] = per[:total]
        return self._chunk_sums(padded, n, batch_size)

    def _probe_stacked(
        self, weights: list[np.ndarray], sizes: list[int], offsets: list[int], batch_size: int
    ) -> dict[int, tuple[float, float]]:
        """:meth:`probe` with the clients stacked (each its own weights), longest first, each padded
        to whole chunks of ``batch_size`` samples."""
        x_all, y_all = self.pool.x, self.pool.y
        assert x_all is not None and y_all is not None
        K = len(sizes)
        order = sorted(range(K), key=lambda k: -sizes[k])
        ordered = [sizes[k] for k in order]
        flat = torch.from_numpy(np.stack([np.asarray(weights[k], dtype=np.float32) for k in order])).to(
            self.device
        )
        params = self.split(flat)
        chunks = -(-ordered[0] // batch_size) if K and ordered[0] else 1
        per_all = torch.zeros(K, chunks * batch_size, device=self.device)
        # Every chunk's sample indices into the pool and 0/1 mask, [chunks, K, batch]: built on the
        # host and moved once, not once per chunk (on a GPU each move is a stream sync).
        local = torch.arange(chunks * batch_size).view(chunks, 1, batch_size)
        size = torch.tensor(ordered).view(1, K, 1)
        m_all = (local < size).float().to(self.device)
        ix_all = (
            torch.tensor([offsets[k] for k in order]).view(1, K, 1) + torch.minimum(local, size - 1)
        ).to(self.device)
        for c in range(chunks):
            a = sum(1 for n in ordered if n > c * batch_size)
            if a == 0:  # every client is empty
                break
            m, ix = m_all[c, :a], ix_all[c, :a]
            xb = x_all.index_select(0, ix.flatten()).view(a, batch_size, *x_all.shape[1:])
            yb = y_all.index_select(0, ix.flatten())
            logits = self._forward({n: p[:a] for n, p in zip(self.names, params)}, xb)
            per = F.cross_entropy(logits.flatten(0, 1), yb, reduction="none").view(a, batch_size) * m
            per_all[:a, c * batch_size : (c + 1) * batch_size] = per
        sq, ls = self._chunk_sums(per_all, ordered, batch_size)
        return {k: (sq[j], ls[j]) for j, k in enumerate(order)}
