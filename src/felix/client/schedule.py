"""A client's batch schedule: how many local steps a task of ``n`` samples takes, epoch by
epoch, and which samples each batch reads. The sequential trainer (:mod:`felix.client.trainer`)
walks it one batch at a time and the cohort trainer (:mod:`felix.client.cohort`) lays it out as
rows for a stack of clients: one schedule, so the two paths take the same steps on the same
samples in the same order (each epoch's order is one ``randperm`` from the task's generator)."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch


class BatchSettings(Protocol):
    """The settings a schedule follows (:class:`felix.client.trainer.TrainConfig` has them)."""

    @property
    def batch_size(self) -> int: ...
    @property
    def epochs(self) -> int: ...
    @property
    def max_steps(self) -> int | None: ...
    @property
    def drop_last(self) -> bool: ...


def epoch_batches(n: int, cfg: BatchSettings) -> list[tuple[int, int]]:
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


def task_steps(n: int, cfg: BatchSettings) -> int:
    """The local steps of a client of ``n`` samples (no random draws)."""
    return sum(nb for _, nb in epoch_batches(n, cfg))


def batch_rows(n: int, cfg: BatchSettings, generator: torch.Generator) -> tuple[np.ndarray, int, int]:
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
