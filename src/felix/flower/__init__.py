"""Flower interop (the ``felix-fl[flower]`` extra): both directions between felix-fl and Flower.

- :mod:`felix.flower.trainer`: a user's Flower ``ClientApp`` trains felix's tasks
  (``client.flower_app``), driven by felix's simulator under any trace, strategy and runtime
  profile, with the same outputs as felix's own trainer.
- :mod:`felix.flower.strategy`: felix-fl's Oort/TierSelect selection and TierFuse aggregation as a
  Flower message-API ``Strategy`` for synchronous rounds, and :func:`run_simulation`, Flower's
  simulation on a loopback-only Ray instance.
- :mod:`felix.flower.helpers`: felix's local loop, its client objectives (FedeRage, ...) and its
  data plans (DAFL) for use inside a Flower ``@app.train()`` handler.

Flower's telemetry is switched off here, in code, before ``flwr`` is first imported: Flower reads
``FLWR_TELEMETRY_ENABLED`` when its telemetry module loads and would otherwise post usage events to
Flower's servers (tests/test_flower.py watches the sockets). Importing this package does not import
``flwr``; :func:`import_flwr` does, with a clear error when the extra is missing.
"""

from __future__ import annotations

import os
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Self

from felix.config import ConfigError

if TYPE_CHECKING:
    import torch

    from felix.client.trainer import ClientData

#: Set before any ``flwr`` import (an explicit user value is overridden too: felix never reports).
SAFE_ENV = {"FLWR_TELEMETRY_ENABLED": "0"}
os.environ.update(SAFE_ENV)


def import_flwr() -> ModuleType:
    """``flwr``, with telemetry off, or a one-line error naming the extra that installs it."""
    os.environ.update(SAFE_ENV)
    try:
        import flwr
        import flwr.app
        import flwr.clientapp
    except ImportError:
        raise ConfigError('Flower interop needs Flower: pip install "felix-fl[flower]"') from None
    return flwr


@dataclass
class Serving:
    """The task's data a handler may read, and whether it did (:func:`client_data` sets
    ``read``): the Flower trainer tells an app that trains on its own partition from one that
    trains on felix's data by it. Inside (``with``) :func:`client_data` returns ``data``; a
    class rather than a generator: it is entered once per task."""

    data: ClientData
    read: bool = False
    _token: Token[Serving | None] | None = field(default=None, repr=False)

    def __enter__(self) -> Self:
        self._token = _serving.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _serving.reset(self._token)
            self._token = None


_serving: ContextVar[Serving | None] = ContextVar("felix_flower_task_data", default=None)


def client_data(context: Any = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The running task's client data ``(x, y)`` (x of shape N x sample shape, y the labels, on
    the CPU) when a handler runs under felix (``client.flower_app``), after any DAFL augmentation;
    None under Flower's own runtime, where the app loads its partition itself
    (``context.node_config["partition-id"]``). Under felix a handler must train on this data:
    felix's clock, selection and server count the client's samples from it."""
    cell = _serving.get()
    if cell is None:
        return None
    cell.read = True
    return cell.data.x, cell.data.y


def serving(data: ClientData) -> Serving:
    """:func:`client_data` returns ``data`` inside (the Flower trainer, around each handler
    call); the cell says whether the handler read it."""
    return Serving(data)


__all__ = ["SAFE_ENV", "Serving", "client_data", "import_flwr", "serving"]
