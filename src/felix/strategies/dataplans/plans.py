"""Data plans in runs (``data_plan: lb | dafl``): the server plans augmentation from the clients'
class counts, and every client applies its row of the plan once.

The flow is the DAFL paper's (Sec. IV-B): clients report their class counts when they register
(``ClientRegistered.class_counts``); the server computes the augmentation matrix ``A`` (DAFL's
Algorithm 1, or local balancing) and sends row ``k`` to client ``k`` with its training tasks
(``DispatchTrain.plan``); a client augments its own data the first time a task brings its row.
The server side is the orchestrator's data-plan policy (:mod:`felix.strategies.dataplans.policy`),
the same in the simulator and the MQTT server; this module holds the client side and the summary.

Time. The paper's model charges ``zeta`` per augmented sample and ``zeta'`` per trained sample,
in relative units. The simulator turns them into seconds with each client's own per-sample
training time: augmenting one sample costs ``zeta / zeta'`` of training on one sample (for the
``per_sample`` runtime that is ``seconds_per_sample``; for the other runtime kinds, the client's
task runtime over its sample count). This is added to the virtual duration of the client's first
task, so runs stay deterministic; the measured wall seconds of the real augmentation are kept
beside it for the summary. With the ``per_sample`` runtime the client's later tasks also grow
with its augmented data; the other runtime kinds keep their drawn per-task runtimes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Generic, Protocol, TypeVar

import numpy as np
import torch
from numpy.typing import NDArray

from felix.config import Config, ConfigError
from felix.core.dataplan import DATA_PLANS
from felix.strategies.dataplans.augment import Augmenter, augment_client, get_augmenter
from felix.strategies.dataplans.dafl import AugmentationPlan
from felix.strategies.dataplans.policy import PlannedDataPlan, PlanSetup, dafl_params, plan_augmentation

__all__ = [
    "DataPlanRun",
    "PlanApplier",
    "PlanClient",
    "build_data_plan",
    "client_seed",
    "dafl_params",
    "plan_augmentation",
    "plan_summary",
    "prepare_data_plan",
    "registered_counts",
]

#: Tag of the augmentation random stream under the run seed (build.py's scenario streams use 0-4).
_AUGMENT_STREAM: Final = 101


def registered_counts(datas: Sequence[PlanData], num_classes: int) -> NDArray[np.int64]:
    """The client x class count matrix the server assembles from the clients' registrations."""
    return np.stack([np.bincount(d.y.numpy(), minlength=num_classes) for d in datas]).astype(np.int64)


def client_seed(run_seed: int, client_id: int) -> int:
    """The seed of a client's augmentation: a pure function of the run seed and the client id, so
    the augmented data is the same whichever strategy or order the client meets its plan in."""
    return int(np.random.SeedSequence([run_seed, _AUGMENT_STREAM, client_id]).generate_state(1)[0])


class PlanData(Protocol):
    """A client's training samples as a data plan reads them (``felix.client.trainer.ClientData``
    is one): this layer plans and augments tensors, and knows no trainer."""

    x: torch.Tensor
    y: torch.Tensor

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None: ...

    def __len__(self) -> int: ...


D = TypeVar("D", bound=PlanData)


class PlanClient(Protocol, Generic[D]):
    """What :class:`PlanApplier` changes on a client: the simulator's ``SimDevice`` and the
    deployment's emulated ``Device`` both have these."""

    cid: int
    data: D
    runtime_s: float


def with_samples(data: D, x: torch.Tensor, y: torch.Tensor) -> D:
    """Data of ``data``'s own type holding ``x`` and ``y``: made afresh, so that whatever the type
    derives from its samples (``ClientData``'s cached class counts) starts over."""
    return type(data)(x, y)


@dataclass
class PlanApplier:
    """The client side of a data plan: ``applier(client, row)`` augments the client's data by
    ``row`` and returns the (virtual) seconds that took (see the module docstring).

    The shell calls it once per client (``SimDevice.augmented``). Per-client results are kept in
    arrays indexed by client id for the run summary.
    """

    augmenter_name: str
    augmenter: Augmenter
    run_seed: int
    time_ratio: float
    """``zeta / zeta'``: seconds to augment one sample per second of training on one."""
    train_s_per_sample: NDArray[np.float64]
    runtime_follows_data: bool
    """True for the ``per_sample`` runtime: the device's task runtime is rescaled to its new size."""
    samples: NDArray[np.int64]
    virtual_s: NDArray[np.float64]
    wall_s: NDArray[np.float64]
    applied: NDArray[np.bool_]

    @classmethod
    def create(
        cls,
        augmenter_name: str,
        run_seed: int,
        time_ratio: float,
        train_s_per_sample: NDArray[np.float64],
        runtime_follows_data: bool,
    ) -> PlanApplier:
        n = len(train_s_per_sample)
        return cls(
            augmenter_name,
            get_augmenter(augmenter_name),
            run_seed,
            time_ratio,
            np.asarray(train_s_per_sample, dtype=np.float64),
            runtime_follows_data,
            np.zeros(n, dtype=np.int64),
            np.zeros(n),
            np.zeros(n),
            np.zeros(n, dtype=bool),
        )

    def __call__(self, dev: PlanClient[D], row: Sequence[int]) -> float:
        cid = dev.cid
        if self.applied[cid]:
            raise RuntimeError(f"client {cid} was asked to apply its data plan twice")
        self.applied[cid] = True
        added = int(sum(row))
        if added == 0:
            return 0.0
        x_new, y_new, wall = augment_client(
            dev.data.x, dev.data.y, row, self.augmenter, client_seed(self.run_seed, cid)
        )
        dev.data = with_samples(dev.data, torch.cat([dev.data.x, x_new]), torch.cat([dev.data.y, y_new]))
        per_sample = float(self.train_s_per_sample[cid])
        if self.runtime_follows_data:
            dev.runtime_s = per_sample * len(dev.data)
        seconds = self.time_ratio * per_sample * added
        self.samples[cid] = added
        self.virtual_s[cid] = seconds
        self.wall_s[cid] = wall
        return seconds

    def summary(self) -> dict[str, Any]:
        """The summary's ``augmentation`` block: per-client lists (index = client id)."""
        return {
            "augmenter": self.augmenter_name,
            "clients_augmented": int((self.samples > 0).sum()),
            "samples_per_client": self.samples.tolist(),
            "virtual_s_per_client": self.virtual_s.tolist(),
            "wall_s_per_client": self.wall_s.tolist(),
            "max_virtual_s": float(self.virtual_s.max(initial=0.0)),
            "max_wall_s": float(self.wall_s.max(initial=0.0)),
        }


def build_data_plan(cfg: Config, on_error: str = "raise") -> PlannedDataPlan | None:
    """The server's data-plan policy for ``cfg.data_plan`` (None for ``none``): it plans once the
    whole population (``partition.num_clients``) has registered; ``on_error`` as ``PlanSetup``."""
    if cfg.data_plan == "none":
        return None
    setup = PlanSetup(cfg.partition.num_clients, "skip" if on_error == "skip" else "raise")
    try:
        policy = DATA_PLANS.create(cfg.data_plan, cfg.dafl, setup, where="dafl")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    assert isinstance(policy, PlannedDataPlan)
    return policy


@dataclass
class DataPlanRun:
    """A run's data plan: the server's policy (its plan, once made) and the clients' application of it."""

    policy: PlannedDataPlan
    applier: PlanApplier

    @property
    def plan(self) -> AugmentationPlan | None:
        """The plan, once every client has registered (None before, or if it failed)."""
        return self.policy.plan


def prepare_data_plan(
    cfg: Config,
    counts: NDArray[np.int64],
    runtimes: NDArray[np.float64],
    policy: PlannedDataPlan | None = None,
) -> DataPlanRun | None:
    """Set up the clients' side of ``cfg.data_plan`` beside the server's ``policy`` (a fresh one
    when not given: the deployment's clients use only the applier); None for ``data_plan: none``.
    ``counts``: clients x classes, the samples every client registers."""
    if cfg.data_plan == "none":
        return None
    policy = policy or build_data_plan(cfg)
    assert policy is not None
    try:
        sizes = counts.sum(axis=1)
        if cfg.runtime.kind == "per_sample":
            per_sample = np.full(len(sizes), cfg.runtime.seconds_per_sample)
        else:
            per_sample = np.divide(runtimes, sizes, out=np.zeros(len(sizes)), where=sizes > 0)
        applier = PlanApplier.create(
            cfg.dafl.augmenter,
            cfg.seed,
            cfg.dafl.zeta / cfg.dafl.zeta_prime,
            per_sample,
            cfg.runtime.kind == "per_sample",
        )
    except ValueError as exc:
        raise ConfigError(f"data_plan {cfg.data_plan!r}: {exc}") from None
    return DataPlanRun(policy, applier)


def plan_summary(run: DataPlanRun | None) -> dict[str, Any]:
    """The summary's ``data_plan`` and ``augmentation`` blocks (nothing without a data plan).

    ``plan_seconds`` is the server's measured planning time (wall clock, not virtual time)."""
    if run is None:
        return {}
    return {"data_plan": run.policy.info(), "augmentation": run.applier.summary()}
