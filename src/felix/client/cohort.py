"""Cohort training: many clients' local tasks in one vectorised pass (``torch.func``).

The clients' parameters (and optimiser state) are stacked on a leading dimension and one
``vmap(grad(...))`` call computes every client's gradient for its own batch. Each client does
exactly the steps it would do alone in :meth:`LocalTrainer.train`: its own batch order from its
own generator, its own number of steps, its own last partial batch (padded and masked, so the
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
stack's tensors live in a slab with spare capacity, so a task joins by one copy into a free row.

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

from felix.client.stacked_chain import Aux, Bound, StackedChain, autograd_head, masked_ce_grad
from felix.client.trainer import (
    ClientData,
    TrainConfig,
    autocast,
    has_convolutions,
    one_thread,
    oort_utility,
    thread_invariant,
)
from felix.core.types import ClientUpdate
from felix.strategies.objectives import Objective, TaskContext

log = logging.getLogger("felix.cohort")

# Below this many ready tasks, the sequential trainer is faster (vmap has a fixed cost per step).
MIN_COHORT_CPU = 8
MIN_COHORT_GPU = 2
AUTO_COHORT = 64  # clients per pass when ``run.cohort`` is auto; async runs have about 30 in flight


@dataclass
class CohortTask:
    """One client's training task as the cohort trainer needs it.

    ``state`` is the client's objective state; the trainer writes the new state into it, so a
    shell that may still drop the result passes a copy and keeps it only on completion.
    """

    weights: np.ndarray
    data: ClientData
    state: dict[str, Any]
    aux_in: dict[str, np.ndarray]
    generator: torch.Generator


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


def epoch_batches(n: int, cfg: TrainConfig) -> list[tuple[int, int]]:
    """Per epoch, the samples a client of ``n`` samples reads and the batches it takes, as
    :meth:`LocalTrainer.train` does (``drop_last``, and ``max_steps`` over all epochs; an epoch
    past ``max_steps`` takes none)."""
    bs, steps, out = cfg.batch_size, 0, []
    for _ in range(cfg.epochs):
        stop = n - n % bs if cfg.drop_last else n
        nb = -(-stop // bs)
        if cfg.max_steps is not None:
            nb = min(nb, cfg.max_steps - steps)
        nb = max(nb, 0)
        out.append((min(stop, nb * bs), nb))
        steps += nb
    return out


def task_steps(n: int, cfg: TrainConfig) -> int:
    """The local steps of a client of ``n`` samples (no random draws)."""
    return sum(nb for _, nb in epoch_batches(n, cfg))


def batch_rows(n: int, cfg: TrainConfig, generator: torch.Generator) -> tuple[np.ndarray, int, int]:
    """A client's batches, as :meth:`LocalTrainer.train` takes them: rows of sample indices
    (``-1`` pads a short batch), plus the number of first-epoch rows and samples (Oort's utility
    reads the first epoch only). The order is torch's ``randperm`` from the task's generator, one
    per epoch as the sequential trainer draws them; the rows are laid out in numpy (a task's join
    is on the engine's critical path, and numpy's small operations cost a fraction of torch's)."""
    bs, rows, ep0_rows, ep0_samples = cfg.batch_size, [], 0, 0
    for epoch, (take, nb) in enumerate(epoch_batches(n, cfg)):
        order = torch.randperm(n, generator=generator).numpy()
        if nb == 0:
            continue
        if epoch == 0:
            ep0_rows, ep0_samples = nb, take
        padded = np.full(nb * bs, -1, dtype=np.int64)
        padded[:take] = order[:take]
        rows.append(padded.reshape(nb, bs))
    if not rows:
        return np.empty((0, bs), dtype=np.int64), 0, 0
    return (rows[0] if len(rows) == 1 else np.concatenate(rows)), ep0_rows, ep0_samples


class DataPool:
    """Every client's samples in one device tensor, so a cohort indexes them in place instead of
    concatenating its clients' data for every pass.

    Clients whose data are row slices of one shared tensor (as :func:`felix.scenario.build.build_population`
    makes them) are registered without a copy: the pool adopts that tensor (moved once to the device)
    and records each client's row offset. Other data (augmented clients, data passed in by a user)
    are appended; the buffer grows by doubling, so appends cost amortised O(1) copies."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.x: torch.Tensor | None = None
        self.y: torch.Tensor | None = None
        self.size = 0
        self._at: dict[int, tuple[int, ClientData]] = {}  # id(data) -> (offset, data kept alive)
        self._root: tuple[torch.Tensor, torch.Tensor] | None = None  # the adopted shared (x, y)
        self._batch: torch.Tensor | None = None  # see batch_buffer

    def batch_buffer(self, rows: int) -> torch.Tensor:
        """A buffer of at least ``rows`` samples' shape and dtype, kept from call to call (a step's
        batch is gathered into it; the previous step's is no longer read)."""
        assert self.x is not None
        if self._batch is None or self._batch.shape[0] < rows:
            self._batch = self.x.new_empty((rows, *self.x.shape[1:]))
        return self._batch

    def offsets(self, datas: list[ClientData]) -> list[int]:
        missing = [
            d for d in {id(d): d for d in datas if id(d) not in self._at}.values() if not self._adopt(d)
        ]
        if missing:
            self._append(missing)
        return [self._at[id(d)][0] for d in datas]

    def _adopt(self, d: ClientData) -> bool:
        """Register ``d`` without copying when it is a row slice of the shared tensor (adopting that
        tensor if the pool is still empty); False when ``d`` must be copied in."""
        bx, by = d.x._base, d.y._base
        if bx is None or by is None or not (d.x.is_contiguous() and d.y.is_contiguous()):
            return False
        if self._root is None:
            if self.x is not None or not (bx.is_contiguous() and by.is_contiguous()) or by.dim() != 1:
                return False
            if bx.shape[0] != by.shape[0] or bx.dtype != d.x.dtype or by.dtype != d.y.dtype:
                return False
            self._root = (bx, by)
            self.x, self.y = bx.to(self.device), by.to(self.device)
            self.size = int(bx.shape[0])
        rx, ry = self._root
        if bx is not rx or by is not ry:
            return False
        row = max(1, math.prod(rx.shape[1:]))  # elements per sample
        off_x, off_y = d.x.storage_offset() - rx.storage_offset(), d.y.storage_offset() - ry.storage_offset()
        if off_x % row or off_x // row != off_y:
            return False
        self._at[id(d)] = (int(off_y), d)
        return True

    def _append(self, datas: list[ClientData]) -> None:
        need = self.size + sum(len(d) for d in datas)
        if self.x is None or self.y is None or need > self.x.shape[0]:
            cap = max(need, 2 * (0 if self.x is None else self.x.shape[0]))
            like = datas[0]
            x = torch.empty(cap, *like.x.shape[1:], dtype=like.x.dtype, device=self.device)
            y = torch.empty(cap, dtype=like.y.dtype, device=self.device)
            if self.x is not None and self.y is not None:
                x[: self.size], y[: self.size] = self.x[: self.size], self.y[: self.size]
            self.x, self.y = x, y
        for d in datas:
            n = len(d)
            self.x[self.size : self.size + n] = d.x.to(self.device)
            self.y[self.size : self.size + n] = d.y.to(self.device)
            self._at[id(d)] = (self.size, d)
            self.size += n


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
        self._live = _Stack(self)
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
        stack = _Stack(self)
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


@dataclass
class _Row:
    """One task in a stack: its batches (rows of client-local sample indices, ``-1`` pads a short
    batch), how many it has done, and its objective context."""

    key: int
    task: CohortTask
    batches: np.ndarray
    ep0_rows: int  # first-epoch batches and samples: Oort's utility reads the first epoch only
    ep0_samples: int
    offset: int  # where the client's data starts in the trainer's data pool
    ctx: TaskContext
    w0: np.ndarray  # the weights as dispatched, float32 on the host (the delta's base)
    done: int = 0

    @property
    def steps(self) -> int:
        return int(self.batches.shape[0])

    @property
    def remaining(self) -> int:
        return self.steps - self.done


class _Slab:
    """A stack's per-row tensors, stacked on dim 0 with spare capacity, so a joining task is one copy
    into the next free slot (capacity doubles when full) rather than a concatenation of the whole
    stack; rows leave by reordering in place and truncating.

    The weights and each optimiser state are one flat buffer ``[capacity, P]`` each, read as one
    view per parameter (:meth:`unflat`): a joining task is one copy per buffer, not one per
    parameter, a reorder moves each buffer's rows at once, and a finished task's weights are its
    row as they stand (a small model's step on a CPU is dozens of dispatched operations, and each
    of these would add one per parameter)."""

    def __init__(self, shapes: list[torch.Size]) -> None:
        self._bufs: dict[str, torch.Tensor] = {}
        self._shapes = shapes
        self._unflat: dict[str, list[torch.Tensor]] = {}  # per-parameter views of whole flat buffers
        self.n = 0

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._bufs[name][: self.n]

    def unflat(self, name: str, rows: int) -> list[torch.Tensor]:
        """The first ``rows`` rows of the flat buffer ``name``, one stacked view per parameter
        (``[rows, *shape]``; views, so in-place updates land in the buffer)."""
        views = self._unflat.get(name)
        if views is None:
            buf, at = self._bufs[name], 0
            views = []
            for shape in self._shapes:
                size = math.prod(shape)
                views.append(buf[:, at : at + size].view(buf.shape[0], *shape))
                at += size
            self._unflat[name] = views
        return [v[:rows] for v in views]

    def append(self, values: dict[str, torch.Tensor], zeros: dict[str, torch.Tensor]) -> None:
        """Add one row: ``values`` maps names to the row's tensors (copied in); the rows of the names
        in ``zeros`` start at zero (their tensors give only shape and dtype). The same names each time."""
        cap = next(iter(self._bufs.values())).shape[0] if self._bufs else 0
        if self.n == cap:
            grown = {k: t.new_empty((max(8, 2 * cap), *t.shape)) for k, t in (values | zeros).items()}
            for k, b in self._bufs.items():
                grown[k][: self.n] = b[: self.n]
            self._bufs = grown
            self._unflat.clear()
        for k, t in values.items():
            self._bufs[k][self.n].copy_(t)
        for k in zeros:
            self._bufs[k][self.n].zero_()
        self.n += 1

    def keep(self, order: list[int]) -> None:
        """Keep the rows ``order`` names, in that order; only the rows that change place are copied
        (a row of the FeLiX CNN's stack is megabytes)."""
        moved = [j for j, o in enumerate(order) if o != j]
        if moved:
            dev = next(iter(self._bufs.values())).device
            dst = torch.tensor(moved, device=dev)
            src = torch.tensor([order[j] for j in moved], device=dev)
            for b in self._bufs.values():
                b.index_copy_(0, dst, b.index_select(0, src))
        self.n = len(order)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` rows."""
        self.n = n


@dataclass
class _Views:
    """The first ``a`` rows of a stack's tensors, as one advance's steps read them (views into the
    slab, so in-place updates land there)."""

    params: list[torch.Tensor]
    bound: Bound | dict[str, torch.Tensor]  # the stacked kernel's bound parameters, or vmap's dict
    bufs: list[torch.Tensor]  # momentum / Adam's first moment
    extra: dict[str, torch.Tensor]
    sq_sum: torch.Tensor
    loss_sum: torch.Tensor


@dataclass
class _Plan:
    """One advance's steps, planned on the host in numpy and moved to the device in one copy per
    kind (on a GPU each copy is a stream sync): step ``s`` trains the first ``active[s]`` rows;
    ``index[s]`` are their samples' rows in the data pool (a pad reads row 0), ``mask[s]`` 1 for a
    real sample and 0 for a pad, ``first[s]`` 1 for a row still in its first epoch (Oort's utility
    reads that epoch only). ``full[s]``: no pad among them; ``first_all[s]``: all in their first
    epoch (the products with those ones are left out)."""

    active: list[int]
    index: tuple[torch.Tensor, ...]  # [active * batch] each
    mask: tuple[torch.Tensor, ...]  # [active * batch] each
    first: tuple[torch.Tensor, ...]  # [active] each
    full: list[bool]
    first_all: list[bool]

    @classmethod
    def of(cls, rows: list[_Row], ran: list[int], S: int, bs: int, device: torch.device) -> _Plan:
        if S == 0:  # the due task takes no step (e.g. a client too small for one batch under drop_last)
            return cls([], (), (), (), [], [])
        K = len(rows)
        idx = np.full((S, K, bs), -1, dtype=np.int64)
        first = np.zeros((S, K), dtype=np.float32)
        for j, r in enumerate(rows):
            part = r.batches[r.done : r.done + ran[j]]
            idx[: ran[j], j] = np.where(part >= 0, part + r.offset, -1)
            first[: max(0, min(r.ep0_rows - r.done, ran[j])), j] = 1.0
        active = [sum(1 for n in ran if n > s) for s in range(S)]
        steps = [idx[s, : active[s]].reshape(-1) for s in range(S)]
        firsts = [first[s, : active[s]] for s in range(S)]
        flat = np.concatenate(steps)
        mask = (flat >= 0).astype(np.float32)
        sizes = [a * bs for a in active]
        return cls(
            active=active,
            index=torch.from_numpy(flat.clip(min=0)).to(device).split(sizes),
            mask=torch.from_numpy(mask).to(device).split(sizes),
            first=torch.from_numpy(np.concatenate(firsts)).to(device).split(active),
            full=[bool((t >= 0).all()) for t in steps],
            first_all=[bool(f.all()) for f in firsts],
        )


class _Stack:
    """Tasks of one cohort trainer stacked on dim 0 and stepped together (continuous batching).

    Tasks join at any time and leave when done, so a long task does not step alone while the
    tasks that joined after it wait for a stack of their own. Before each :meth:`advance` the rows
    are ordered by remaining steps, longest first: at every step the tasks still stepping are a
    prefix of the stack (the objective hooks' ``a``), and the tasks that finish are a suffix,
    cut off at the end. Each task's arithmetic is its own: which other tasks share a step does not
    change its result (tests/test_cohort.py), except that on a CPU a convolution computed for one
    client alone takes another kernel than a stack of them (a few ulps; see
    felix.distributed.cohort_executor).

    SGD (momentum, weight decay) and Adam are ``torch.optim``'s per-element arithmetic: a momentum
    buffer starts at zero, so its first step is ``0 * m + g = g``; Adam's bias corrections use each
    task's own step count (runs of rows at the same count step together).
    """

    def __init__(self, trainer: CohortTrainer) -> None:
        self.tr = trainer
        self.rows: list[_Row] = []
        self.slab = _Slab(trainer.shapes)
        opt = trainer.cfg.optimizer == "adam"
        # The flat buffers: weights, momentum / Adam's first moment, Adam's second moment.
        self._state = ["p", *(["m"] if (opt or trainer.cfg.momentum) else []), *(["v"] if opt else [])]
        self._x: list[str] = []  # the objective's per-client tensors
        self._scalar = torch.zeros((), device=trainer.device)  # the shape of a row's loss sums

    # The stacked tensors, live rows only (views into the slab: in-place updates land there).
    def _flat(self, name: str, rows: int) -> list[torch.Tensor]:
        """The first ``rows`` rows of the flat buffer ``name`` as per-parameter views; none for an
        optimiser state this stack does not keep."""
        return self.slab.unflat(name, rows) if name in self._state else []

    @property
    def params(self) -> list[torch.Tensor]:
        return self._flat("p", self.slab.n)

    @property
    def bufs(self) -> list[torch.Tensor]:
        return self._flat("m", self.slab.n)

    @property
    def sq(self) -> list[torch.Tensor]:
        return self._flat("v", self.slab.n)

    @property
    def extra(self) -> dict[str, torch.Tensor]:
        return {k: self.slab["x:" + k] for k in self._x}

    @property
    def sq_sum(self) -> torch.Tensor:
        return self.slab["sq_sum"]  # first-epoch squared per-sample losses

    @property
    def loss_sum(self) -> torch.Tensor:
        return self.slab["loss_sum"]

    def task(self, key: int) -> CohortTask | None:
        return next((r.task for r in self.rows if r.key == key), None)

    def longest(self) -> int:
        return max(self.rows, key=lambda r: r.remaining).key

    # ------------------------------------------------------------------ membership
    def join(self, key: int, task: CohortTask) -> None:
        tr, cfg, dev = self.tr, self.tr.cfg, self.tr.device
        if any(r.key == key for r in self.rows):
            raise ValueError(f"task {key} is already in the cohort stack")
        batches, ep0_rows, ep0_samples = batch_rows(len(task.data), cfg, task.generator)
        (offset,) = tr.pool.offsets([task.data])
        w0 = np.array(task.weights, dtype=np.float32)
        flat0 = torch.from_numpy(w0).to(dev)
        ctx = TaskContext(
            model=tr.model,
            global_params=flat0,
            lr=cfg.lr,
            num_classes=tr.num_classes,
            class_counts=task.data.class_counts(tr.num_classes),
            state=task.state,
            aux_in=task.aux_in,
            steps=int(batches.shape[0]),
        )
        extra = tr.objective.begin([ctx])
        self._x = list(extra)
        values = {"p": flat0}
        values.update(("x:" + k, v[0]) for k, v in extra.items())
        zeros = {"sq_sum": self._scalar, "loss_sum": self._scalar}
        zeros.update((k, flat0) for k in self._state[1:])
        self.slab.append(values, zeros)
        self.rows.append(_Row(key, task, batches, ep0_rows, ep0_samples, offset, ctx, w0))

    def drop(self, key: int) -> bool:
        at = next((j for j, r in enumerate(self.rows) if r.key == key), None)
        if at is None:
            return False
        order = list(range(len(self.rows) - 1))
        if at < len(order):
            order[at] = len(order)  # the last row fills the gap: one row copied
        self._take(order)
        return True

    def _take(self, order: list[int]) -> None:
        """Keep the rows ``order`` names, in that order, in every stacked tensor."""
        self.rows = [self.rows[j] for j in order]
        self.slab.keep(order)

    # ------------------------------------------------------------------ stepping
    def advance(self, key: int) -> dict[int, ClientUpdate]:
        tr, cfg, dev = self.tr, self.tr.cfg, self.tr.device
        target = next((r for r in self.rows if r.key == key), None)
        if target is None:
            raise KeyError(f"task {key} is not in the cohort stack")
        order = self._lockstep_order(target.remaining)
        if order != list(range(len(self.rows))):
            self._take(order)
        rows, bs, S = self.rows, cfg.batch_size, target.remaining
        x_all, y_all = tr.pool.x, tr.pool.y
        assert x_all is not None and y_all is not None
        ran = [min(r.remaining, S) for r in rows]
        plan = _Plan.of(rows, ran, S, bs, dev)
        done_before = [r.done for r in rows]
        stats = tr.stats
        stats.advances += 1
        stats.lockstep_steps += S
        stats.client_steps += sum(ran)

        # Views of the first ``a`` rows, made once per ``a`` (the active rows shrink a few times per
        # advance) rather than once per step: each view is a dispatched operation.
        views: dict[int, _Views] = {}
        bind = tr.chain.bind if tr.chain is not None else None
        xshape = x_all.shape[1:]
        # Each step's samples are gathered into one buffer, reused from step to step: a fresh
        # tensor per step would be memory the CPU's caches have not seen (on this workload the
        # gather is a tenth of the training time, bound by memory).
        xbuf = tr.pool.batch_buffer(len(rows) * bs)
        for s in range(S):
            a = plan.active[s]
            v = views.get(a)
            if v is None:
                v = views[a] = self._views(a, bind)
            ix, full = plan.index[s], plan.full[s]
            xb = torch.index_select(x_all, 0, ix, out=xbuf[: a * bs]).view(a, bs, *xshape)
            yb = y_all.index_select(0, ix).view(a, bs)
            # ``None``: every sample is real (the stacked kernel's heads skip the mask); vmap needs it.
            mb = None if full and bind is not None else plan.mask[s].view(a, bs)
            with one_thread(a == 1 and tr.one_thread):
                g, (per, loss, stat) = tr.grad(v.bound, xb, yb, mb, v.extra)
            grads = [g[n] for n in tr.names]
            if tr.has_before:
                tr.objective.before_step(grads, v.params, v.extra, stat)
            self._step(a, grads, v, done_before, s)
            if tr.has_after:
                tr.objective.after_step(stat, v.extra)
            # Oort's first-epoch sum of squared per-sample losses; products with a mask or a
            # first-epoch flag of ones are left out (they change no bit).
            sq_step = per * per
            if not full:
                sq_step = sq_step * plan.mask[s].view(a, bs)
            sq_step = sq_step.sum(1)
            if not plan.first_all[s]:
                sq_step = sq_step * plan.first[s]
            v.sq_sum.add_(sq_step)
            v.loss_sum.add_(loss)
        for j, r in enumerate(rows):
            r.done += ran[j]

        # The tasks that are done form the suffix: their updates, then the stack keeps the rest.
        f = sum(1 for r in rows if r.remaining > 0)
        fin = rows[f:]
        final = self.slab["p"][f:]  # the finished rows' weights, flat
        tr.objective.end([r.ctx for r in fin], {k: v[f:] for k, v in self.extra.items()}, final)
        # The deltas on the host, from the weights as dispatched (the same float32 subtraction as on
        # the device): the stack keeps no copy of them, which every join and reorder would move.
        trained = final.cpu().numpy()
        sq, ls = self.sq_sum[f:].cpu().tolist(), self.loss_sum[f:].cpu().tolist()
        out: dict[int, ClientUpdate] = {}
        for j, r in enumerate(fin):
            n = len(r.task.data)
            out[r.key] = ClientUpdate(
                num_samples=n,
                stat_utility=oort_utility(sq[j], r.ep0_samples, n),
                loss=ls[j] / r.steps if r.steps else 0.0,
                duration=0.0,
                delta=trained[j] - r.w0,
                aux=r.ctx.aux_out,
            )
        self.rows = rows[:f]
        self.slab.truncate(f)
        return out

    def _lockstep_order(self, S: int) -> list[int]:
        """The rows' order for an advance of ``S`` steps: the rows that go on after it (more than
        ``S`` steps left), then those that step all ``S`` and finish, then those that finish sooner,
        longest first. So the rows stepping at any step are a prefix and the finished ones a suffix.
        Within the first two groups any order serves, so rows already in place stay there and
        only the others are moved (each move copies a row of every stacked tensor)."""
        rem = [r.remaining for r in self.rows]
        order: list[int] = []
        for member in (lambda n: n > S, lambda n: n == S):
            group = [j for j, n in enumerate(rem) if member(n)]
            lo, hi = len(order), len(order) + len(group)
            movers = iter(j for j in group if not lo <= j < hi)  # as many as the others in [lo, hi)
            order += [j if member(rem[j]) else next(movers) for j in range(lo, hi)]
        return order + sorted((j for j, n in enumerate(rem) if n < S), key=lambda j: -rem[j])  # stable

    def _views(self, a: int, bind: Callable[[dict[str, torch.Tensor]], Bound] | None) -> _Views:
        """The first ``a`` rows' stacked tensors (views into the slab)."""
        params = self._flat("p", a)
        named = dict(zip(self.tr.names, params))
        return _Views(
            params=params,
            bound=bind(named) if bind is not None else named,
            bufs=self._flat("m", a),
            extra={k: v[:a] for k, v in self.extra.items()},
            sq_sum=self.sq_sum[:a],
            loss_sum=self.loss_sum[:a],
        )

    def _step(self, a: int, grads: list[torch.Tensor], v: _Views, done_before: list[int], s: int) -> None:
        """One optimiser step of the first ``a`` rows (their views ``v``), the ``s``-th of this
        advance (row ``j``'s step number, from 1, is ``done_before[j] + s + 1``)."""
        cfg = self.tr.cfg
        if cfg.weight_decay:
            grads = [g.add(p, alpha=cfg.weight_decay) for g, p in zip(grads, v.params)]
        if cfg.optimizer == "adam":
            # Rows at the same step number share torch.optim.Adam's scalar bias corrections.
            t = [done_before[j] + s + 1 for j in range(a)]
            j = 0
            while j < a:
                e = j + 1
                while e < a and t[e] == t[j]:
                    e += 1
                self._adam(slice(j, e), [g[j:e] for g in grads], t[j])
                j = e
            return
        if cfg.momentum:
            for g, b in zip(grads, v.bufs):
                b.mul_(cfg.momentum).add_(g)
            grads = v.bufs
        torch._foreach_add_(v.params, grads, alpha=-cfg.lr)

    def _adam(self, rows: slice, grads: list[torch.Tensor], t: int) -> None:
        beta1, beta2, eps = 0.9, 0.999, 1e-8
        step_size = self.tr.cfg.lr / (1 - beta1**t)
        bc2_sqrt = math.sqrt(1 - beta2**t)
        for p, g, m, v in zip(self.params, grads, self.bufs, self.sq):
            p, m, v = p[rows], m[rows], v[rows]
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            p.addcdiv_(m, (v.sqrt() / bc2_sqrt).add_(eps), value=-step_size)
