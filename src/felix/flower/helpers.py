"""felix-fl's client-side methods inside a user's Flower ``@app.train()`` handler.

- :func:`objective`: a felix client objective (FedeRage's mean-CVaR, FedProx, focal, weighted CE,
  ...) applied to the handler's own loop: its loss, its gradient hooks around the optimiser step,
  its per-client state kept in ``context.state`` between rounds, and its aux state (FedeRage's
  beta) sent back as ``felix.aux`` for the server to average (:class:`~felix.flower.strategy.FelixStrategy`
  and felix's own runs both do). Under ``felix run --flower-app`` the objective and its
  parameters come from felix's config (``client.objective``) in the message.
- :func:`local_train`: the whole task, felix's way: the message's model copied into the handler's
  network (:func:`load_arrays`), felix's own local loop (the one
  :class:`~felix.client.trainer.LocalTrainer` runs) on it with the message's config and
  objective, and the reply's content: under felix the update felix's trainer computes, bit for
  bit, at close to its cost when the handler keeps its network between messages.
- :func:`load_arrays`: the message's model copied into a network the handler keeps, in place
  (``load_state_dict(to_torch_state_dict())`` without its intermediate tensors), for a handler
  that runs its own loop.
- :func:`state_dict_record`: Flower's ``ArrayRecord(model.state_dict())`` (the reply's model),
  the same arrays without ``np.save`` per tensor: on a small model, a large part of a handler's
  fixed cost per message.
- DAFL's server-planned augmentation: :func:`class_counts_reply` answers the strategy's count query
  (``FelixStrategy(data_plan="dafl")``), the strategy plans with felix's DAFL planner, and
  :func:`apply_plan` creates the client's planned samples from its data (felix's augmenters).
  Under ``felix run --flower-app`` felix applies ``data_plan: dafl`` itself:
  :func:`felix.flower.client_data` already returns the augmented data.

The cheapest handler (felix's loop on a network kept between messages)::

    NET = Net()

    @app.train()
    def train(msg, context):
        return Message(local_train(msg, context, NET), reply_to=msg)

A handler with its own loop (docs/flower.md has the whole app)::

    obj = objective(msg, context, model)              # felix.objective from the config
    for xb, yb in loader:
        loss = obj.loss(model(xb), yb)
        opt.zero_grad(); loss.backward(); obj.before_step(); opt.step(); obj.after_step()
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    obj.finish(content)                                # felix.aux, and the state for next time
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from felix.client.trainer import TrainConfig, local_loop
from felix.flower import client_data, import_flwr
from felix.flower.trainer import (
    ARRAYS,
    AUX,
    CONFIG,
    METRICS,
    PRECISIONS_BY_DTYPE,
    ModelMismatch,
    _one,
    filled,
    flower_codec,
)
from felix.strategies.dataplans.augment import augment_client, get_augmenter
from felix.strategies.objectives import Objective, OneClient, TaskContext, make_objective

flwr = import_flwr()
#: The ``.npy`` headers of :func:`state_dict_record`, made once per dtype and shape; the arrays
#: felix sends, read without parsing their bytes (:func:`load_arrays`).
_CODEC = flower_codec()

#: Where a node's objective state lives in ``context.state`` between its rounds.
STATE_SCALARS, STATE_ARRAYS = "felix.objective-state", "felix.objective-arrays"
#: The train config entry that carries a node's DAFL row, and the query that asks for its counts.
PLAN_ROW, COUNTS_QUERY, COUNTS = "felix.plan-row", "query.felix_counts", "felix.class-counts"


class LocalObjective:
    """One task's felix objective in a user's loop (:func:`objective` builds it)."""

    def __init__(self, obj: Any, ctx: TaskContext, context: Any, params: Sequence[torch.Tensor]) -> None:
        self.obj = obj
        self.ctx = ctx
        self.context = context
        self.hooks = OneClient(obj, ctx, params)  # the objective's stacked hooks, for a stack of one

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
        if scalars or STATE_SCALARS in self.context.state:  # an objective without state keeps none
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
    model_params = list(model.parameters())
    with torch.no_grad():  # parameters_to_vector's values, without its per-tensor device checks
        global_params = torch.cat([p.detach().reshape(-1) for p in model_params])
    return _objective(
        msg, context, model, model_params, global_params, name, num_classes, class_counts, params
    )


def _objective(
    msg: Any,
    context: Any,
    model: nn.Module,
    model_params: Sequence[torch.Tensor],
    global_params: torch.Tensor,
    name: str | None,
    num_classes: int | None,
    class_counts: torch.Tensor | None,
    params: dict[str, Any],
) -> LocalObjective:
    """:func:`objective`, given ``list(model.parameters())`` and their values as one vector
    (:func:`local_train` has them)."""
    config = _record(msg.content, CONFIG, flwr.app.ConfigRecord) or {}
    if name is None and not params:  # felix's objective as the config names it (felix's usual case)
        obj = _config_objective(
            str(config.get("felix.objective", "ce")), str(config.get("felix.objective-params", "{}"))
        )
    else:
        if name is None:
            name = str(config.get("felix.objective", "ce"))
            params = {**json.loads(str(config.get("felix.objective-params", "{}"))), **params}
        obj = make_objective(name, **params)
    classes = int(num_classes if num_classes is not None else config.get("num-classes", 0))
    state: dict[str, Any] = dict(_record(context.state, STATE_SCALARS, flwr.app.ConfigRecord) or {})
    saved = _record(context.state, STATE_ARRAYS, flwr.app.ArrayRecord)
    if saved is not None:
        state.update({k: v.numpy() for k, v in saved.items()})
    aux = _record(msg.content, AUX, flwr.app.ArrayRecord)
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
    return LocalObjective(obj, ctx, context, model_params)


@functools.lru_cache(maxsize=64)
def _config_objective(name: str, params_json: str) -> Objective:
    """The objective a config names, made once per name and parameters: an objective keeps no
    task's state (felix's trainer runs one for all its tasks), and building one validates its
    parameters (microseconds a task)."""
    return make_objective(name, **json.loads(params_json))


def _record(records: Any, key: str, kind: type) -> Any:
    """``records[key]`` when it is a ``kind`` record, else None (one lookup: ``config_records``
    and its kin build a filtered copy of the whole ``RecordDict``)."""
    rec = records.get(key)
    return rec if isinstance(rec, kind) else None


def state_dict_record(state_dict: Mapping[str, torch.Tensor]) -> Any:
    """``ArrayRecord(state_dict)``, for a reply: plain Flower ``Array`` objects with the bytes
    Flower's ``Array(tensor)`` holds (``np.save``'s, byte for byte for contiguous tensors; a
    non-contiguous one is written in C order, the same values), so it serves under Flower's own
    runtime as under felix. Flower writes every tensor through ``np.save``, which formats and
    checks the ``.npy`` header anew each time; here the header is made once per dtype and shape.
    On the quickstart's CNN (8 tensors) that is about half the cost (the rest: Flower's ``Array``
    and record classes)."""
    return _record_of({key: tensor.detach().cpu().numpy() for key, tensor in state_dict.items()})


def _record_of(arrays: dict[str, np.ndarray]) -> Any:
    """:func:`state_dict_record` of the tensors' numpy values."""
    return filled(
        flwr.app.ArrayRecord,
        {k: _CODEC.plain(np.ascontiguousarray(a) if a.ndim else np.array(a)) for k, a in arrays.items()},
    )


def load_arrays(msg: Any, model: nn.Module) -> None:
    """The message's model (its ``ArrayRecord``: ``content["arrays"]``, or its only one) copied
    into ``model``'s own parameters and buffers, in place: what
    ``model.load_state_dict(record.to_torch_state_dict())`` does for a model the handler keeps
    between messages, without the intermediate tensors and ``load_state_dict``'s walk over the
    modules (the arrays felix sends are copied from the values they were made from, not parsed).
    The arrays must be the model's ``state_dict``: the same names in the same order, the same
    shapes (a one-line ``ModelMismatch``, a ``ValueError``, saying which does not fit; under
    felix it names felix's ``model`` option)."""
    _load(msg, model, "felix.flower.helpers.load_arrays")


def _load(
    msg: Any, model: nn.Module, where: str
) -> list[tuple[str, torch.Tensor, np.ndarray, np.ndarray | None]]:
    """:func:`load_arrays`; returns the model's ``state_dict(keep_vars=True)`` entries it loaded
    into (the model's own tensors), each with the received values and the numpy view of its
    storage it copied them into (None where it copied through torch): :func:`local_train`
    replies from them without a second walk over the modules."""
    arrays = _record(msg.content, ARRAYS, flwr.app.ArrayRecord)
    if arrays is None:
        records = {k: v for k, v in msg.content.items() if isinstance(v, flwr.app.ArrayRecord)}
        arrays = _one(records, ARRAYS, exclude=AUX)
    if arrays is None:
        raise ValueError(f"{where}: the message has no ArrayRecord of the model")
    targets = model.state_dict(keep_vars=True)
    if list(arrays.keys()) != list(targets.keys()):
        raise ModelMismatch(
            f"{where}: the message's arrays {list(arrays.keys())[:4]}... are not the model's "
            f"state_dict {list(targets.keys())[:4]}..."
        )
    loaded: list[tuple[str, torch.Tensor, np.ndarray, np.ndarray | None]] = []
    for key, tensor in targets.items():
        try:
            value = _CODEC.read(arrays[key], tuple(tensor.shape))
        except (TypeError, ValueError) as exc:
            raise ModelMismatch(f"{where}: {key}: {exc}") from None
        try:  # into the tensor's storage through numpy's copy: a fraction of torch's cost
            view = tensor.detach().numpy() if tensor.device.type == "cpu" else None
        except TypeError:  # a dtype numpy lacks (bfloat16)
            view = None
        if view is not None:
            np.copyto(view, value, casting="unsafe")
        else:
            with torch.no_grad():
                tensor.copy_(torch.from_numpy(np.array(value)))
        loaded.append((key, tensor, value, view))
    return loaded


#: The config entries :func:`local_train` needs (the others default as felix's ``TrainConfig``'s do).
REQUIRED = ("lr", "batch-size", "local-epochs", "seed")
#: The config's ``precision`` entry as the forward passes' autocast dtype (absent or fp32: none).
AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None} | {
    name: dtype for dtype, name in PRECISIONS_BY_DTYPE.items()
}


def local_train(
    msg: Any,
    context: Any,
    model: nn.Module,
    x: torch.Tensor | None = None,
    y: torch.Tensor | None = None,
) -> Any:
    """felix's local training of this task on ``model`` (best kept by the handler between
    messages: building a network costs more than a step of training it): the message's model
    loaded into it (:func:`load_arrays`), then the loop felix's own trainer runs
    (:func:`felix.client.trainer.local_loop`: its optimiser, batch order from the config's
    ``seed``, per-sample losses for Oort's utility) with the message's config (``lr``,
    ``batch-size``, ``local-epochs``, ``seed``; ``momentum``, ``weight-decay``, ``optimizer``,
    ``drop-last``, ``max-steps``, ``precision`` when given) and felix objective
    (:func:`objective`). Returns the reply's content, a ``RecordDict``: the trained
    ``state_dict`` (``"arrays"``, :func:`state_dict_record`), ``"metrics"`` (``num-examples``,
    ``train_loss``, ``stat-utility``) and the objective's ``felix.aux`` when it has one. Under
    felix the update is the one felix's trainer computes, bit for bit.

    ``x, y`` default to :func:`felix.flower.client_data` (the task's data under felix); give
    them under Flower's runtime. A config without the entries this needs is a one-line
    ``ValueError`` naming them."""
    where = "felix.flower.helpers.local_train"
    config = _record(msg.content, CONFIG, flwr.app.ConfigRecord)
    if config is None:
        raise ValueError(f"{where}: the message has no ConfigRecord {CONFIG!r}")
    missing = [k for k in REQUIRED if k not in config]
    if missing:
        raise ValueError(
            f"{where}: the message's config has no {', '.join(map(repr, missing))} "
            "(felix sends them; under Flower's runtime, put them in the strategy's train config)"
        )
    if x is None or y is None:
        data = client_data(context)
        if data is None:
            raise ValueError(f"{where}: give x and y (felix's client data exists only under felix)")
        x, y = data
    precision = str(config.get("precision", "fp32"))
    if precision not in AUTOCAST_DTYPES:
        raise ValueError(
            f"{where}: the config's precision {precision!r} is none of {sorted(AUTOCAST_DTYPES)}"
        )
    tensors = _load(msg, model, where)
    cfg = TrainConfig(
        lr=float(config["lr"]),
        batch_size=int(config["batch-size"]),
        epochs=int(config["local-epochs"]),
        max_steps=int(config["max-steps"]) if "max-steps" in config else None,
        momentum=float(config.get("momentum", 0.0)),
        weight_decay=float(config.get("weight-decay", 0.0)),
        drop_last=bool(config.get("drop-last", False)),
        optimizer=str(config.get("optimizer", "sgd")),
    )
    # Samples per class, for the objectives that weight classes (as felix's trainer counts them;
    # numpy's count costs a tenth of torch's).
    counts = np.bincount(y.cpu().numpy(), minlength=int(config.get("num-classes", 0)))
    # The parameters in ``model.parameters()``'s order (the state_dict lists them module by module
    # as that does, each module's before its buffers; a tied one under each of its names).
    received = {id(t): (t, v) for _, t, v, _ in tensors if isinstance(t, nn.Parameter)}
    params: list[torch.Tensor] = [t for t, _ in received.values()]
    device = params[0].device
    # The received parameters as one vector (the objective's anchor): numpy's concatenation of
    # the received values costs a fraction of torch's of the loaded tensors.
    global_params = torch.from_numpy(np.concatenate([v.reshape(-1) for _, v in received.values()]))
    global_params = global_params.to(device=device, dtype=params[0].dtype)
    obj = _objective(msg, context, model, params, global_params, None, None, torch.from_numpy(counts), {})
    x, y = x.to(device), y.to(device)
    generator = torch.Generator().manual_seed(int(config["seed"]))
    utility, loss = local_loop(
        model, obj.hooks.params, x, y, cfg, obj.hooks, generator, AUTOCAST_DTYPES[precision]
    )
    metrics = filled(
        flwr.app.MetricRecord, {"num-examples": len(y), "train_loss": loss, "stat-utility": utility}
    )
    # The trained values, through the views the weights were copied into (training steps in place).
    trained = {k: v if v is not None else t.detach().cpu().numpy() for k, t, _, v in tensors}
    content = filled(flwr.app.RecordDict, {ARRAYS: _record_of(trained), METRICS: metrics})
    obj.finish(content)
    return content


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


__all__ = [
    "LocalObjective",
    "apply_plan",
    "class_counts_reply",
    "load_arrays",
    "local_train",
    "objective",
    "state_dict_record",
]
