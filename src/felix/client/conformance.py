"""A conformance check a user runs on their own client objective.

An objective writes its hooks once, on stacked tensors (:mod:`felix.strategies.objectives.base`),
and both trainers call them: :class:`~felix.client.trainer.LocalTrainer` one client at a time (a
stack of one) and :class:`~felix.client.cohort.CohortTrainer` many clients at once (its ``loss``
under ``vmap``). :func:`check_objective` trains a few ragged clients both ways, two tasks each
(the second from the state and aux the first left), and compares every update: weights, loss,
Oort's utility, aux and state. A hook that reads across clients, keeps per-task values on the
objective, or does not run under ``vmap`` shows up as a difference naming the client, the task and
the entry; an aux entry the objective does not declare (``declared_aux``) is reported too.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from felix.client.cohort import CohortTask, CohortTrainer, cohort_blocker
from felix.client.trainer import ClientData, LocalTrainer, TrainConfig
from felix.core.types import ClientUpdate
from felix.strategies.objectives import Objective

# Clients of 1 to 5 batches of 8, with short last batches: every path of the batch schedule.
SIZES = (3, 8, 13, 21, 40)


class ObjectiveMismatch(AssertionError):
    """The objective trains differently alone and in a cohort, or sends aux it does not declare."""


@dataclass
class Conformance:
    """What :func:`check_objective` compared: the largest difference between the two paths per
    kind of value, over every client and task (``cohort`` False: the objective opts out of
    cohorts, so only the sequential path ran)."""

    cohort: bool
    tasks: int = 0
    largest: dict[str, float] = field(default_factory=dict)

    def note(self, what: str, diff: float) -> None:
        self.largest[what] = max(self.largest.get(what, 0.0), diff)


def _difference(a: Any, b: Any) -> tuple[float, float]:
    """The largest absolute difference between two values, and the scale it is judged against
    (the largest magnitude, at least 1); values that are not numbers differ by 0 or infinity."""
    try:
        x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    except (TypeError, ValueError):
        return (0.0 if a == b else float("inf")), 1.0
    if x.shape != y.shape:
        return float("inf"), 1.0
    return float(np.max(np.abs(x - y), initial=0.0)), max(1.0, float(np.max(np.abs(x), initial=0.0)))


def _default_model(features: int, num_classes: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, num_classes))


def check_objective(
    objective: Objective,
    model: nn.Module | None = None,
    *,
    num_classes: int = 4,
    features: int = 12,
    cfg: TrainConfig | None = None,
    tol: float = 1e-5,
    seed: int = 0,
) -> Conformance:
    """Train ``objective`` one client at a time and in a cohort, and compare update by update.

    ``model`` (default a small MLP on ``features`` inputs) takes samples of shape ``(features,)``.
    Each path gets its own deep copy of ``objective``. Raises :class:`ObjectiveMismatch` with the
    first difference above ``tol`` (fp32; the two paths' products differ by about 1e-7), else
    returns the largest differences seen."""
    cfg = cfg or TrainConfig(lr=0.05, batch_size=8, epochs=2)
    rng = np.random.default_rng(seed)
    net = model if model is not None else _default_model(features, num_classes, seed)
    w0 = parameters_to_vector(net.parameters()).detach().cpu().numpy()
    datas = [
        ClientData(
            torch.from_numpy(rng.standard_normal((n, features), dtype=np.float32)),
            torch.from_numpy(rng.integers(0, num_classes, n)),
        )
        for n in SIZES
    ]
    weights = [w0 + 0.01 * rng.standard_normal(w0.size).astype(np.float32) for _ in SIZES]
    declared = type(objective).declared_aux(w0.size)
    blocker = cohort_blocker(net, objective)
    report = Conformance(cohort=blocker is None)
    alone = LocalTrainer(copy.deepcopy(net), copy.deepcopy(objective), cfg, num_classes)
    together = (
        CohortTrainer(copy.deepcopy(net), copy.deepcopy(objective), cfg, num_classes)
        if blocker is None
        else None
    )
    states_a: list[dict[str, Any]] = [{} for _ in SIZES]
    states_b: list[dict[str, Any]] = [{} for _ in SIZES]
    aux: list[dict[str, np.ndarray]] = [{} for _ in SIZES]
    for task in range(2):
        seq = [
            alone.train(weights[k], d, states_a[k], aux[k], torch.Generator().manual_seed(100 * task + k))
            for k, d in enumerate(datas)
        ]
        for k, upd in enumerate(seq):
            _check_declared(upd, declared, k, task)
        if together is not None:
            coh = together.train(
                [
                    CohortTask(
                        weights[k], d, states_b[k], aux[k], torch.Generator().manual_seed(100 * task + k)
                    )
                    for k, d in enumerate(datas)
                ]
            )
            for k in range(len(SIZES)):
                _compare(report, seq[k], coh[k], states_a[k], states_b[k], k, task, tol)
        report.tasks += len(SIZES)
        aux = [dict(u.aux) for u in seq]  # the next task starts from what this one sent back
    return report


def _check_declared(upd: ClientUpdate, declared: dict[str, Any], k: int, task: int) -> None:
    for key, value in upd.aux.items():
        decl = declared.get(key)
        arr = np.asarray(value)
        if decl is None:
            raise ObjectiveMismatch(f"client {k}, task {task}: aux_out[{key!r}] is not in declared_aux")
        if tuple(arr.shape) != tuple(decl.shape) or arr.dtype != np.dtype(decl.dtype):
            raise ObjectiveMismatch(
                f"client {k}, task {task}: aux_out[{key!r}] is {arr.dtype}{list(arr.shape)}, "
                f"declared {np.dtype(decl.dtype)}{list(decl.shape)}"
            )


def _compare(
    report: Conformance,
    seq: ClientUpdate,
    coh: ClientUpdate,
    state_a: dict[str, Any],
    state_b: dict[str, Any],
    k: int,
    task: int,
    tol: float,
) -> None:
    where = f"client {k}, task {task}"
    values: list[tuple[str, Any, Any]] = [
        ("delta", seq.delta, coh.delta),
        ("loss", seq.loss, coh.loss),
        ("stat_utility", seq.stat_utility, coh.stat_utility),
    ]
    for kind, a, b in (("aux_out", seq.aux, coh.aux), ("state", state_a, state_b)):
        if sorted(a) != sorted(b):
            raise ObjectiveMismatch(f"{where}: {kind} keys {sorted(a)} alone, {sorted(b)} in a cohort")
        values += [(f"{kind}[{key!r}]", a[key], b[key]) for key in a]
    for what, a, b in values:
        diff, scale = _difference(a, b)
        if not diff <= tol * scale:
            raise ObjectiveMismatch(
                f"{where}: {what} differs by {diff:.3g} between training alone and in a cohort "
                f"(tolerance {tol * scale:.3g}); a hook reads across clients, keeps a task's values "
                "on the objective, or does not run under vmap (docs/python-api.md)"
            )
        report.note(what.split("[")[0], diff)
