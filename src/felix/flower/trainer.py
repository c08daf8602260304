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
  training tasks this client received so far) and ``num-classes``, ``precision`` (``"bf16"``
  under ``run.precision: bf16``: the forward passes' autocast dtype), plus ``felix.objective`` and
  ``felix.objective-params`` (JSON) for :func:`felix.flower.helpers.objective`;
- ``content["felix.aux"]`` when the server sends aux state (FedeRage's averaged beta, ...);
- a ``Context`` per client, kept between its tasks (``context.state`` persists, as in Flower), with
  ``node_config`` ``{"partition-id": client id, "num-partitions": N}`` and ``run_config``
  ``{"lr", "local-epochs", "batch-size"}``. :func:`felix.flower.client_data` gives the client's
  felix data (after any DAFL augmentation), which the handler must train on: a handler that did
  not read it and reports another ``num-examples`` trained on a partition of its own, which
  felix's clock and server do not know, and ends the run at that result in one line.

What it must return: a reply (``Message(content, reply_to=msg)``) with an ``ArrayRecord`` (key
``"arrays"``, or its only one) holding the trained ``state_dict`` and a ``MetricRecord`` (key
``"metrics"``, or its only one) with ``num-examples`` and ``train_loss`` (or ``loss``); optionally
``stat-utility`` (Oort's |D| x sqrt(mean squared per-sample loss); without it felix uses
|D| x ``train_loss``, the same with the mean loss in place of the root mean square) and a
``felix.aux`` ``ArrayRecord``. TierSelect's probes and q-FFL's loss at the received model
(``client.probe_loss``), forward passes on the received model, stay felix's own.

One file of about 650 lines on purpose: the translation between felix's task and Flower's
``Message``/``RecordDict`` runs both ways (task in, reply out), and each check of one direction
names a field the other direction writes; split, the two halves would each need the other's names.
"""

from __future__ import annotations

import functools
import io
import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from felix.client.trainer import ClientData, LocalTrainer, TrainConfig, _single_client
from felix.client.weights import ModelWeights
from felix.config import Config, ConfigError
from felix.core.registry import RegistryError, import_object
from felix.core.types import ClientUpdate
from felix.flower import import_flwr, serving
from felix.strategies.objectives import Objective

#: Where a device's state keeps its client id (the trainer's ``train`` is not told it otherwise).
CLIENT_KEY = "flower_client_id"
#: The reply record keys felix reads (Flower's own conventions, as in its quickstart apps).
ARRAYS, CONFIG, METRICS, AUX = "arrays", "config", "metrics", "felix.aux"
#: ``run.precision``'s autocast dtypes as the config's ``precision`` entry names them (fp32 and
#: tf32 autocast nothing, and are not sent).
PRECISIONS_BY_DTYPE = {torch.bfloat16: "bf16"}


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
    handler; the workspace model (felix's ``model``) lays the weight vector out as a
    ``state_dict`` (:class:`StateLayout`, once) and runs TierSelect's forward-pass probes.

    The Flower path's fixed cost per task is what a task of one or two SGD steps notices, so the
    message is built from parts made once per run: the layout of the vector as ``state_dict``
    entries, the ``.npy`` headers, the config record (copied per task, two entries set), the
    contexts (one per client). The received vector is encoded straight into ``Array`` bytes
    (no load into the workspace) and the reply is decoded straight into one flat vector, whose
    difference from the received one is the update."""

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
        model_ref: str = "model",
    ) -> None:
        super().__init__(model, objective, cfg, num_classes, device, autocast_dtype)
        flwr = import_flwr()
        self._flwr = flwr
        self.app = app
        self.ref = ref
        self.model_ref = model_ref  # felix's ``model`` as the config names it (for the errors)
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
        if autocast_dtype is not None:
            self._config["precision"] = PRECISIONS_BY_DTYPE[autocast_dtype]
        self._run_config = {k: self._config[k] for k in ("lr", "local-epochs", "batch-size")}
        self._codec = flower_codec()
        self.layout = StateLayout(self.model, self.weights)

    def _encode(self, flat: np.ndarray) -> Any:
        """The received vector as the workspace model's ``state_dict`` in an ``ArrayRecord`` (the
        ``np.save`` bytes Flower's ``Array`` holds), the kept buffers (if any) as the workspace
        holds them for this task. Its arrays are set one by one: ``ArrayRecord(array_dict=...)``
        would copy them into plain ``Array`` objects, losing the fast ``numpy()``."""
        encode = self._codec.encode
        kept = self.layout.kept_tensors
        arrays = {}
        for e in self.layout.entries:
            if e.kept is None:
                value = flat[e.start : e.stop].reshape(e.shape)
                if value.dtype != e.dtype:
                    value = value.astype(e.dtype)
                arrays[e.key] = encode(value, e.dtype_name)
            else:
                arrays[e.key] = encode(kept[e.kept].detach().cpu().numpy().copy())
        return filled(self._flwr.app.ArrayRecord, arrays)

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
        # q-FFL's loss at the received model is felix's own forward pass, as TierSelect's probes
        # are (before the task's buffers are set: the probe sees the global model's).
        key = self.cfg.probe_loss_key
        received_loss = None if key is None else self.probe(weights, data).loss
        # One copy of the received vector for the task: the arrays' ``numpy()`` reads views of it
        # (so a later change of the caller's vector cannot reach a record the app kept).
        flat = np.array(weights, dtype=np.float32, copy=True)
        if flat.shape != (self.layout.size,):
            raise ValueError(
                f"weight vector of {flat.size} values for a model of {self.layout.size} "
                f"({self.weights.num_params} parameters + {self.layout.size - self.weights.num_params} "
                "buffer values)"
            )
        flat.flags.writeable = False
        self.weights.begin_task(state)  # the kept buffers (if any): the client's or the factory's
        self._rounds[cid] = rnd = self._rounds.get(cid, 0) + 1
        config = filled(
            app_mod.ConfigRecord, {**self._config, "seed": int(generator.initial_seed()), "server-round": rnd}
        )
        content = filled(app_mod.RecordDict, {ARRAYS: self._encode(flat), CONFIG: config})
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
        with serving(data) as served, self._codec.saving():
            try:
                reply = self.app(message, self._context(cid))
            except Exception as exc:  # noqa: BLE001 - the user's handler: one line naming it
                raise ConfigError(self._handler_error(exc, cid)) from None
        update = self._update(reply, cid, flat, data, state)
        if not served.read and update.num_samples != len(data):
            raise ConfigError(
                f"client.flower_app {self.ref}: client {cid} trained on {update.num_samples} examples "
                f"of the app's own, not on felix's {len(data)} (felix times, selects and weighs "
                "clients by their felix data): train on felix.flower.client_data(context) in the "
                "handler (docs/flower.md)"
            )
        if key is not None:
            update.aux[key] = np.array(received_loss, dtype=np.float64)
        return update

    def _handler_error(self, exc: Exception, cid: int) -> str:
        """One line for an exception of the app's train handler: a network that does not take
        felix's model (``load_state_dict``'s error, or :func:`felix.flower.helpers.load_arrays`')
        names the option to set; any other error gives its first line."""
        text = str(exc).strip()
        if isinstance(exc, ModelMismatch) or (
            isinstance(exc, RuntimeError) and text.startswith("Error(s) in loading state_dict")
        ):
            detail = text if isinstance(exc, ModelMismatch) else state_dict_error(text)
            return (
                f"client.flower_app {self.ref}: client {cid}: the app's network does not take felix's "
                f"model {self.model_ref!r} ({detail}); {self.model_hint()}"
            )
        lines = text.splitlines()
        first = lines[0] if lines else ""
        more = " ..." if len(lines) > 1 else ""
        return (
            f"client.flower_app {self.ref}: the train handler raised on client {cid}: "
            f"{type(exc).__name__}: {first}{more}"
        )

    def model_hint(self) -> str:
        """What to set when the app's network and felix's ``model`` differ: the app module's
        ``make_net`` when it has one (the docs' convention) and ``model`` is not it already."""
        module = self.ref.partition(":")[0]
        target = f"{module}:make_net"
        try:
            known = callable(import_object(target)) and self.model_ref != target
        except RegistryError:
            known = False
        if known:
            return f"set model to the app's network: --set model={target}"
        return (
            "set model to a factory (sample_shape, num_classes) -> the app's network: "
            f"--set model={module}:<factory>"
        )

    def _update(
        self, reply: Any, cid: int, flat: np.ndarray, data: ClientData, state: dict[str, Any]
    ) -> ClientUpdate:
        """The reply as felix's update, or a one-line ``ConfigError`` for a reply that does not fit:
        not a ``Message``, an error, no ``ArrayRecord``, other keys than the model's (or in
        another order), another shape, a non-numeric dtype, bytes that are not what its dtype and
        shape say. Non-finite values are the server's to refuse (update validation), as from
        felix's trainer."""
        where = f"client.flower_app {self.ref}: the reply of client {cid}"
        app_mod = self._flwr.app
        if not isinstance(reply, app_mod.Message):
            raise ConfigError(f"{where} is a {type(reply).__name__}, not a flwr Message")
        if reply.has_error():
            raise ConfigError(f"{where} is an error: {reply.error.reason}")
        # One pass over the reply's records (``array_records`` and ``metric_records`` would each
        # build a filtered copy).
        array_recs: dict[str, Any] = {}
        metric_recs: dict[str, Any] = {}
        for key, rec in reply.content.items():
            if isinstance(rec, app_mod.ArrayRecord):
                array_recs[key] = rec
            elif isinstance(rec, app_mod.MetricRecord):
                metric_recs[key] = rec
        arrays = _one(array_recs, ARRAYS, exclude=AUX)
        if arrays is None:
            raise ConfigError(f"{where} has no ArrayRecord of the trained model")
        layout = self.layout
        if list(arrays.keys()) != layout.keys:
            raise ConfigError(
                f"{where} does not fit felix's model (its arrays {list(arrays.keys())[:4]}..., "
                f"the model's {layout.keys[:4]}...); {self.model_hint()}"
            )
        # Entries the state_dict does not name (a non-persistent float buffer) keep the received values.
        trained = flat.copy()
        kept: dict[int, np.ndarray] = {}
        for e in layout.entries:
            try:
                value = self._codec.read(arrays[e.key], e.shape)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{where} does not fit felix's model ({e.key}: {exc})") from None
            if e.kept is None:
                trained[e.start : e.stop] = value.reshape(-1)
            else:
                kept[e.kept] = value
        if kept:
            with torch.no_grad():
                for i, value in kept.items():
                    layout.kept_tensors[i].copy_(torch.from_numpy(np.array(value)))
            self.weights.end_task(state)
        delta = np.subtract(trained, flat, out=trained)
        metrics = _one(metric_recs, METRICS) or {}
        n = int(metrics.get("num-examples", len(data)))
        loss = float(metrics.get("train_loss", metrics.get("loss", 0.0)))
        utility = float(metrics.get("stat-utility", n * loss))
        aux_rec = array_recs.get(AUX)
        aux = {k: np.asarray(v.numpy()) for k, v in aux_rec.items()} if aux_rec is not None else {}
        return ClientUpdate(
            num_samples=n, stat_utility=utility, loss=loss, duration=0.0, delta=delta, aux=aux
        )


def state_dict_error(text: str) -> str:
    """torch's ``load_state_dict`` error (a line per kind of key, each listing every key) in
    short: how many keys are missing, unexpected, of another shape."""
    missing = unexpected = shapes = 0
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("Missing key(s)"):
            missing = line.count('"') // 2
        elif line.startswith("Unexpected key(s)"):
            unexpected = line.count('"') // 2
        elif line.startswith("size mismatch"):
            shapes += 1
    return (
        f"load_state_dict: {missing} of its keys missing, {unexpected} unexpected, {shapes} of another shape"
    )


class ModelMismatch(ValueError):
    """A message's arrays that are not the handler's network's ``state_dict`` (other names or
    shapes): :func:`felix.flower.helpers.load_arrays` raises it, and under felix it becomes the
    one-line error that names felix's ``model`` option."""


@dataclass(frozen=True)
class LayoutEntry:
    """One ``state_dict`` entry: where it lies in the weight vector (``start:stop``), or which of
    the kept buffers it is (``kept``), and its shape and dtype (and the dtype's name, which numpy
    makes anew on every ``str``)."""

    key: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    dtype_name: str
    start: int = 0
    stop: int = 0
    kept: int | None = None


class StateLayout:
    """The weight vector as the workspace model's ``state_dict``, worked out once: the vector
    holds the parameters, then the shipped buffers (:class:`~felix.client.weights.ModelWeights`),
    and a ``state_dict`` names each of them (a tied tensor under each of its names) and the kept
    buffers, in the model's order. The tensors themselves are not read per task: loading would
    rebind the parameters, the layout stays."""

    def __init__(self, model: nn.Module, weights: ModelWeights) -> None:
        where: dict[int, tuple[int, int]] = {}
        at = 0
        for t in [*weights.params, *weights.shipped_buffers]:
            where[id(t)] = (at, at + t.numel())
            at += t.numel()
        kept_index = {id(t): i for i, t in enumerate(weights.kept)}
        self.size = weights.size
        self.kept_tensors = weights.kept
        self.entries: list[LayoutEntry] = []
        for key, t in model.state_dict(keep_vars=True).items():
            shape, dtype = tuple(t.shape), torch.empty(0, dtype=t.dtype).numpy().dtype
            if id(t) in where:
                start, stop = where[id(t)]
                self.entries.append(LayoutEntry(key, shape, dtype, str(dtype), start, stop))
            elif id(t) in kept_index:
                self.entries.append(LayoutEntry(key, shape, dtype, str(dtype), kept=kept_index[id(t)]))
            else:  # a state_dict entry that is neither a parameter nor a buffer of the model
                raise ConfigError(
                    f"client.flower_app: felix's model has a state_dict entry {key!r} it cannot send"
                )
        self.keys = [e.key for e in self.entries]


class NpyCodec:
    """Flower's ``Array`` bytes (the ``.npy`` format ``np.save`` writes) without ``np.save`` and
    ``np.load`` per array: the header depends only on the dtype and shape, so it is made once per
    (dtype, shape) and the data follows it. Bytes that do not start with the expected header
    (another writer, Fortran order) are read by Flower's own ``Array.numpy()``. Flower's own way
    parses every header with ``ast.literal_eval``: most of the Flower path's cost on a small model.

    The arrays it makes are a subclass of Flower's ``Array`` that also keep the array their bytes
    were made from: their ``numpy()`` (what ``ArrayRecord.to_torch_state_dict`` calls in the app's
    handler) returns a copy of it, the values ``Array.numpy()`` would parse from the bytes, until
    any field is set (then it parses the bytes). They are built without ``Array.__init__``'s
    argument matching (its fields set as that sets them, on a fresh object): the same fields, equal
    to ``Array(a)``, for anything else that reads them."""

    def __init__(self, array_type: Any) -> None:
        self.base = array_type
        codec = self

        class FastArray(array_type):  # type: ignore[misc, valid-type]
            def numpy(self) -> np.ndarray:
                src = self.__dict__.get("_src")
                return src.copy() if src is not None else codec.decode(self)

            def __setattr__(self, name: str, value: Any) -> None:
                if name in FIELDS:  # the bytes may no longer be the kept array's
                    self.__dict__.pop("_src", None)
                super().__setattr__(name, value)

        self.fast = FastArray
        self._headers: dict[tuple[np.dtype[Any], tuple[int, ...]], bytes] = {}
        self._names: dict[np.dtype[Any], str] = {}
        self._specs: dict[tuple[Any, Any], tuple[np.dtype[Any], tuple[int, ...], bytes, int]] = {}
        self._saves: FastSaves | None = None

    def header(self, dtype: np.dtype[Any], shape: tuple[int, ...]) -> bytes:
        key = (dtype, shape)  # a dtype hashes as its .str would, without making the string
        head = self._headers.get(key)
        if head is None:
            buf = io.BytesIO()
            np.save(buf, np.zeros(shape, dtype=dtype), allow_pickle=False)
            raw = buf.getvalue()
            head = raw[: len(raw) - dtype.itemsize * int(np.prod(shape))]
            self._headers[key] = head
        return head

    def name(self, dtype: np.dtype[Any]) -> str:
        """``str(dtype)``, cached: numpy makes the name anew on every ``str`` (microseconds)."""
        name = self._names.get(dtype)
        if name is None:
            name = self._names[dtype] = str(dtype)
        return name

    def encode(self, a: np.ndarray, dtype_name: str | None = None) -> Any:
        """``a`` as a Flower ``Array``, byte for byte what ``Array(a)`` holds; its ``numpy()``
        returns copies of ``a`` as it is now (``a`` is copied unless it is read-only).
        ``dtype_name``: ``str(a.dtype)`` when the caller knows it (numpy makes the name anew each
        time)."""
        a = np.ascontiguousarray(a) if a.ndim else np.array(a)
        if a.flags.writeable:
            a = a.copy()
            a.flags.writeable = False
        shape = a.shape
        arr = object.__new__(self.fast)
        arr.__dict__.update(
            dtype=self.name(a.dtype) if dtype_name is None else dtype_name,
            shape=shape,
            stype="numpy.ndarray",
            data=self.header(a.dtype, shape) + a.tobytes(),
            _src=a,
        )
        return arr

    def plain(self, a: np.ndarray) -> Any:
        """A contiguous ``a`` as a plain Flower ``Array`` (the class itself: it pickles and
        serialises as Flower's own), the fields ``Array(a)`` sets, set as ``encode`` sets them."""
        arr = object.__new__(self.base)
        arr.__dict__.update(
            dtype=self.name(a.dtype),
            shape=a.shape,
            stype="numpy.ndarray",
            data=self.header(a.dtype, a.shape) + a.tobytes(),
        )
        return arr

    def saving(self) -> FastSaves:
        """A context inside which Flower's ``Array.from_numpy_ndarray`` makes its arrays through
        :meth:`plain` (:class:`FastSaves`)."""
        saves = self._saves
        if saves is None:
            saves = self._saves = FastSaves(self)
        return saves

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

    def spec(self, dtype_name: Any, shape: Any) -> tuple[np.dtype[Any], tuple[int, ...], bytes, int]:
        """What an ``Array``'s ``dtype`` and ``shape`` fields say: the dtype, the shape, the
        ``.npy`` header ``np.save`` writes for them (empty for a dtype that is not a number) and the
        length of the bytes; cached, or ``ValueError``. Parsing a dtype name costs more than
        the rest of reading a small array."""
        try:
            return self._specs[(dtype_name, shape)]
        except (KeyError, TypeError):  # new, or fields that cannot be a key (a list, ...)
            pass
        try:
            dtype, got = np.dtype(dtype_name), tuple(int(v) for v in shape)
        except (TypeError, ValueError):
            raise ValueError(f"dtype {dtype_name!r} and shape {shape!r} are not an array's") from None
        if dtype.kind in NUMERIC:
            head = self.header(dtype, got)
            spec = (dtype, got, head, len(head) + dtype.itemsize * int(np.prod(got)))
        else:
            spec = (dtype, got, b"", -1)
        try:
            self._specs[(dtype_name, shape)] = spec
        except TypeError:
            pass
        return spec

    def read(self, arr: Any, shape: tuple[int, ...]) -> np.ndarray:
        """A reply's ``Array`` of the expected ``shape`` as a numeric array (read-only: a view of
        its bytes, or its kept array), or ``TypeError`` (not an ``Array``) or ``ValueError``
        saying why it is not one: another shape, not a number type, bytes that are not the ``.npy`` array its
        fields describe."""
        if not isinstance(arr, self.base):
            raise TypeError(f"a {type(arr).__name__}, not a flwr Array")
        src = arr.__dict__.get("_src") if isinstance(arr, self.fast) else None
        if src is not None:
            value = src
        else:
            if arr.stype != "numpy.ndarray":
                raise ValueError(f"stype {arr.stype!r}, not numpy.ndarray")
            dtype, got, head, size = self.spec(arr.dtype, arr.shape)
            if got != shape:
                raise ValueError(f"shape {got}, the model's {shape}")
            if dtype.kind not in NUMERIC:
                raise ValueError(f"dtype {dtype}, not a number type")
            data = arr.data
            if isinstance(data, bytes) and len(data) == size and data.startswith(head):
                # the dtype and shape checked above, the bytes what they say
                return np.frombuffer(data, dtype=dtype, offset=len(head)).reshape(shape)
            try:  # another writer's header (Fortran order, ...), or not a .npy array at all
                value = np.asarray(self.base.numpy(arr))
            except Exception as exc:  # noqa: BLE001 - bytes from the user's app
                raise ValueError(f"its bytes are not a .npy array ({type(exc).__name__}: {exc})") from None
        if value.dtype.kind not in NUMERIC:
            raise ValueError(f"dtype {value.dtype}, not a number type")
        if tuple(value.shape) != shape:
            raise ValueError(f"shape {tuple(value.shape)}, the model's {shape}")
        return value


class FastSaves:
    """Inside (``with``), Flower's ``Array.from_numpy_ndarray`` (what
    ``ArrayRecord(model.state_dict())``, ``Array(ndarray)`` and ``Array(tensor)`` call per array)
    makes its ``Array`` through the codec's :meth:`NpyCodec.plain` where that is byte for byte
    what ``np.save`` writes: a number array that is not in Fortran order (``np.save`` writes any
    other in C order, as ``plain`` does); any other array goes to Flower's own. The quickstart
    handler's reply record costs as much as a step of training through ``np.save`` per tensor.
    Flower's method is back on the way out, also when the handler raised. A class rather than a
    generator: it is entered once per task."""

    def __init__(self, codec: NpyCodec) -> None:
        self.base = codec.base
        self.own = own = self.base.__dict__["from_numpy_ndarray"]

        def from_numpy_ndarray(cls: Any, ndarray: Any) -> Any:
            if (
                type(ndarray) is np.ndarray
                and ndarray.dtype.kind in NUMERIC
                and (ndarray.flags.c_contiguous or not ndarray.flags.f_contiguous)
            ):
                return codec.plain(np.ascontiguousarray(ndarray) if ndarray.ndim else ndarray)
            return own.__func__(cls, ndarray)

        self.fast = classmethod(from_numpy_ndarray)

    def __enter__(self) -> None:
        self.base.from_numpy_ndarray = self.fast

    def __exit__(self, *exc: object) -> None:
        self.base.from_numpy_ndarray = self.own


@functools.cache
def flower_codec() -> NpyCodec:
    """The process's codec of Flower's ``Array``: one fast class, so that felix's trainer and the
    helpers (:mod:`felix.flower.helpers`) read each other's arrays' kept values without parsing
    their bytes."""
    return NpyCodec(import_flwr().app.Array)


def filled(record_type: Any, items: dict[str, Any]) -> Any:
    """A Flower record (``ArrayRecord``, ``MetricRecord``, ``ConfigRecord``, ``RecordDict``: the
    typed dicts of ``flwr.app``) holding ``items``, filled in one step: its ``__setitem__``
    type-checks each entry through three calls, microseconds an entry, on a path of one or two
    SGD steps per task. For items of the types the record holds (felix's own, made here)."""
    record = record_type()
    record.__dict__["_data"].update(items)
    return record


#: ``Array``'s dataclass fields.
FIELDS = ("dtype", "shape", "stype", "data")
#: The dtype kinds a reply's arrays may have (bool, integers, floats): what a state_dict holds.
NUMERIC = "biuf"


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
        cfg.model,
    )


__all__ = [
    "CLIENT_KEY",
    "FlowerTrainer",
    "ModelMismatch",
    "build_flower_trainer",
    "flower_codec",
    "load_client_app",
]
