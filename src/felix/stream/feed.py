"""A client's stream as the trainer's data: the ``feed`` of a device runner
(:class:`felix.engine.device.DeviceRunner`), in either shell."""

from __future__ import annotations

import numpy as np
import torch

from felix.client.trainer import ClientData
from felix.stream.model import ClientStream
from felix.stream.store import Snapshot


class StreamFeed:
    """Turns the samples a task may train on at its start (:meth:`ClientStream.snapshot`) into
    ``ClientData``: rows of the training pool ``pool_x`` with the labels the client knows then."""

    def __init__(self, stream: ClientStream, pool_x: torch.Tensor) -> None:
        self.stream = stream
        self.pool_x = pool_x
        self.last: Snapshot | None = None

    def data_at(self, now: float) -> tuple[ClientData, tuple[float, float] | None]:
        snap = self.last = self.stream.snapshot(now)
        x = self.pool_x.index_select(0, torch.from_numpy(np.ascontiguousarray(snap.index)))
        return ClientData(x, torch.from_numpy(np.ascontiguousarray(snap.label))), snap.span
