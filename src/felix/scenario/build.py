"""Turn a validated ``Config`` into a run's inputs: data, population, initial model, availability
traces, runtimes. The components that train, judge and orchestrate are built from these by
``felix.engine.components`` and put together by ``felix.engine.setup``, for every shell alike;
nothing here imports a shell or builds a component.

The population comes from the config (a registered or imported dataset, split by a partitioner)
or prepared by the caller (``ClientDatasets``: each client's samples and a test set; see
docs/python-api.md).

The scenario's random streams (partition, traces, runtimes, model init) are derived from the
seed independently of the strategy's stream, so every strategy of a comparison sees exactly the
same clients, data and availability.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from felix.client.trainer import ClientData
from felix.client.weights import model_vector
from felix.config import Config, ConfigError, deep_merge, validate
from felix.core.types import Tier
from felix.scenario.datasets import (
    AnyDataset,
    ArrayDataset,
    DatasetError,
    LazyDataset,
    check_dataset,
    first_classes,
    lazy_train_set,
    limit_per_class,
    load_dataset,
)
from felix.scenario.locations import dataset_root
from felix.scenario.long_tail import long_tail_indices
from felix.scenario.models import ModelFactory, check_model, check_model_fits, make_model, model_ref
from felix.scenario.partition import partition
from felix.scenario.profiles import make_runtimes
from felix.scenario.random_access import ram_probabilities
from felix.scenario.shards import Shards
from felix.scenario.traces import AvailabilityTrace, make_trace

log = logging.getLogger("felix.scenario.build")

# Stream ids under the run seed: scenario streams never depend on the strategy.
_PARTITION, _TRACE, _RUNTIME, _MODEL, _STRATEGY = range(5)


def _stream(seed: int, which: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, which]))


def strategy_stream(seed: int) -> np.random.Generator:
    """The strategy's random stream (the orchestrator's), independent of every scenario stream."""
    return _stream(seed, _STRATEGY)


# ---------------------------------------------------------------------- scenario parts
@functools.lru_cache(maxsize=4)
def _dataset(
    name: str,
    root: str | None,
    download: bool,
    limit: int | None,
    num_classes: int | None = None,
    params: str = "{}",
) -> tuple[ArrayDataset, ArrayDataset | None]:
    """Load (cached: a comparison's runs share one copy); ``params`` is ``dataset.params`` as JSON."""
    train, test = load_dataset(name, root, download, limit, json.loads(params))
    if num_classes is not None:
        train = _first(train, name, num_classes)
        test = None if test is None else first_classes(test, num_classes)
    return train, test


def _first(train: AnyDataset, name: str, num_classes: int) -> AnyDataset:
    """``dataset.num_classes``: the first classes of ``train``."""
    if num_classes > train.num_classes:
        raise ConfigError(f"dataset.num_classes is {num_classes} but {name} has {train.num_classes} classes")
    return first_classes(train, num_classes)


def _train_on_demand(cfg: Config) -> LazyDataset | None:
    """The configured training set with its samples read only for the rows a shard gathers, where
    the dataset can (``felix.scenario.datasets.lazy_train_set``); None: load it whole."""
    d = cfg.dataset
    if d.params:
        return None
    train = lazy_train_set(d.name, _root(d.root, d.download))
    if train is None:
        return None
    if d.per_class_limit is not None:
        train = limit_per_class(train, d.per_class_limit)
    return train if d.num_classes is None else _first(train, d.name, d.num_classes)


def partition_indices(
    cfg: Config, labels: np.ndarray, num_classes: int, groups: np.ndarray | None = None
) -> list[np.ndarray]:
    """Each client's training-set indices, from the configured partitioner and the partition
    stream; ``groups``: each sample's speaker, for the partitioners that split by it."""
    p = cfg.partition
    rng = _stream(cfg.seed, _PARTITION)
    if p.imbalance == 1:
        return partition(p, labels, num_classes, rng, groups)
    # A long tail first (partition.imbalance): the split is of the kept subset.
    head = p.head_per_class or int(np.bincount(labels, minlength=num_classes).max())
    try:
        keep, _ = long_tail_indices(labels, num_classes, head, p.imbalance, rng)
    except ValueError as exc:
        raise ConfigError(f"partition: {exc}") from None
    kept_groups = None if groups is None else groups[keep]
    return [keep[ix] for ix in partition(p, labels[keep], num_classes, rng, kept_groups)]


def build_trace(cfg: Config, population: Population | PopulationPlan | None = None) -> AvailabilityTrace:
    """The scenario's availability, from ``trace.offset_s`` seconds into it; with the population,
    a builder that asks for them gets the clients' class counts (felix.scenario.traces)."""
    counts = None if population is None else population.class_counts()
    return make_trace(cfg.trace, cfg.partition.num_clients, _stream(cfg.seed, _TRACE), counts)


def participation_shares(
    cfg: Config, trace: AvailabilityTrace, class_counts: np.ndarray, samples: int = 200
) -> np.ndarray:
    """Per client, how likely it is to take part: the RAM's p_i under ``trace.kind: ram``, else
    the share of ``samples`` evenly spaced instants of the run at which its trace lets it train."""
    if cfg.trace.kind == "ram":
        return ram_probabilities(cfg.trace, len(class_counts), _stream(cfg.seed, _TRACE), class_counts)
    end = min(cfg.run.max_time_s, cfg.trace.horizon_s)
    instants = (np.arange(samples) + 0.5) * end / samples
    return np.array(
        [
            np.mean([trace.for_client(c).tier_at(float(t)) is Tier.AVL_TRAIN for t in instants])
            for c in range(len(class_counts))
        ]
    )


def build_runtimes(cfg: Config, sizes: list[int] | None = None) -> np.ndarray:
    """Per-client task runtimes from the configured profile (``RUNTIMES``), one per entry of the
    clients' sample counts ``sizes`` (which ``per_sample`` needs), else one per configured client."""
    n = cfg.partition.num_clients if sizes is None else len(sizes)
    return make_runtimes(cfg.runtime, n, _stream(cfg.seed, _RUNTIME), sizes)


@dataclass
class Population:
    """The scenario side of a run, shared by the simulator and the deployment's server/clients.
    ``initial_weights`` is the model's vector as it travels (``client.buffers``); ``test`` is None
    for a dataset without a test set; ``model`` keeps its factory's buffers."""

    train: ArrayDataset
    test: ArrayDataset | None
    client_data: list[ClientData]
    initial_weights: np.ndarray
    model: torch.nn.Module

    def class_counts(self) -> np.ndarray:
        """Clients x classes: each client's training samples per class."""
        c = self.train.num_classes
        return np.stack([d.class_counts(c).numpy() for d in self.client_data])


@dataclass
class PopulationPlan:
    """A population before its clients' samples are gathered: the training pool, the test set,
    the initial model and each client's rows of the pool (``felix.scenario.shards``). The
    simulator gathers every client (``gather``), a deployed client process only its own
    (``shards.client``), the server none."""

    train: ArrayDataset | LazyDataset  # read on demand in a deployed client process
    test: ArrayDataset | None
    shards: Shards
    initial_weights: np.ndarray
    model: torch.nn.Module

    def class_counts(self) -> np.ndarray:
        """Clients x classes: each client's training samples per class (from the labels alone)."""
        return self.shards.class_counts

    def gather(self) -> Population:
        """The population with every client's data held (one client-ordered copy of the pool)."""
        if isinstance(self.train, LazyDataset):
            raise TypeError("a population read on demand gathers single shards, not every client")
        return Population(self.train, self.test, self.shards.gather(), self.initial_weights, self.model)


@dataclass
class ClientDatasets:
    """A prepared population's data: each client's samples, the test set (None: none) and the
    class names. Build one with :meth:`from_arrays`, which checks it."""

    clients: list[ClientData]
    test: ArrayDataset | None
    classes: list[str]

    @classmethod
    def from_arrays(
        cls, clients: Sequence[Any], test: Any = None, classes: int | Sequence[str] | None = None
    ) -> ClientDatasets:
        """``clients``: one ``(x, y)`` pair (tensors or numpy arrays), ``ClientData`` or
        ``ArrayDataset`` per client, x of shape N x (sample shape), y integer labels; ``test``
        likewise, or None. ``classes``: their names, their number, or None (max label + 1).
        ``DatasetError`` says what does not fit."""
        if not clients:
            raise DatasetError("a population needs at least one client")
        pairs = [_pair(c, f"client {k}") for k, c in enumerate(clients)]
        test_pair = None if test is None else _pair(test, "test set")
        if classes is None:
            classes = 1 + max(
                int(y.max()) for _, y in pairs + ([test_pair] if test_pair else []) if y.numel()
            )
        names = [str(c) for c in range(classes)] if isinstance(classes, int) else [str(c) for c in classes]
        shape = tuple(pairs[0][0].shape[1:])
        for k, (x, y) in enumerate(pairs):
            check_dataset(ArrayDataset(x, y, names), f"client {k}")
            if tuple(x.shape[1:]) != shape:
                raise DatasetError(
                    f"client {k}: samples of shape {tuple(x.shape[1:])}, client 0's are {shape}"
                )
        test_set = None
        if test_pair is not None:
            test_set = ArrayDataset(test_pair[0], test_pair[1], names)
            check_dataset(test_set, "test set")
            if test_set.sample_shape != shape:
                raise DatasetError(
                    f"test set: samples of shape {test_set.sample_shape}, the clients' are {shape}"
                )
        return cls(held_once([ClientData(x, y) for x, y in pairs])[2], test_set, names)


def _row_slices(clients: Sequence[ClientData]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """All the clients' rows as one ``(x, y)``, without a copy, when their data are consecutive row
    slices of one pair of contiguous tensors in client order (as :func:`held_once` and the
    configured partition lay them out); else None."""
    first = clients[0]
    bx, by = first.x._base, first.y._base
    if bx is None or by is None or not (bx.is_contiguous() and by.is_contiguous()) or by.dim() != 1:
        return None
    row = max(1, int(np.prod(bx.shape[1:])))
    start = first.y.storage_offset() - by.storage_offset()
    at = start
    for c in clients:
        if c.x._base is not bx or c.y._base is not by or not (c.x.is_contiguous() and c.y.is_contiguous()):
            return None
        if c.x.shape[1:] != bx.shape[1:] or c.x.dtype != bx.dtype or c.y.dtype != by.dtype:
            return None
        if (c.x.storage_offset() - bx.storage_offset(), c.y.storage_offset() - by.storage_offset()) != (
            at * row,
            at,
        ):
            return None
        at += len(c)
    return bx[start:at], by[start:at]


def held_once(clients: Sequence[ClientData]) -> tuple[torch.Tensor, torch.Tensor, list[ClientData]]:
    """The clients' samples as one training pool ``(x, y)`` and each client's data as a row slice
    of it: the data are held once. Clients that are row slices of one tensor already are taken as
    they are (no copy); others are concatenated once. A cohort's data pool (``cohort.DataPool``)
    adopts such a pool instead of copying every client in again, and streams draw from it."""
    whole = _row_slices(clients)
    if whole is not None:
        return whole[0], whole[1], list(clients)
    x = torch.cat([c.x for c in clients])
    y = torch.cat([c.y for c in clients])
    ends = np.cumsum([len(c) for c in clients]).tolist()
    return x, y, [ClientData(x[a:b], y[a:b]) for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def _pair(d: Any, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(d, (ClientData, ArrayDataset)):
        x, y = d.x, d.y
    elif isinstance(d, (tuple, list)) and len(d) == 2:
        x, y = d
    else:
        raise DatasetError(
            f"{what}: expected an (x, y) pair, ClientData or ArrayDataset, got {type(d).__name__}"
        )
    try:
        xt = torch.as_tensor(x, dtype=torch.float32)
        yt = torch.as_tensor(y)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise DatasetError(f"{what}: x and y must be arrays or tensors ({exc})") from None
    if yt.is_floating_point() or yt.dtype == torch.bool:
        raise DatasetError(f"{what}: labels must be integers, got {yt.dtype}")
    return xt, yt.to(torch.int64)


def fit_config(cfg: Config, num_clients: int) -> Config:
    """``cfg`` with ``partition.num_clients`` set to a prepared population's size (runtimes, traces
    and the summary count clients from it); the config written with the run says what ran."""
    if cfg.partition.num_clients == num_clients:
        return cfg
    log.info(
        "partition.num_clients %d -> %d: the size of the prepared population",
        cfg.partition.num_clients,
        num_clients,
    )
    return validate(
        deep_merge(cfg.model_dump(), {"partition": {"num_clients": num_clients}}), "prepared population"
    )


def _root(root: str | None, download: bool) -> str | None:
    """``dataset.root`` as found (a relative one under $FELIX_DATA); a missing one is an error unless
    the dataset may be downloaded."""
    if root is None:
        return None
    try:
        return str(dataset_root(root))
    except DatasetError:
        if download:
            return root
        raise


def build_population(
    cfg: Config, data: ClientDatasets | None = None, model: nn.Module | ModelFactory | None = None
) -> Population:
    """The clients' data (every client's gathered), the test set and the initial model: see
    :func:`plan_population`."""
    return plan_population(cfg, data, model).gather()


def plan_population(
    cfg: Config,
    data: ClientDatasets | None = None,
    model: nn.Module | ModelFactory | None = None,
    on_demand: bool = False,
) -> PopulationPlan:
    """The training pool and each client's rows of it, the test set and the initial model.
    ``data`` replaces the configured dataset and partition (``dataset.test_limit`` still applies);
    ``model`` replaces ``cfg.model``: a factory (seeded by the run's model stream, as the
    registered ones) or a module, whose current weights are then the initial ones. ``on_demand``
    (a deployed client process): the samples are read only for the shards gathered, where the
    dataset can, and no test set is loaded (the process evaluates none)."""
    d = cfg.dataset
    lazy = _train_on_demand(cfg) if on_demand and data is None else None
    train: ArrayDataset | LazyDataset
    test: ArrayDataset | None
    if lazy is not None:
        train, test = lazy, None
        groups = None if train.groups is None else train.groups.numpy()
        shards = Shards(train, partition_indices(cfg, train.y.numpy(), train.num_classes, groups))
    elif data is None:
        train, test = _dataset(
            d.name,
            _root(d.root, d.download),
            d.download,
            d.per_class_limit,
            d.num_classes,
            json.dumps(d.params, sort_keys=True, default=str),
        )
        groups = None if train.groups is None else train.groups.numpy()
        shards = Shards(train, partition_indices(cfg, train.y.numpy(), train.num_classes, groups))
    else:
        pool_x, pool_y, datas = held_once(data.clients)  # no copy of one made by ClientDatasets.from_arrays
        train, test = ArrayDataset(pool_x, pool_y, data.classes), data.test
        shards = Shards.of_held(train, datas)
    if test is not None and d.test_limit is not None and d.test_limit < len(test):
        # Folder datasets list the test set class by class: take a class-balanced subset, not a prefix.
        per_class = -(-d.test_limit // test.num_classes)
        y = test.y.numpy()
        keep = np.sort(np.concatenate([np.flatnonzero(y == c)[:per_class] for c in range(test.num_classes)]))
        test = test.subset(keep[: d.test_limit] if len(keep) > d.test_limit else keep)
    if isinstance(model, nn.Module):
        ref = type(model).__name__
        check_model(model, ref)
        net = copy.deepcopy(model)
    else:
        ref = model_ref(cfg.model if model is None else model)
        seed = int(_stream(cfg.seed, _MODEL).integers(2**31))
        net = make_model(
            cfg.model if model is None else model,
            train.sample_shape,
            train.num_classes,
            seed=seed,
            params=cfg.model_params,
        )
    first = train.rows(np.arange(min(2, len(train)))) if isinstance(train, LazyDataset) else train.x[:2]
    check_model_fits(net, first, train.num_classes, ref)
    return PopulationPlan(train, test, shards, model_vector(net, cfg.client.buffers), net)
