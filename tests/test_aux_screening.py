"""Aux values screened like updates (``felix.core.validation``): a declared aux entry of the right
key, shape and dtype but a huge value is refused before it can be summed into the server's aux
state and shipped to every client with the next training tasks."""

from __future__ import annotations

import numpy as np
import pytest

from felix.core.commands import DispatchTrain, UpdateRejected
from felix.core.events import ClientRegistered, TaskFinished
from felix.core.orchestrator import Orchestrator, OrchestratorConfig
from felix.core.types import ClientUpdate, TaskKind
from felix.core.validation import LocalSteps, UpdateValidator, ValidationConfig, Verdict
from felix.strategies.aggregation.fedavg import FedAvgAggregator
from felix.strategies.objectives import Scaffold
from felix.strategies.selection.random import RandomSelector

DIM = 40
THETA = np.random.default_rng(3).normal(0, 1, DIM).astype(np.float32)  # norm ~6
SPEC = Scaffold.declared_aux(DIM)  # scaffold_c and sum:scaffold_dc, (DIM,)/<f4


def update(dc: np.ndarray, seed: int = 0) -> ClientUpdate:
    rng = np.random.default_rng(seed)
    return ClientUpdate(
        num_samples=20,
        stat_utility=1.0,
        loss=0.7,
        duration=3.0,
        delta=rng.normal(0, 0.05, DIM).astype(np.float32),
        aux={"scaffold_c": np.zeros(DIM, np.float32), "sum:scaffold_dc": dc.astype(np.float32)},
    )


def honest_dc(seed: int, scale: float = 1.0) -> np.ndarray:
    return np.random.default_rng(100 + seed).normal(0, scale, DIM).astype(np.float32)


def validator(policy: str = "reject") -> UpdateValidator:
    return UpdateValidator(ValidationConfig(norm_policy=policy), SPEC, LocalSteps(batch_size=10))


def check(v: UpdateValidator, cid: int, upd: ClientUpdate) -> Verdict:
    return v.check(cid, TaskKind.TRAIN, upd, 20, 0, THETA)


def test_a_1e30_scaffold_entry_of_the_right_shape_is_refused_and_never_shipped() -> None:
    """The issue's attack through the orchestrator: before, the entry was accepted (0 rejected) and
    sent with the next training tasks, whose correction terms then blew up."""
    cfg = OrchestratorConfig(mode="async", agg_goal=1, concurrency=2)
    o = Orchestrator(
        cfg,
        THETA.copy(),
        RandomSelector(),
        FedAvgAggregator(),
        np.random.default_rng(0),
        validator=validator(),
    )
    out = []
    for c in range(3):
        out += o.handle(ClientRegistered(0.0, c, num_samples=20))
    task = next(t for t in o.tasks() if t.holds_slot)
    poisoned = np.full(DIM, 1e30, np.float32)  # finite in float32, the declared key, shape and dtype
    out = o.handle(TaskFinished(1.0, task.client_id, task.task_id, update(poisoned)))
    rejected = [c.reason for c in out if isinstance(c, UpdateRejected)]
    assert len(rejected) == 1 and "aux 'sum:scaffold_dc' norm" in rejected[0], rejected
    assert o.version == 0 and o.aux == {}
    # An honest update goes through and what is shipped stays small.
    task = next(t for t in o.tasks() if t.holds_slot and t.client_id != task.client_id)
    out = o.handle(TaskFinished(2.0, task.client_id, task.task_id, update(honest_dc(0))))
    assert o.version == 1
    shipped = [c.aux for c in out if isinstance(c, DispatchTrain)]
    assert shipped and all(float(np.abs(a["sum:scaffold_dc"]).max()) < 10 for a in shipped)


def test_the_bound_follows_the_median_of_recent_clients_with_a_floor() -> None:
    v = validator()
    for c in range(10):
        assert check(v, c, update(honest_dc(c))).update is not None
    scale = v.aux_scales["sum:scaffold_dc"]
    assert scale.ready and scale.median() == pytest.approx(np.sqrt(DIM), rel=0.3)
    assert check(v, 20, update(honest_dc(20, scale=10.0))).update is not None  # 10x the median
    verdict = check(v, 21, update(honest_dc(21, scale=100.0)))  # 100x: above 30x the median
    assert verdict.update is None and "exceeds the bound" in verdict.reason
    assert "median of" in verdict.reason
    # The refused value is not remembered; a client cannot drag the median with repeats either.
    for _ in range(20):
        check(v, 22, update(honest_dc(22, scale=25.0)))
    assert sum(1 for n in scale.norms.values() if n > 5 * np.sqrt(DIM)) <= 2
    # The floor: as the values shrink, the bound does not fall below 0.5 x 30 x the peak median.
    for c in range(30, 90):
        check(v, c, update(honest_dc(c, scale=0.01)))
    assert v.aux_bound("sum:scaffold_dc", THETA) >= 0.5 * 30 * scale.peak * 0.999


def test_clip_scales_the_entry_down_and_off_only_refuses_non_finite_values() -> None:
    v = validator("clip")
    verdict = check(v, 0, update(np.full(DIM, 1e30, np.float32)))
    assert verdict.update is not None and verdict.clipped
    bound = v.aux_bound("sum:scaffold_dc", THETA)
    clipped = np.linalg.norm(verdict.update.aux["sum:scaffold_dc"].astype(np.float64))
    assert clipped == pytest.approx(bound, rel=1e-5)
    assert verdict.update.aux["sum:scaffold_dc"].dtype == np.float32
    off = validator("off")
    assert check(off, 0, update(np.full(DIM, 1e30, np.float32))).update is not None
    inf = np.full(DIM, np.inf, np.float32)
    for v in (validator(), validator("clip"), off):
        verdict = v.check(0, TaskKind.EVAL, update(inf), 20, 0, THETA)
        assert verdict.update is None and "non-finite" in verdict.reason


def test_aux_history_survives_a_checkpoint() -> None:
    v = validator()
    for c in range(8):
        check(v, c, update(honest_dc(c)))
    w = validator()
    w.load_state_dict(v.state_dict())
    assert w.aux_scales["sum:scaffold_dc"].norms == v.aux_scales["sum:scaffold_dc"].norms
    assert w.aux_bound("sum:scaffold_dc", THETA) == v.aux_bound("sum:scaffold_dc", THETA)
    old = {k: val for k, val in v.state_dict().items() if k != "aux"}  # a checkpoint from before
    x = validator()
    x.load_state_dict(old)
    assert x.norms == v.norms and not x.aux_scales["sum:scaffold_dc"].ready
