"""Client-parallel workers (``run.workers``): a run's independent pieces of work (clients' training
tasks, a live cohort stack's shares, a group's eval tasks, the test batches of the global
evaluation) spread over threads that each run torch on one intra-op thread.

Why across pieces and not inside operations: a small model's operations are too short for
torch's intra-op threads to pay for their wake-ups (with passive waiting, one per parallel
region), and a convolution's threads change its bits. One thread per piece keeps every piece's
arithmetic exactly what it is on one thread, so a run on N workers gives the bits of a run at
``run.threads`` 1, whatever N and whichever worker computed what: the caller merges the results in
the pieces' order.

The calling thread is one of the workers: it takes pieces too (on one thread while it does), so a
run on N workers starts N - 1 threads, and while another process holds a core the pieces it cannot
take are taken by the others (the pieces are pulled one at a time, not dealt in advance). Given
each piece's cost, the dearest are taken first (longest processing time first): the job then
ends with small pieces, so the workers finish close together however unequal the pieces (clients
of a Dirichlet split hold from one batch to thirty).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch

from felix.client.trainer import one_thread

T = TypeVar("T")
R = TypeVar("R")


class _Job(Generic[T, R]):
    """One :meth:`Workers.map` call: its pieces, the order they are taken in, the next one to take,
    the results in the pieces' order."""

    def __init__(self, fn: Callable[[int, T], R], items: Sequence[T], order: Sequence[int]) -> None:
        self.fn, self.items, self.order = fn, items, order
        self.results: list[R | None] = [None] * len(items)
        self.lock = threading.Lock()
        self.next = 0
        self.left = len(items)
        self.error: Exception | None = None
        self.done = threading.Event()

    def work(self, worker: int) -> None:
        """Take pieces until none is left (``worker``: the taker's index, for per-worker state)."""
        while True:
            with self.lock:
                if self.next >= len(self.items):
                    return
                i = self.order[self.next]
                self.next += 1
            try:
                if self.error is None:
                    self.results[i] = self.fn(worker, self.items[i])
            except Exception as exc:  # noqa: BLE001 - re-raised in the caller of map
                self.error = self.error or exc
            with self.lock:
                self.left -= 1
                if self.left == 0:
                    self.done.set()


class Workers:
    """``n`` workers: the calling thread and ``n - 1`` daemon threads, each on one torch thread.
    :meth:`map` runs ``fn(worker, item)`` for every item and returns the results in the items'
    order; ``worker`` (0 is the caller) indexes per-worker state such as a model workspace."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"workers must be at least 1, not {n}")
        self.n = n
        self._cv = threading.Condition()
        self._job: _Job | None = None
        self._serial = 0  # jobs posted so far
        self._closed = False
        # torch.set_num_threads in a new thread also sets the count a thread takes at its first
        # parallel operation: the caller's count is set again once the workers are on one thread.
        caller = torch.get_num_threads()
        started = threading.Barrier(n)
        self._threads = [
            threading.Thread(target=self._serve, args=(w, started), name=f"felix-worker-{w}", daemon=True)
            for w in range(1, n)
        ]
        for t in self._threads:
            t.start()
        started.wait()
        torch.set_num_threads(caller)

    def map(
        self, fn: Callable[[int, T], R], items: Sequence[T], cost: Sequence[float] | None = None
    ) -> list[R]:
        """``fn(worker, item)`` for every item, the results in order. With ``cost`` (one per item)
        the dearest items are taken first, ties in order. Once closed (a run's final evaluation
        comes after its workers end), the caller takes every item."""
        if cost is not None and len(cost) != len(items):
            raise ValueError(f"{len(cost)} costs for {len(items)} items")
        order = range(len(items)) if cost is None else sorted(range(len(items)), key=lambda i: -cost[i])
        job: _Job[T, R] = _Job(fn, items, order)
        if len(items) == 0:
            return []
        if len(items) > 1 and self._threads and not self._closed:
            with self._cv:
                self._job, self._serial = job, self._serial + 1
                self._cv.notify_all()
        with one_thread():
            job.work(0)
        job.done.wait()
        with self._cv:
            self._job = None
        if job.error is not None:
            raise job.error
        # every slot is filled once the job is done
        return job.results  # type: ignore[return-value]

    def _serve(self, worker: int, started: threading.Barrier) -> None:
        torch.set_num_threads(1)
        started.wait()
        seen = 0
        while True:
            with self._cv:
                while not self._closed and (self._job is None or self._serial == seen):
                    self._cv.wait()
                if self._closed:
                    return
                job, seen = self._job, self._serial
            assert job is not None
            job.work(worker)

    def close(self) -> None:
        """End the threads (a run's workers end with the run)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=10)
