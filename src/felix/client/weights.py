"""Which of a model's tensors travel as the flat float32 weight vector, and which stay put.

Parameters always travel. Buffers (BatchNorm's running mean and variance, and its integer
``num_batches_tracked`` counter) follow ``client.buffers``:

- ``aggregate``: floating-point buffers travel after the parameters, in ``model.buffers()``
  order, so the server averages them like parameters (their deltas go through the aggregator and
  the update validator with the parameters' deltas) and every task starts from the global
  model's statistics. Integer buffers are counters, not statistics: they do not travel, and every
  task starts them from the model factory's value (BatchNorm: 0; they only matter for
  ``momentum=None``, where the running statistics then average this task's batches).
- ``local``: only parameters travel. Each client's buffers, all of them, are kept in its own
  state between its tasks (a client's first task starts from the factory's values), so no
  statistics leak from one client to the next through the shared training workspace. The global
  model, which has no buffers of its own, is evaluated with the factory's buffers.

A model without buffers travels as its parameters in both modes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

BUFFER_MODES = ("aggregate", "local")
#: Where ``local`` mode keeps a client's buffers in its per-client state (next to the objective's).
BUFFERS_KEY = "model_buffers"


class ModelWeights:
    """A model's travelling tensors (parameters, then float buffers under ``aggregate``) and the
    ones kept out of the vector, with the factory's values of the latter for resets."""

    def __init__(self, model: nn.Module, buffers: str = "aggregate") -> None:
        if buffers not in BUFFER_MODES:
            raise ValueError(f"buffers must be one of {BUFFER_MODES}, not {buffers!r}")
        self.mode = buffers
        self.params = list(model.parameters())
        all_buffers = list(model.buffers())
        self.shipped_buffers = (
            [b for b in all_buffers if b.is_floating_point()] if buffers == "aggregate" else []
        )
        shipped = {id(b) for b in self.shipped_buffers}
        self.kept = [b for b in all_buffers if id(b) not in shipped]
        self.initial_kept = [b.detach().clone() for b in self.kept]
        self.num_params = sum(p.numel() for p in self.params)
        self.size = self.num_params + sum(b.numel() for b in self.shipped_buffers)

    def vector(self) -> torch.Tensor:
        """The travelling tensors as one flat vector (on the model's device)."""
        with torch.no_grad():
            return parameters_to_vector(self.params + self.shipped_buffers)

    def numpy(self) -> np.ndarray:
        return self.vector().detach().cpu().numpy().astype(np.float32, copy=True)

    @torch.no_grad()
    def load(self, flat: torch.Tensor) -> None:
        """Load a vector of ``size`` values; the parameters become views of ``flat`` (give this its
        own copy), the buffers are copied into."""
        if flat.numel() != self.size:
            raise ValueError(
                f"weight vector of {flat.numel()} values for a model of {self.size} "
                f"({self.num_params} parameters + {self.size - self.num_params} buffer values)"
            )
        vector_to_parameters(flat[: self.num_params], self.params)
        at = self.num_params
        for b in self.shipped_buffers:
            n = b.numel()
            b.copy_(flat[at : at + n].view_as(b))
            at += n

    @torch.no_grad()
    def set_kept(self, values: list[np.ndarray] | None) -> None:
        """The kept buffers from a client's saved ``values``, or the factory's values for None."""
        if values is None:
            for b, init in zip(self.kept, self.initial_kept):
                b.copy_(init)
            return
        if len(values) != len(self.kept):
            raise ValueError(f"{len(values)} saved buffers for a model with {len(self.kept)}")
        for b, v in zip(self.kept, values):
            b.copy_(torch.as_tensor(v).view_as(b))

    def get_kept(self) -> list[np.ndarray]:
        return [b.detach().cpu().numpy().copy() for b in self.kept]

    def begin_task(self, state: dict[str, Any]) -> None:
        """Kept buffers for a client's task: its own (``local``) or the factory's."""
        if self.kept:
            self.set_kept(state.get(BUFFERS_KEY) if self.mode == "local" else None)

    def end_task(self, state: dict[str, Any]) -> None:
        """``local``: save the client's buffers in its state for its next task."""
        if self.kept and self.mode == "local":
            state[BUFFERS_KEY] = self.get_kept()


def model_vector(model: nn.Module, buffers: str = "aggregate") -> np.ndarray:
    """The model's weight vector as it travels (its initial weights, for a freshly built model)."""
    return ModelWeights(model, buffers).numpy()


def weights_for(model: nn.Module, size: int) -> ModelWeights:
    """The layout a vector of ``size`` values has for ``model``: parameters only, or parameters and
    float buffers (``aggregate``). For a reader of vectors that may come from either mode (the
    global model's evaluator); ``ValueError`` when neither fits."""
    for mode in BUFFER_MODES:
        w = ModelWeights(model, mode)
        if w.size == size:
            return w
    raise ValueError(
        f"a weight vector of {size} values fits this model in no buffer mode "
        f"({ModelWeights(model, 'local').size} or {ModelWeights(model, 'aggregate').size} expected)"
    )
