"""``data_plan: lb | dafl`` in simulated runs, on the bundled digits (8 clients, 8 classes, MLP)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from felix.config import ConfigError, deep_merge
from felix.engine.setup import resolve_config
from felix.scenario.build import build_runtimes
from felix.sim.build import build
from felix.sim.run import run_config
from felix.strategies.dataplans.dafl import plan_dafl, plan_local_balancing
from felix.strategies.dataplans.plans import dafl_params, registered_counts

# Client x class counts: every client skewed towards one class, one client nearly balanced.
TABLE = [
    [8, 1, 2, 1, 1, 1, 1, 1],
    [1, 9, 1, 1, 1, 1, 1, 1],
    [1, 1, 1, 10, 1, 1, 1, 1],
    [2, 1, 1, 1, 12, 1, 1, 1],
    [1, 1, 1, 1, 1, 20, 1, 1],
    [1, 2, 1, 1, 1, 1, 15, 1],
    [1, 1, 1, 1, 1, 1, 1, 30],
    [3, 3, 3, 1, 3, 3, 3, 3],
]
SPS = 0.1  # virtual seconds per sample of a training task

BASE: dict[str, Any] = {
    "model": "mlp",
    "dataset": {"name": "digits", "num_classes": 8},
    "partition": {"kind": "table", "num_clients": 8, "table": TABLE},
    "trace": {"kind": "always"},
    "runtime": {"kind": "per_sample", "seconds_per_sample": SPS},
    "orchestrator": {"mode": "sync", "agg_goal": 8, "overcommit": 1.0, "task_timeout_s": None},
    "client": {"batch_size": 8},
    "run": {"max_aggregations": 3, "stop_at_target": False},
}
ASYNC = {"orchestrator": {"mode": "async", "agg_goal": 3, "concurrency": 8, "task_timeout_s": None}}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models train fastest on one thread; more only wait on each other on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def config(**over: Any):
    preset = "fedbuff" if over.get("orchestrator", {}).get("mode") == "async" else "fedavg"
    return resolve_config(None, preset, deep_merge(BASE, over))


def deterministic(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary without its wall-clock measurements."""
    out = dict(summary)
    out.pop("wall_time_s")
    if "data_plan" in out:
        out["data_plan"] = {k: v for k, v in out["data_plan"].items() if k != "plan_seconds"}
        out["augmentation"] = {k: v for k, v in out["augmentation"].items() if "wall" not in k}
    return out


@pytest.mark.parametrize("method", ["lb", "dafl"])
@pytest.mark.parametrize("mode", [{}, ASYNC], ids=["sync", "async"])
def test_each_client_grows_by_exactly_its_plan_row(method: str, mode: dict[str, Any]) -> None:
    res = run_config(config(data_plan=method, **mode), None, plots=False)
    pop, sim = res.built.population, res.built.sim
    counts = registered_counts(pop.client_data, 8)
    assert counts.tolist() == TABLE
    plan = plan_dafl(counts) if method == "dafl" else plan_local_balancing(counts)
    assert res.built.data_plan is not None
    assert res.built.data_plan.plan.A.tolist() == plan.A.tolist()
    assert res.built.orch.plans == {k: tuple(row) for k, row in enumerate(plan.A.tolist())}
    for dev, original, row in zip(sim.devices, pop.client_data, plan.A):
        assert dev.augmented
        assert torch.bincount(dev.data.y, minlength=8).tolist() == (np.array(TABLE[dev.cid]) + row).tolist()
        assert torch.equal(dev.data.x[: len(original)], original.x)  # new samples are appended
        assert dev.runtime_s == pytest.approx(SPS * len(dev.data))  # per_sample: tasks grow with the data
    s = res.summary
    assert set(s["data_plan"]) == {
        "method",
        "I_before",
        "J_before",
        "I_after",
        "J_after",
        "added",
        "added_per_client",
        "plan_seconds",
    }
    assert s["data_plan"]["method"] == method
    assert s["data_plan"]["added"] == plan.added and s["data_plan"]["J_after"] == plan.J_after <= 1e-3
    assert s["data_plan"]["I_before"] == plan.I_before and s["data_plan"]["I_after"] == plan.I_after
    aug = s["augmentation"]
    assert aug["samples_per_client"] == list(plan.added_per_client)
    assert aug["virtual_s_per_client"] == pytest.approx([0.5 * SPS * a for a in plan.added_per_client])
    assert len(aug["wall_s_per_client"]) == 8 and aug["max_wall_s"] == max(aug["wall_s_per_client"]) > 0


def test_first_round_lasts_augmentation_plus_training_on_the_grown_data() -> None:
    res = run_config(
        config(data_plan="dafl", run={"max_aggregations": 1, "stop_at_target": False}), None, plots=False
    )
    added = np.array(res.summary["data_plan"]["added_per_client"])
    sizes = np.array(TABLE).sum(axis=1) + added
    # zeta / zeta' = 1/2: augmenting a sample costs half of training on one.
    assert res.summary["virtual_time_s"] == pytest.approx(max(0.5 * SPS * added + SPS * sizes))
    assert res.summary["virtual_time_s"] > SPS * max(np.array(TABLE).sum(axis=1))


def test_augmentation_time_is_charged_once() -> None:
    one = run_config(
        config(data_plan="dafl", run={"max_aggregations": 1, "stop_at_target": False}), None, plots=False
    )
    three = run_config(config(data_plan="dafl"), None, plots=False)
    sizes = np.array(TABLE).sum(axis=1) + np.array(one.summary["data_plan"]["added_per_client"])
    later_round = SPS * max(sizes)
    assert three.summary["virtual_time_s"] == pytest.approx(one.summary["virtual_time_s"] + 2 * later_round)


def test_plan_rows_are_counted_in_the_downlink_bytes() -> None:
    none = run_config(config(), None, plots=False).summary
    dafl = run_config(config(data_plan="dafl"), None, plots=False).summary
    dispatched = none["diagnostics"]["train_dispatched"]
    assert dafl["diagnostics"]["train_dispatched"] == dispatched
    # Every training task carries the client's row: 8 classes x 8 bytes.
    assert dafl["bytes_by_kind"]["down"]["train"] - none["bytes_by_kind"]["down"]["train"] == 64 * dispatched
    assert dafl["bytes_by_kind"]["down"]["eval"] == none["bytes_by_kind"]["down"]["eval"]
    # The counts go up once per client at registration, with or without a plan.
    assert dafl["bytes_by_kind"]["up"] == none["bytes_by_kind"]["up"]
    assert none["bytes_by_kind"]["up"]["control"] == 8 * (64 + 8 * 8)
    assert "data_plan" not in none and "augmentation" not in none


def test_same_seed_same_run() -> None:
    a = run_config(config(data_plan="dafl", **ASYNC), None, plots=False)
    b = run_config(config(data_plan="dafl", **ASYNC), None, plots=False)
    assert deterministic(a.summary) == deterministic(b.summary)
    for da, db in zip(a.built.sim.devices, b.built.sim.devices):
        assert torch.equal(da.data.x, db.data.x)
    c = run_config(config(data_plan="dafl", seed=1, **ASYNC), None, plots=False)
    grown = next(k for k, v in enumerate(a.summary["data_plan"]["added_per_client"]) if v)
    assert not torch.equal(a.built.sim.devices[grown].data.x, c.built.sim.devices[grown].data.x)


@pytest.mark.parametrize(
    ("objective", "data_plan"),
    [
        ("ce", "none"),
        ("wce", "none"),
        ("ce", "lb"),
        ("fedprox", "none"),
        ("focal", "none"),
        ("ce", "dafl"),
    ],
    ids=["nic", "wcel", "lb", "fedprox", "focal", "dafl"],
)
def test_class_imbalance_baselines_run(objective: str, data_plan: str) -> None:
    res = run_config(
        config(data_plan=data_plan, client={"objective": objective, "batch_size": 8}), None, plots=False
    )
    rec = res.built.recorder
    assert res.summary["aggregations"] == 3 and np.isfinite(res.summary["final_accuracy"])
    assert [r.version for r in rec.train_losses] == [1, 2, 3]
    assert all(np.isfinite(r.loss) and r.loss > 0 for r in rec.train_losses)


def test_train_loss_is_the_aggregation_weighted_mean() -> None:
    b = build(config())
    seen = []
    b.recorder.aggregation_hooks.append(seen.append)
    b.sim.run()
    for cmd, row in zip(seen, b.recorder.train_losses):
        w, losses = np.array(cmd.report.weights), np.array(cmd.report.losses)
        assert len(losses) == 8 and row.loss == pytest.approx(float(w @ losses / w.sum()))
        assert row.version == cmd.version and row.time_s == cmd.time


def test_planner_settings_come_from_the_dafl_section() -> None:
    cfg = config(data_plan="dafl", dafl={"lambda2": 1e4, "step": 2}, run={"max_aggregations": 1})
    b = build(cfg)
    assert b.data_plan is not None and b.data_plan.plan is None  # planned when the clients register
    b.sim.run()
    assert dafl_params(cfg.dafl).lambda2 == 1e4
    assert b.data_plan is not None and np.all(b.data_plan.plan.A % 2 == 0)
    assert b.data_plan.plan.A.tolist() == plan_dafl(TABLE, dafl_params(cfg.dafl)).A.tolist()


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"data_plan": "dafl", "dafl": {"augmenter": "nope"}}, "unknown augmenter 'nope'"),
        (
            {"data_plan": "lb", "partition": {"table": [[1, 0, *TABLE[0][2:]], *TABLE[1:]]}},
            "data_plan 'lb': client 0 has no samples of class 1",
        ),
        ({"dataset": {"name": "digits", "num_classes": 11}}, "dataset.num_classes is 11 but digits has 10"),
        (
            {"partition": {"table": [[0] * len(TABLE[0]), *TABLE[1:]]}},
            r"partition.table gives clients \[0\] no samples",
        ),
    ],
)
def test_bad_settings_fail_with_a_clear_message(over: dict[str, Any], needle: str) -> None:
    # An impossible plan shows when the clients have registered (the run's start), the rest at build.
    with pytest.raises(ConfigError, match=needle):
        run_config(config(**over), None, plots=False)


def test_unknown_dafl_key_is_rejected() -> None:
    with pytest.raises(ConfigError, match="dafl.lambda3: unknown key"):
        config(dafl={"lambda3": 1.0})


def test_per_sample_runtime_needs_the_client_sizes() -> None:
    cfg = config()
    assert build_runtimes(cfg, [10, 20]).tolist() == pytest.approx([10 * SPS, 20 * SPS])
    with pytest.raises(ConfigError, match="per_sample"):
        build_runtimes(cfg)


def test_num_classes_keeps_the_first_classes_of_both_splits() -> None:
    pop = build(config()).population
    assert pop.train.num_classes == 8 and pop.test.num_classes == 8
    assert int(pop.train.y.max()) == 7 and int(pop.test.y.max()) == 7
    assert set(pop.test.y.tolist()) == set(range(8))
