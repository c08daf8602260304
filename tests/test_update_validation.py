"""Update validation in the shared core (issue 11, findings 1, 2 and 9), robust aggregation, and the
aggregation backstop: one client's result must not poison the model, crash or wedge the run, plant
state the server ships to everyone, or turn tier flips into a stream of model downloads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from felix.cli import main
from felix.config import ConfigError, validate
from felix.core.aggregation import Aggregator
from felix.core.commands import DispatchEval, DispatchTrain, NewModelVersion, UpdateRejected
from felix.core.events import ClientRegistered, TaskFinished, TierChanged
from felix.core.orchestrator import AvailabilityName, Orchestrator, OrchestratorConfig
from felix.core.types import BufferedUpdate, ClientUpdate, TaskKind, Tier
from felix.core.validation import AuxDecl, LocalSteps, UpdateValidator, ValidationConfig, aux_problem
from felix.engine.components import build_orchestrator
from felix.engine.setup import resolve_config
from felix.metrics.report import REASON_KEYS_MAX, reason_key, rejections_by_reason
from felix.sim.build import build
from felix.strategies.aggregation.fedavg import FedAvgAggregator, FedBuffAggregator
from felix.strategies.aggregation.robust import RobustAggregator, weighted_median, weighted_trimmed_mean
from felix.strategies.aggregation.tierfuse import TierFuseAggregator
from felix.strategies.objectives import FedeRage, Objective, Scaffold
from felix.strategies.selection.oort import OortSelector
from felix.strategies.selection.random import RandomSelector
from felix.strategies.selection.tierselect import TierSelectEval

DIM = 50
RNG = np.random.default_rng(7)
THETA0 = RNG.normal(0, 1, DIM).astype(np.float32)  # norm ~7: the warm-up bound is 7 x warmup_factor


def make(agg: Aggregator | None = None, validator: UpdateValidator | None = None, **kw) -> Orchestrator:
    cfg = OrchestratorConfig(**{"mode": "async", "agg_goal": 1, "concurrency": 1, **kw})
    return Orchestrator(
        cfg,
        THETA0.copy(),
        RandomSelector(),
        agg or FedAvgAggregator(),
        np.random.default_rng(0),
        validator=validator or UpdateValidator(),
    )


def honest(scale: float = 0.05, n: int = 20, **aux: np.ndarray) -> ClientUpdate:
    return ClientUpdate(
        num_samples=n,
        stat_utility=1.0,
        loss=0.7,
        duration=3.0,
        delta=RNG.normal(0, scale, DIM).astype(np.float32),
        aux=dict(aux),
    )


def finish(o: Orchestrator, t: float, u: ClientUpdate) -> list:
    """Hand ``u`` in as the result of the (only) training task in flight."""
    task = next(t_ for t_ in o.tasks() if t_.holds_slot and t_.kind is TaskKind.TRAIN)
    return o.handle(TaskFinished(t, task.client_id, task.task_id, u))


def reasons(cmds: list) -> list[str]:
    return [c.reason for c in cmds if isinstance(c, UpdateRejected)]


# ---------------------------------------------------------------------- finding 1: poisoning
def test_poisoned_update_is_rejected_and_the_run_goes_on() -> None:
    """The issue's attack: finite values near 3e38 and num_samples 2^40. Before: applied, the model
    was ruined for good. Now rejected (samples, then norm), and honest updates still apply."""
    o = make()
    for c in range(8):
        o.handle(ClientRegistered(0.0, c, num_samples=20))
    poison = ClientUpdate(
        num_samples=2**40, stat_utility=1.0, loss=0.1, duration=1.0, delta=np.full(DIM, 3e38, np.float32)
    )
    assert (
        "num_samples 1099511627776 exceeds the 20 the client registered" in reasons(finish(o, 1.0, poison))[0]
    )
    poison.num_samples = 20
    assert reasons(finish(o, 2.0, poison))[0].startswith("update norm")
    assert o.version == 0 and np.array_equal(o.weights, THETA0)
    t = 3.0
    for _ in range(10):
        out = finish(o, t, honest())
        assert not reasons(out) and any(isinstance(c, NewModelVersion) for c in out)
        t += 1
    # With history the bound is relative to the median of recent norms: a 100x update is refused
    # (and a huge one the same), while an honest outlier at 3x passes.
    assert reasons(finish(o, t, honest(scale=5.0)))[0].startswith("update norm")
    assert not reasons(finish(o, t + 1, honest(scale=0.15)))
    assert np.isfinite(o.weights).all() and o.version == 11
    assert o.stats.rejected == 3


def test_sample_bound_counts_the_data_plan_row() -> None:
    o = make()
    o.handle(ClientRegistered(0.0, 0, num_samples=20))
    o.set_data_plan({0: (3, 0, 2)})
    assert reasons(finish(o, 1.0, honest(n=26)))  # 20 registered + 5 planned
    assert not reasons(finish(o, 2.0, honest(n=25)))


def test_negative_loss_utility_or_duration_is_rejected() -> None:
    o = make()
    o.handle(ClientRegistered(0.0, 0, num_samples=20))
    for field in ("loss", "stat_utility", "duration"):
        u = honest()
        setattr(u, field, -1.0)
        assert reasons(finish(o, 1.0, u)) == ["negative loss, utility or duration"]


def test_clip_policy_scales_to_the_bound_and_one_client_cannot_drag_the_median() -> None:
    v = UpdateValidator(
        ValidationConfig(norm_policy="clip", norm_factor=4.0, norm_window=10, norm_min_history=3)
    )
    theta = np.ones(DIM, np.float32)
    for c in range(3):
        v.check(
            c, TaskKind.TRAIN, ClientUpdate(10, 1.0, 0.5, 1.0, np.full(DIM, 0.1, np.float32)), 10, 0, theta
        )
    median = float(np.linalg.norm(np.full(DIM, 0.1)))
    # Client 9 sends 1,000 updates just under the bound: it holds one entry, the median stays put.
    for _ in range(1000):
        big = np.full(DIM, 0.399, np.float32)
        assert not v.check(9, TaskKind.TRAIN, ClientUpdate(10, 1.0, 0.5, 1.0, big), 10, 0, theta).clipped
    assert v.norm_bound(theta, steps=10) == pytest.approx(4.0 * median, rel=1e-6)  # 10 samples, batch 1
    verdict = v.check(
        9, TaskKind.TRAIN, ClientUpdate(10, 1.0, 0.5, 1.0, np.full(DIM, 3e38, np.float32)), 10, 0, theta
    )
    assert verdict.clipped and verdict.update is not None
    assert float(np.linalg.norm(verdict.update.delta.astype(np.float64))) == pytest.approx(
        4 * median, rel=1e-5
    )
    state = v.state_dict()
    w = UpdateValidator(v.config)
    w.load_state_dict(state)
    assert w.norms == v.norms


# ---------------------------------------------------------------------- finding 2: aux
def test_aux_must_be_declared_with_its_shape_and_dtype() -> None:
    spec = {"federage_beta": AuxDecl((), "<f8")}
    assert aux_problem({"federage_beta": np.array(0.5)}, spec) is None
    assert "undeclared aux entry 'big'" in aux_problem({"big": np.zeros(10**6, np.float32)}, spec)
    assert "declared ()/<f8" in aux_problem({"federage_beta": np.zeros(3)}, spec)
    assert "declared ()/<f8" in aux_problem({"federage_beta": np.array(0.5, np.float32)}, spec)
    assert Objective.declared_aux(10) == {}
    assert FedeRage.declared_aux(10) == spec
    assert Scaffold.declared_aux(10)["scaffold_c"] == AuxDecl((10,), "<f4")


def test_aux_injection_neither_crashes_aggregation_nor_gets_shipped() -> None:
    """Before: two updates with aux 'evil' of shapes (3,) and (5,) made aggregation raise (the
    server exited for good); a large aux entry was shipped with every later task."""
    o = make(agg_goal=2, concurrency=2)
    for c in range(4):
        o.handle(ClientRegistered(0.0, c, num_samples=20))
    tasks = [t for t in o.tasks() if t.holds_slot]
    out = o.handle(TaskFinished(1.0, tasks[0].client_id, tasks[0].task_id, honest(evil=np.zeros(3))))
    out += o.handle(TaskFinished(2.0, tasks[1].client_id, tasks[1].task_id, honest(evil=np.zeros(5))))
    assert len(reasons(out)) == 2 and all("undeclared aux entry 'evil'" in r for r in reasons(out))
    out = o.handle(TaskFinished(3.0, tasks[0].client_id, tasks[0].task_id, honest(big=np.ones(10**5))))
    out += o.handle(TaskFinished(4.0, tasks[0].client_id, tasks[0].task_id, honest()))
    out += o.handle(TaskFinished(5.0, tasks[1].client_id, tasks[1].task_id, honest()))
    assert o.version == 1 and o.aux == {}
    assert all(c.aux == {} for c in out if isinstance(c, DispatchTrain))


class _Fragile(FedBuffAggregator):
    """An aggregator that cannot handle one client's (validated) update: the backstop's case."""

    def weight(self, item: BufferedUpdate) -> float:
        if item.client_id == 0:
            raise ValueError("cannot weigh client 0")
        return 1.0


def test_an_update_the_aggregator_cannot_take_is_rejected_and_the_rest_kept() -> None:
    o = make(agg=_Fragile(), agg_goal=2, concurrency=3)
    for c in range(3):
        o.handle(ClientRegistered(0.0, c, num_samples=20))
    tasks = {t.client_id: t for t in o.tasks()}
    o.handle(TaskFinished(1.0, 1, tasks[1].task_id, honest()))
    out = o.handle(TaskFinished(2.0, 0, tasks[0].task_id, honest()))  # triggers aggregation, which raises
    assert reasons(out) == ["update cannot be aggregated (cannot weigh client 0)"]
    assert o.version == 0 and np.array_equal(o.weights, THETA0)
    out = o.handle(TaskFinished(3.0, 2, tasks[2].task_id, honest()))
    assert o.version == 1 and next(c for c in out if isinstance(c, NewModelVersion)).report.client_ids == (
        1,
        2,
    )


def test_build_declares_the_objective_and_aggregator_aux() -> None:
    cfg = validate(
        {
            "partition": {"num_clients": 4},
            "client": {"objective": "federage"},
            "aggregator": {"name": "qffl", "params": {"q": 1.0}},
            "validation": {"norm_factor": 6.0},
        }
    )
    o = build_orchestrator(cfg, THETA0.copy(), None)
    assert set(o.validator.aux_spec) == {"federage_beta", "qffl_loss"}
    assert o.validator.config.norm_factor == 6.0
    with pytest.raises(ConfigError, match="validation"):
        validate({"validation": {"norm_policy": "maybe"}})


# ---------------------------------------------------------------------- robust aggregation
def test_weighted_median_and_trimmed_mean() -> None:
    vals = np.array([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [1000.0, -1000.0]])
    eq = np.full(4, 0.25)
    assert np.allclose(weighted_median(vals, eq), [2.5, 15.0])  # even count: mean of the two middles
    assert np.allclose(weighted_median(vals[:3], np.full(3, 1 / 3)), [2.0, 20.0])
    assert np.allclose(weighted_trimmed_mean(vals, eq, 0.25), [2.5, 15.0])
    assert np.allclose(weighted_trimmed_mean(vals, eq, 0.0), vals.mean(axis=0))
    w = np.array([0.7, 0.1, 0.1, 0.1])
    assert np.allclose(weighted_median(vals, w), [1.0, 10.0])
    ties = np.array([[1.0], [1.0], [2.0]])
    assert weighted_median(ties, np.full(3, 1 / 3))[0] == 1.0
    assert weighted_trimmed_mean(ties, np.full(3, 1 / 3), 1 / 3 - 1e-9)[0] == pytest.approx(1.0)


@pytest.mark.parametrize("method", ["median", "trimmed_mean"])
@pytest.mark.parametrize(
    "inner", [FedAvgAggregator(), FedBuffAggregator(server_lr=0.5), TierFuseAggregator()]
)
def test_robust_aggregation_bounds_one_outlier_with_any_weights(method: str, inner: Aggregator) -> None:
    agg = RobustAggregator(inner, method, trim=0.2)
    theta = np.zeros(DIM, np.float32)
    buf = [
        BufferedUpdate(c, c, 0, 0.0, ClientUpdate(20, 1.0, 0.5, 1.0, np.full(DIM, 0.1, np.float32)), 0)
        for c in range(4)
    ]
    buf.append(
        BufferedUpdate(9, 9, 0, 0.0, ClientUpdate(20, 1.0, 0.5, 1.0, np.full(DIM, 1e6, np.float32)), 0)
    )
    new, w, _ = agg.aggregate(theta, buf)
    assert np.allclose(new, inner.server_lr * 0.1, rtol=1e-5)
    assert w.sum() == pytest.approx(1.0)
    assert agg.name == f"{inner.name}+{method}"


def test_robust_aggregator_is_a_config_option_for_any_strategy() -> None:
    cfg = validate(
        {
            "partition": {"num_clients": 4},
            "aggregator": {"name": "tierfuse", "robust": "trimmed_mean", "trim_fraction": 0.1},
        }
    )
    o = build_orchestrator(cfg, THETA0.copy(), None)
    assert isinstance(o.aggregator, RobustAggregator) and o.aggregator.trim == 0.1
    assert isinstance(o.aggregator.inner, TierFuseAggregator)


# ---------------------------------------------------------------------- finding 9: tier flips
def test_tier_flips_cost_at_most_one_probe_per_round() -> None:
    """Before: 200 tier flips of one client brought it 1 training task and 15 eval tasks (the
    round's whole eval budget), each a full model download. A client whose probe dropped is not
    probed again in that round, as a client whose training dropped is not picked again."""
    cfg = OrchestratorConfig(mode="async", agg_goal=10, concurrency=30, knowledge=AvailabilityName.TIERTRACK)
    o = Orchestrator(
        cfg, THETA0.copy(), OortSelector(), FedBuffAggregator(), np.random.default_rng(0), TierSelectEval(10)
    )
    out = o.handle(ClientRegistered(0.0, 0, num_samples=20, tier=Tier.UN_AVL))
    t = 1.0
    for i in range(200):
        out += o.handle(TierChanged(t, 0, Tier.AVL_TRAIN if i % 2 == 0 else Tier.UN_AVL))
        t += 1.0
    trains = sum(isinstance(c, DispatchTrain) for c in out)
    evals = sum(isinstance(c, DispatchEval) for c in out)
    assert (trains, evals) == (1, 1), (trains, evals)


def test_norm_bound_scales_with_the_square_root_of_local_steps() -> None:
    """A client with much more data than the median takes more local steps and sends a larger
    honest update: compared per sqrt(steps), it is not refused (DAFL's table partitions)."""
    v = UpdateValidator(
        ValidationConfig(norm_factor=10.0, norm_min_history=3), None, LocalSteps(batch_size=10)
    )
    theta = np.ones(DIM, np.float32)
    for c in range(5):  # small clients: 10 samples, 1 step, norm 1
        d = np.zeros(DIM, np.float32)
        d[0] = 1.0
        assert v.check(c, TaskKind.TRAIN, ClientUpdate(10, 1.0, 0.5, 1.0, d), 10, 0, theta).update is not None
    assert v.norm_bound(theta, v.local_steps(10)) == pytest.approx(10.0)
    assert v.norm_bound(theta, v.local_steps(1000)) == pytest.approx(100.0)  # 100 steps
    big = np.zeros(DIM, np.float32)
    big[0] = 40.0
    assert (
        v.check(7, TaskKind.TRAIN, ClientUpdate(1000, 1.0, 0.5, 1.0, big), 1000, 0, theta).update is not None
    )
    assert v.check(8, TaskKind.TRAIN, ClientUpdate(10, 1.0, 0.5, 1.0, big), 10, 0, theta).update is None


FLOOR = ValidationConfig().norm_floor


def _long_honest_run(floor: float) -> tuple[int, UpdateValidator]:
    """300 aggregations of 10 honest updates whose typical norm shrinks 400-fold as the model
    converges; every 50th comes from a client back from a long absence, whose update was computed
    on an early model and is as large as the early ones. Returns the rejections (all false)."""
    rng = np.random.default_rng(0)
    v = UpdateValidator(ValidationConfig(norm_floor=floor), None, LocalSteps(batch_size=10))
    theta = np.ones(DIM, np.float32)
    false = 0
    for i in range(3000):
        typical = 1.0 if i % 50 == 49 else 0.998**i
        d = np.zeros(DIM, np.float32)
        d[0] = typical * rng.lognormal(0.0, 0.3)
        if v.check(i % 300, TaskKind.TRAIN, ClientUpdate(10, 1.0, 0.5, 1.0, d), 10, 0, theta).update is None:
            false += 1
    return false, v


def test_norm_floor_keeps_late_honest_updates_as_the_median_shrinks() -> None:
    without, v0 = _long_honest_run(0.0)
    assert (
        without > 0 and v0.updates.median() < 0.01 * v0.peak
    )  # the problem: the bound shrank with the median
    false, v = _long_honest_run(FLOOR)  # the default
    assert false == 0
    theta = np.ones(DIM, np.float32)
    assert v.norm_bound(theta, 1) == pytest.approx(30.0 * FLOOR * v.peak)  # the floor holds the bound
    for poison in (1e3, 3e38):  # poisoning is still refused late in the run
        d = np.zeros(DIM, np.float32)
        d[1] = poison
        verdict = v.check(5, TaskKind.TRAIN, ClientUpdate(10, 1.0, 0.5, 1.0, d), 10, 0, theta)
        assert verdict.update is None and "norm" in verdict.reason and "peak" in verdict.reason
    restored = UpdateValidator(v.config)
    restored.load_state_dict(v.state_dict())
    assert restored.peak == v.peak and restored.norm_bound(theta, 1) == v.norm_bound(theta, 1)
    with pytest.raises(ValueError, match="norm_floor"):
        ValidationConfig(norm_floor=1.5)


def test_running_median_equals_numpy_median_through_evictions_and_repeats() -> None:
    """The validator keeps its norms sorted instead of sorting per update: the median must be
    np.median's, bit for bit, while clients repeat, the window evicts and values tie."""
    rng = np.random.default_rng(3)
    v = UpdateValidator(ValidationConfig(norm_window=7, norm_min_history=1))
    for i in range(400):
        client = int(rng.integers(12))
        norm = float(rng.choice([0.5, 1.0, 2.0])) if i % 5 == 0 else float(rng.lognormal())
        v.updates.remember(client, norm)
        assert len(v.norms) <= 7
        assert v.updates.median() == float(np.median(np.fromiter(v.norms.values(), dtype=np.float64)))
    w = UpdateValidator(v.config)
    w.load_state_dict(v.state_dict())
    assert w.updates.median() == v.updates.median() and w.peak == v.peak
    for bad in (float("nan"), float("inf"), -1.0):  # a damaged checkpoint: a clear error, not a broken order
        with pytest.raises(ValueError, match="finite and non-negative"):
            w.load_state_dict({"norms": [[1, 0.5], [2, bad]], "peak": 0.5})


def test_updates_that_moved_nothing_do_not_zero_the_bound() -> None:
    """Clients with fewer samples than one batch take no step under drop_last or FedeRage's fixed
    batches and send a zero update. On the bundled digits (100 Dirichlet clients) they were most of
    the first updates under FedeRage: counted, they made the median 0, so every later honest update
    was refused and the run never aggregated. A zero update is accepted and not counted."""
    v = UpdateValidator(ValidationConfig(norm_min_history=3), None, LocalSteps(batch_size=16))
    theta = np.ones(DIM, np.float32)
    for c in range(6):  # six tiny clients, no step each
        zero = ClientUpdate(6, 0.0, 0.0, 1.0, np.zeros(DIM, np.float32))
        assert v.check(c, TaskKind.TRAIN, zero, 6, 0, theta).update is not None
    assert v.norms == {}
    for c in range(6, 12):  # honest clients, one step each: bounded by the model's norm warm-up
        d = np.zeros(DIM, np.float32)
        d[0] = 0.1 * (1 + c % 3)
        assert v.check(c, TaskKind.TRAIN, ClientUpdate(16, 1.0, 0.5, 1.0, d), 16, 0, theta).update is not None
    assert v.norm_bound(theta, 1) == pytest.approx(30 * 0.2)  # the median of the updates that moved
    assert (
        v.check(
            20, TaskKind.TRAIN, ClientUpdate(6, 0.0, 0.0, 1.0, np.zeros(DIM, np.float32)), 6, 0, theta
        ).update
        is not None
    )
    poison = np.zeros(DIM, np.float32)
    poison[1] = 1e3
    assert v.check(21, TaskKind.TRAIN, ClientUpdate(16, 1.0, 0.5, 1.0, poison), 16, 0, theta).update is None


def test_federage_on_the_default_scenario_aggregates() -> None:
    """The end-to-end form of the case above: FedeRage (fixed batches) on the embedded default,
    whose many small clients take no step, trains under synchronous FedAvg rounds."""
    cfg = resolve_config(
        None, "fedavg", {"client": {"objective": "federage"}, "run": {"max_aggregations": 5, "eval_every": 0}}
    )
    built = build(cfg)
    outcome = built.sim.run()
    assert not outcome.rejected
    assert built.orch.version == 5


def test_rejection_reasons_are_counted_with_a_bounded_number_of_keys() -> None:
    """The summary's ``rejected_by_reason`` (runs and deployments): numbers in a reason become N,
    and past REASON_KEYS_MAX distinct reasons the rest count as ``other``, since a reason may
    quote what a client sent."""
    assert reason_key("update norm 3.5e+02 exceeds the bound 12.5 (task 17)") == (
        "update norm N exceeds the bound N (task N)"
    )
    counts = rejections_by_reason(
        [f"aux 'k{i}' holds non-finite values" for i in range(REASON_KEYS_MAX + 10)]
    )
    assert len(counts) == REASON_KEYS_MAX + 1 and counts["other"] == 10
    assert sum(counts.values()) == REASON_KEYS_MAX + 10


def test_a_run_that_refuses_every_update_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """lr 100 on the default scenario: every update exceeds the warm-up bound, the run never
    aggregates, and the CLI names the reason instead of ending on "0 aggregations" alone."""
    out = tmp_path / "run"
    code = main(
        ["run", "--set", "client.lr=100", "--set", "run.max_time_s=600", "--out", str(out), "--quiet"]
    )
    assert code == 0
    summ = json.loads((out / "summary.json").read_text())
    assert summ["aggregations"] == 0
    reasons = summ["rejected_by_reason"]
    assert sum(reasons.values()) == summ["diagnostics"]["rejected"] > 0
    assert list(reasons) == [
        "update norm N exceeds the bound N (N x the model's norm, until N clients have sent updates)"
    ]
    err = capsys.readouterr().err
    assert f"{summ['diagnostics']['rejected']} client results rejected" in err and "update norm N" in err
