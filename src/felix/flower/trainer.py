"""A user's Flower ``ClientApp`` as felix's trainer (``client.flower_app: mypkg.client_app:app``).

The simulator hands a training task to :class:`FlowerTrainer.train` as it would to felix's own
:class:`~felix.client.trainer.LocalTrainer`; the task becomes a Flower ``Message`` for the app's
``@app.train()`` handler and its reply becomes the :class:`~felix.core.types.ClientUpdate` the
orchestrator aggregates. Everything around it (the trace, the strategy, the runtime profile, the
virtual clock, ``summary.json``, the plots, ``felix compare``) is unchanged, because only the local
computation is the app's.

What the handler receives (``message_type`` ``"train"``):

- ``content["arrays"]``: the global model as the workspace model's ``state_dict`` (an
  ``ArrayRecord``: ``to_torch_state_dict()`` loads it into the app's own model of the same
  architecture as felix's ``model``);
- ``content["config"]``: a ``ConfigRecord`` with ``lr``, ``batch-size``, ``local-epochs``,
  ``momentum``, ``weight-decay``, ``optimizer``, ``drop-last``, ``max-steps`` (when set), ``seed`` (the task's
  seed: felix's own trainer draws its batch order from it), ``server-round`` (the number of
  training tasks this client received so far) and ``num-classes``, plus ``felix.objective`` and
  ``felix.objective-params`` (JSON) for :func:`felix.flower.helpers.objective`;
- ``content["felix.aux"]`` when the server sends aux state (FedeRage's averaged beta, ...);
- a ``Context`` per client, kept between its tasks (``context.state`` persists, as in Flower), with
  ``node_config`` ``{"partition-id": client id, "num-partitions": N}`` and ``run_config``
  ``{"lr", "local-epochs", "batch-size"}``. :func:`client_data` gives the client's own felix data
  (after any DAFL augmentation) to a handler that wants it rather than loading its own partition
(:func:`felix.flower.client_data`).

What it must return: a reply (``Message(content, reply_to=msg)``) with an ``ArrayRecord`` (key
``"arrays"``, or its only one) holding the trained ``state_dict`` and a ``MetricRecord`` (key
``"metrics"``, or its only one) with ``num-examples`` and ``train_loss`` (or ``loss``); optionally
``stat-utility`` (Oort's |D| x sqrt(mean squared per-sample loss); without it felix uses
|D| x ``train_loss``, the same with the mean loss in place of the root mean square) and a
``felix.aux`` ``ArrayRecord``. TierSelect's probes (forward passes on the received model) stay felix's own.
"""

from __future__ import annotations

import io
import json
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from felix.client.trainer import ClientData, LocalTrainer, TrainConfig, _single_client
from felix.config import Config, ConfigError
from felix.core.registry import RegistryError, import_object
from felix.core.types import ClientUpdate
from felix.flower import import_flwr, serving
from felix.strategies.objectives import Objective

#: Where a device's state keeps its client id (the trainer's ``train`` is not told it otherwise).
CLIENT_KEY = "flower_client_id"
#: The reply record keys felix reads (Flower's own conventions, as in its quickstart apps).
ARRAYS, CONFIG, METRICS, AUX = "arrays", "config", "metrics", "felix.aux"


def load_client_app(ref: str) -> Any:
    """The ``ClientApp`` an import path names, or a one-line ``ConfigError``."""
    flwr = import_flwr()
    try:
        app = import_object(ref)
    except RegistryError as exc:
        raise ConfigError(f"client.flower_app: {exc}") from None
    if not isinstance(app, flwr.clientapp.ClientApp):
        raise ConfigError(f"client.flower_app: {ref!r} is a {type(app).__name__}, not a flwr ClientApp")
    return app


class FlowerTrainer(LocalTrainer):
    """Felix's trainer interface over a Flower ``ClientApp``: ``train`` runs the app's train
    handler; the workspace model (felix's ``model``) only lays the weight vector out as a
    ``state_dict`` and back, and runs TierSelect's forward-pass probes."""

    def __init__(
        self,
        app: Any,
        ref: str,
        model: nn.Module,
        objective: Objective,
        cfg: TrainConfig,
        num_classes: int,
        num_clients: int,
        objective_params: dict[str, Any],
        device: str = "cpu",
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(model, objective, cfg, num_classes, device, autocast_dtype)
        flwr = import_flwr()
        self._flwr = flwr
        self.app = app
        self.ref = ref
        self.num_clients = num_clients
        self._contexts: dict[int, Any] = {}
        self._rounds: dict[int, int] = {}
        self._config: dict[str, Any] = {
            "lr": float(cfg.lr),
            "batch-size": int(cfg.batch_size),
            "local-epochs": int(cfg.epochs),
            "momentum": float(cfg.momentum),
            "weight-decay": float(cfg.weight_decay),
            "optimizer": cfg.optimizer,
            "drop-last": bool(cfg.drop_last),
            "num-classes": int(num_classes),
            "felix.objective": objective.name,
            "felix.objective-params": json.dumps(objective_params, sort_keys=True),
        }
        if cfg.max_steps is not None:
            self._config["max-steps"] = int(cfg.max_steps)
        self._run_config = {k: self._config[k] for k in ("lr", "local-epochs", "batch-size")}
        self._codec = NpyCodec(flwr.app.Array)

    def _tensors(self) -> dict[str, torch.Tensor]:
        """The workspace's tensors by ``state_dict`` key, as loaded now (``load`` rebinds the
        parameters to each task's vector): views, so copying into them loads the model."""
        return dict(self.model.state_dict())

    def _encode(self) -> Any:
        """The workspace model as an ``ArrayRecord`` (``np.save`` bytes, as Flower writes them),
        its arrays set one by one: ``ArrayRecord(array_dict=...)`` would copy them into plain
        ``Array`` objects, losing the fast ``numpy()``."""
        record = self._flwr.app.ArrayRecord()
        for k, v in self._tensors().items():
            record[k] = self._codec.encode(v.detach().cpu().numpy())
        return record

    def _context(self, cid: int) -> Any:
        ctx = self._contexts.get(cid)
        if ctx is None:
            app_mod = self._flwr.app
            ctx = app_mod.Context(
                run_id=1,
                node_id=cid + 1,  # Flower's node ids start at 1 (0 is the server's)
                node_config={"partition-id": cid, "num-partitions": self.num_clients},
                state=app_mod.RecordDict(),
                run_config=dict(self._run_config),
            )
            self._contexts[cid] = ctx
        return ctx

    @_single_client
    def train(
        self,
        weights: np.ndarray,
        data: ClientData,
        state: dict[str, Any],
        aux_in: dict[str, np.ndarray],
        generator: torch.Generator,
    ) -> ClientUpdate:
        """One task through the app: the received weights as a message, the reply as an update."""
        if CLIENT_KEY not in state:
            raise ConfigError("client.flower_app: a task reached the Flower trainer without its client id")
        cid = int(state[CLIENT_KEY])
        app_mod = self._flwr.app
        flat = self.load(weights)
        self.weights.begin_task(state)
        self._rounds[cid] = rnd = self._rounds.get(cid, 0) + 1
        content = app_mod.RecordDict(
            {
                ARRAYS: self._encode(),
                CONFIG: app_mod.ConfigRecord(
                    {**self._config, "seed": int(generator.initial_seed()), "server-round": rnd}
                ),
            }
        )
        if aux_in:
            content[AUX] = _array_record(app_mod, aux_in)
        meta = app_mod.Metadata(
            run_id=1,
            message_id=f"felix-{cid}-{rnd}",
            src_node_id=0,
            dst_node_id=cid + 1,
            reply_to_message_id="",
            group_id=str(rnd),
            created_at=time.time(),
            ttl=86400.0,
            message_type="train",
        )
        message = app_mod.Message(content, metadata=meta)
        with serving(data):
            try:
                reply = self.app(message, self._context(cid))
            except Exception as exc:  # noqa: BLE001 - the user's handler: one line naming it
                raise ConfigError(
                    f"client.flower_app {self.ref}: the train handler raised on client {cid}: "
                    f"{type(exc).__name__}: {exc}"
                ) from None
        return self._update(reply, cid, flat, data, state)

    def _update(
        self, reply: Any, cid: int, flat: torch.Tensor, data: ClientData, state: dict[str, Any]
    ) -> ClientUpdate:
        where = f"client.flower_app {self.ref}: the reply of client {cid}"
        if not isinstance(reply, self._flwr.app.Message):
            raise ConfigError(f"{where} is a {type(reply).__name__}, not a flwr Message")
        if reply.has_error():
            raise ConfigError(f"{where} is an error: {reply.error.reason}")
        records = reply.content
        arrays = _one(records.array_records, ARRAYS, exclude=AUX)
        if arrays is None:
            raise ConfigError(f"{where} has no ArrayRecord of the trained model")
        tensors = self._tensors()
        if list(arrays.keys()) != list(tensors):
            raise ConfigError(
                f"{where} does not fit felix's model (its arrays {list(arrays.keys())[:4]}..., "
                f"the model's {list(tensors)[:4]}...)"
            )
        with torch.no_grad():
            for key, target in tensors.items():
                value = self._codec.decode(arrays[key])
                if value.shape != tuple(target.shape):
                    raise ConfigError(
                        f"{where} does not fit felix's model ({key}: shape {value.shape}, "
                        f"the model's {tuple(target.shape)})"
                    )
                target.copy_(torch.from_numpy(value))
        self.weights.end_task(state)
        with torch.no_grad():
            delta = (self.weights.vector() - flat).cpu().numpy()
        # Non-finite values are the server's to refuse (update validation), as from felix's trainer.
        metrics = _one(records.metric_records, METRICS) or {}
        n = int(metrics.get("num-examples", len(data)))
        loss = float(metrics.get("train_loss", metrics.get("loss", 0.0)))
        utility = float(metrics.get("stat-utility", n * loss))
        aux_rec = records.array_records.get(AUX)
        aux = {k: np.asarray(v.numpy()) for k, v in aux_rec.items()} if aux_rec is not None else {}
        return ClientUpdate(
            num_samples=n, stat_utility=utility, loss=loss, duration=0.0, delta=delta, aux=aux
        )


class NpyCodec:
    """Flower's ``Array`` bytes (the ``.npy`` format ``np.save`` writes) without ``np.save`` and
    ``np.load`` per array: the header depends only on the dtype and shape, so it is made once per
    (dtype, shape) and the data follows it. Bytes that do not start with the expected header
    (another writer, Fortran order) are read by Flower's own ``Array.numpy()``. Flower's own way
    parses every header with ``ast.literal_eval``: most of the Flower path's cost on a small model.

    The arrays it makes are a subclass of Flower's ``Array`` whose ``numpy()`` (what
    ``ArrayRecord.to_torch_state_dict`` calls in the app's handler) decodes the same way: the same
    values, and the same bytes for anything else that reads them."""

    def __init__(self, array_type: Any) -> None:
        self.base = array_type
        codec = self

        class FastArray(array_type):  # type: ignore[misc, valid-type]
            def numpy(self) -> np.ndarray:
                return codec.decode(self)

        self.fast = FastArray
        self._headers: dict[tuple[str, tuple[int, ...]], bytes] = {}

    def header(self, dtype: np.dtype[Any], shape: tuple[int, ...]) -> bytes:
        key = (dtype.str, shape)
        head = self._headers.get(key)
        if head is None:
            buf = io.BytesIO()
            np.save(buf, np.zeros(shape, dtype=dtype), allow_pickle=False)
            raw = buf.getvalue()
            head = raw[: len(raw) - dtype.itemsize * int(np.prod(shape))]
            self._headers[key] = head
        return head

    def encode(self, a: np.ndarray) -> Any:
        """``a`` as a Flower ``Array``, byte for byte what ``Array(a)`` holds."""
        a = np.ascontiguousarray(a) if a.ndim else np.array(a)
        data = self.header(a.dtype, a.shape) + a.tobytes()
        return self.fast(dtype=str(a.dtype), shape=tuple(a.shape), stype="numpy.ndarray", data=data)

    def decode(self, arr: Any) -> np.ndarray:
        """An ``Array``'s values, as a writable array."""
        if arr.stype == "numpy.ndarray":
            dtype, shape = np.dtype(arr.dtype), tuple(arr.shape)
            head = self.header(dtype, shape)
            if arr.data.startswith(head) and len(arr.data) == len(head) + dtype.itemsize * int(
                np.prod(shape)
            ):
                return np.frombuffer(arr.data, dtype=dtype, offset=len(head)).reshape(shape).copy()
        return np.asarray(self.base.numpy(arr))


def _array_record(app_mod: Any, arrays: dict[str, np.ndarray]) -> Any:
    return app_mod.ArrayRecord({k: app_mod.Array(np.array(v, order="C")) for k, v in sorted(arrays.items())})


def _one(records: Any, key: str, exclude: str | None = None) -> Any:
    """``records[key]``, or the only record there is (other than ``exclude``), or None."""
    if key in records:
        return records[key]
    rest = [k for k in records if k != exclude]
    return records[rest[0]] if len(rest) == 1 else None


def build_flower_trainer(cfg: Config, base: LocalTrainer) -> FlowerTrainer:
    """The Flower trainer ``client.flower_app`` names, on felix's trainer settings and model."""
    ref = cfg.client.flower_app
    assert ref is not None
    app = load_client_app(ref)
    return FlowerTrainer(
        app,
        ref,
        base.model,
        base.objective,
        base.cfg,
        base.num_classes,
        cfg.partition.num_clients,
        dict(cfg.client.objective_params),
        base.device,
        base.autocast_dtype,
    )


__all__ = ["CLIENT_KEY", "FlowerTrainer", "build_flower_trainer", "load_client_app"]
