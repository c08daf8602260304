"""felix-fl's client-side methods inside a user's Flower ``@app.train()`` handler.

- :func:`objective`: a felix client objective (FedeRage's mean-CVaR, FedProx, focal, weighted CE,
  ...) applied to the handler's own loop: its loss, its gradient hooks around the optimiser step,
  its per-client state kept in ``context.state`` between rounds, and its aux state (FedeRage's
  beta) sent back as ``felix.aux`` for the server to average (:class:`~felix.flower.strategy.FelixStrategy`
  and felix's own runs both do). Under ``felix run --flower-app`` the objective and its
  parameters come from felix's config (``client.objective``) in the message.
- :func:`state_dict_record`: Flower's ``ArrayRecord(model.state_dict())`` (the reply's model),
  the same arrays without ``np.save`` per tensor: on a small model, a large part of a handler's
  fixed cost per message.
- DAFL's server-planned augmentation: :func:`class_counts_reply` answers the strategy's count query
  (``FelixStrategy(data_plan="dafl")``), the strategy plans with felix's DAFL planner, and
  :func:`apply_plan` creates the client's planned samples from its data (felix's augmenters).
  Under ``felix run --flower-app`` felix applies ``data_plan: dafl`` itself:
  :func:`felix.flower.client_data` already returns the augmented data.

A sketch (docs/flower.md has the whole app)::

    obj = objective(msg, context, model)              # felix.objective from the config
    for xb, yb in loader:
        loss = obj.loss(model(xb), yb)
        opt.zero_grad(); loss.backward(); obj.before_step(); opt.step(); obj.after_step()
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    obj.finish(content)                                # felix.aux, and the state for next time
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector

from felix.flower import import_flwr
from felix.flower.trainer import AUX, CONFIG, NpyCodec
from felix.strategies.dataplans.augment import augment_client, get_augmenter
from felix.strategies.objectives import OneClient, TaskContext, make_objective

flwr = import_flwr()
#: The ``.npy`` headers of :func:`state_dict_record`, made once per dtype and shape.
_CODEC = NpyCodec(flwr.app.Array)

#: Where a node's objective state lives in ``context.state`` between its rounds.
STATE_SCALARS, STATE_ARRAYS = "felix.objective-state", "felix.objective-arrays"
#: The train config entry that carries a node's DAFL row, and the query that asks for its counts.
PLAN_ROW, COUNTS_QUERY, COUNTS = "felix.plan-row", "query.felix_counts", "felix.class-counts"


class LocalObjective:
    """One task's felix objective in a user's loop (:func:`objective` builds it)."""

    def __init__(self, obj: Any, ctx: TaskContext, context: Any) -> None:
        self.obj = obj
        self.ctx = ctx
        self.context = context
        self.hooks = OneClient(obj, ctx)  # the objective's stacked hooks, for a stack of one

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The batch loss of the objective (plain cross-entropy's mean for ``ce``)."""
        per = F.cross_entropy(logits, y, reduction="none")
        return self.hooks.loss(per, y)

    def before_step(self) -> None:
        """After ``backward``, before ``optimizer.step()``: the objective's gradient corrections."""
        self.hooks.before_step()

    def after_step(self) -> None:
        """After ``optimizer.step()``: the objective's state updates (and the step count)."""
        self.ctx.steps += 1
        self.hooks.after_step()

    def finish(self, content: Any) -> None:
        """End the task: keep the objective's state in ``context.state`` for the node's next
        task, and put its aux state (if any) into the reply ``content`` as ``felix.aux``."""
        self.hooks.end()
        scalars = {k: v for k, v in self.ctx.state.items() if isinstance(v, (int, float, bool, str))}
        arrays = {k: np.asarray(v) for k, v in self.ctx.state.items() if isinstance(v, np.ndarray)}
        self.context.state[STATE_SCALARS] = flwr.app.ConfigRecord(scalars)
        if arrays:
            self.context.state[STATE_ARRAYS] = flwr.app.ArrayRecord(
                {k: flwr.app.Array(np.array(v, order="C")) for k, v in arrays.items()}
            )
        if self.ctx.aux_out:
            content[AUX] = flwr.app.ArrayRecord(
                {k: flwr.app.Array(np.array(v, order="C")) for k, v in sorted(self.ctx.aux_out.items())}
            )


def objective(
    msg: Any,
    context: Any,
    model: nn.Module,
    name: str | None = None,
    num_classes: int | None = None,
    class_counts: torch.Tensor | None = None,
    **params: Any,
) -> LocalObjective:
    """The felix objective for this task, on ``model`` as just loaded with the received weights.

    ``name`` and ``params`` default to the message's ``felix.objective`` and
    ``felix.objective-params`` (what felix sends); give them under Flower's runtime.
    ``num_classes`` defaults to the message's ``num-classes``; ``class_counts`` (samples per
    class on this client) matters only to the objectives that weight classes (``wce``)."""
    config = msg.content.config_records.get(CONFIG, {})
    if name is None:
        name = str(config.get("felix.objective", "ce"))
        params = {**json.loads(str(config.get("felix.objective-params", "{}"))), **params}
    classes = int(num_classes if num_classes is not None else config.get("num-classes", 0))
    obj = make_objective(name, **params)
    state: dict[str, Any] = dict(context.state.config_records.get(STATE_SCALARS, {}))
    saved = context.state.array_records.get(STATE_ARRAYS)
    if saved is not None:
        state.update({k: v.numpy() for k, v in saved.items()})
    aux = msg.content.array_records.get(AUX)
    with torch.no_grad():
        global_params = parameters_to_vector(list(model.parameters())).detach().clone()
    counts = class_counts if class_counts is not None else torch.zeros(max(classes, 1), dtype=torch.long)
    ctx = TaskContext(
        model=model,
        global_params=global_params,
        lr=float(config.get("lr", 0.0)),
        num_classes=classes,
        class_counts=counts,
        state=state,
        aux_in={k: v.numpy() for k, v in aux.items()} if aux is not None else {},
    )
    return LocalObjective(obj, ctx, context)


def state_dict_record(state_dict: Mapping[str, torch.Tensor]) -> Any:
    """``ArrayRecord(state_dict)``, for a reply: plain Flower ``Array`` objects with the bytes
    Flower's ``Array(tensor)`` holds (``np.save``'s, byte for byte for contiguous tensors; a
    non-contiguous one is written in C order, the same values), so it serves under Flower's own
    runtime as under felix. Flower writes every tensor through ``np.save``, which formats and
    checks the ``.npy`` header anew each time; here the header is made once per dtype and shape.
    On the quickstart's CNN (8 tensors) that is about half the cost (the rest: Flower's ``Array``
    and record classes)."""
    record = flwr.app.ArrayRecord()
    for key, tensor in state_dict.items():
        a = tensor.detach().cpu().numpy()
        a = np.ascontiguousarray(a) if a.ndim else np.array(a)
        record[key] = flwr.app.Array(
            dtype=str(a.dtype),
            shape=tuple(a.shape),
            stype="numpy.ndarray",
            data=_CODEC.header(a.dtype, a.shape) + a.tobytes(),
        )
    return record


def class_counts_reply(msg: Any, y: torch.Tensor | np.ndarray, num_classes: int) -> Any:
    """The reply to :class:`~felix.flower.strategy.FelixStrategy`'s DAFL count query (a
    ``query`` message): the node's samples per class, for the server's planner."""
    counts = np.bincount(np.asarray(y, dtype=np.int64), minlength=num_classes)
    content = flwr.app.RecordDict({COUNTS: flwr.app.ArrayRecord({"counts": flwr.app.Array(counts)})})
    return flwr.app.Message(content, reply_to=msg)


def apply_plan(
    msg: Any,
    context: Any,
    x: torch.Tensor,
    y: torch.Tensor,
    augmenter: str = "rotate_flip",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The node's data with its DAFL row applied: the planned new samples of each class (felix's
    ``augmenter``, seeded by the node, so every round makes the same ones) after the originals;
    the data as given when the message carries no row."""
    row: Sequence[int] | None = msg.content.config_records.get(CONFIG, {}).get(PLAN_ROW)
    if not row or not any(int(v) for v in row):
        return x, y
    x_new, y_new, _ = augment_client(
        x, y, [int(v) for v in row], get_augmenter(augmenter), int(context.node_id)
    )
    return torch.cat([x, x_new]), torch.cat([y, y_new])


__all__ = ["LocalObjective", "apply_plan", "class_counts_reply", "objective", "state_dict_record"]
