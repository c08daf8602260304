"""The cohort trainer's live stack (:class:`LiveStack`): tasks of one model and objective stacked
on dim 0 in a slab with spare capacity, joining and leaving at any time, stepped together; and
the data pool every client's samples are read from in place (:class:`DataPool`).

:class:`felix.client.cohort.CohortTrainer` owns the model, the objective and the stacked
gradient kernels; a stack asks it for a step's gradients and applies the optimiser row by row.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from felix.client.schedule import batch_rows
from felix.client.stacked_chain import Aux, Bound, StackedChain
from felix.client.trainer import ClientData, TrainConfig, one_thread, oort_utility
from felix.core.types import ClientUpdate
from felix.strategies.objectives import Objective, TaskContext


class StackOwner(Protocol):
    """What a stack reads of the cohort trainer that owns it (:class:`felix.client.cohort.CohortTrainer`):
    the model and objective, the settings, the data pool and the stacked gradient kernel."""

    model: nn.Module
    objective: Objective
    cfg: TrainConfig
    num_classes: int
    device: torch.device
    pool: DataPool
    stats: Any  # felix.client.cohort.CohortStats
    chain: StackedChain | None
    grad: Callable[..., tuple[dict[str, torch.Tensor], Aux]]
    names: list[str]
    shapes: list[torch.Size]
    one_thread: bool
    has_before: bool
    has_after: bool


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


class LiveStack:
    """Tasks of one cohort trainer stacked on dim 0 and stepped together (continuous batching).

    Tasks join at any time and leave when done, so a long task does not step alone while the
    tasks that joined after it wait for a stack of their own. Before each :meth:`advance` the rows
    are ordered by remaining steps, longest first: at every step the tasks still stepping are a
    prefix of the stack (the objective hooks' ``a``), and the tasks that finish are a suffix,
    cut off at the end. Each task's arithmetic is its own: which other tasks share a step does not
    change its result (tests/test_cohort.py), except that on a CPU a convolution computed for one
    client alone takes another kernel than a stack of them (a few ulps; see
    felix.sim.ray_cohorts).

    SGD (momentum, weight decay) and Adam are ``torch.optim``'s per-element arithmetic: a momentum
    buffer starts at zero, so its first step is ``0 * m + g = g``; Adam's bias corrections use each
    task's own step count (runs of rows at the same count step together).
    """

    def __init__(self, trainer: StackOwner) -> None:
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
    def remaining(self, key: int) -> int:
        """Steps ``key``'s task has left."""
        target = next((r for r in self.rows if r.key == key), None)
        if target is None:
            raise KeyError(f"task {key} is not in the cohort stack")
        return target.remaining

    def work(self) -> int:
        """Steps left, summed over the tasks."""
        return sum(r.remaining for r in self.rows)

    def advance(self, key: int) -> dict[int, ClientUpdate]:
        """Step every task until ``key``'s is done; the updates of the tasks that finished."""
        return self.steps(self.remaining(key))

    def steps(self, S: int) -> dict[int, ClientUpdate]:
        """Step every task ``S`` times or until it is done; the updates of the tasks that finished.
        Each task's steps are its own, so a stack split in parts, each stepped ``S`` times, gives
        every task the update this stack gives it (:class:`felix.client.cohort_split.SplitCohort`)."""
        tr, cfg, dev = self.tr, self.tr.cfg, self.tr.device
        if not self.rows:
            return {}
        S = min(S, max(r.remaining for r in self.rows))  # a share's tasks may all end sooner
        order = self._lockstep_order(S)
        if order != list(range(len(self.rows))):
            self._take(order)
        rows, bs = self.rows, cfg.batch_size
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
