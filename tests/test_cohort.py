"""Cohort training (felix.client.cohort): the same results as training each client alone."""

from __future__ import annotations

import argparse
import copy
import logging
import sys
import time
from pathlib import Path
from typing import Any, Self
from unittest import mock

import numpy as np
import pytest
import torch
from synthetic_data import fashion_like_idx
from torch import nn
from torch.nn.utils import parameters_to_vector
from torch.utils._python_dispatch import TorchDispatchMode

from felix.client.cohort import (
    AUTO_COHORT,
    CohortTask,
    CohortTrainer,
    conv_macs,
    resolve_cohort,
)
from felix.client.schedule import batch_rows, task_steps
from felix.client.stacked_chain import StackedChain, masked_ce_grad
from felix.client.trainer import ClientData, LocalTrainer, TrainConfig
from felix.config import ConfigError, deep_merge
from felix.engine.setup import resolve_config
from felix.scenario.models import make_model
from felix.sim.build import build
from felix.strategies.objectives import make_objective

C = 6
SIZES = [1, 3, 17, 40, 16, 65, 9]  # ragged: one sample to five batches, exact and short last batches
OBJECTIVES = [
    ("ce", {}),
    ("wce", {}),
    ("focal", {"gamma": 2.0}),
    ("fedprox", {"mu": 0.1}),
    ("scaffold", {"num_clients": 7}),
    ("federage", {"alpha": 0.3, "gamma": 0.5, "beta_init": 1.8}),
]
OPTIMISERS = {
    "sgd-2-epochs": TrainConfig(lr=0.05, batch_size=16, epochs=2),
    "momentum-wd-max-steps": TrainConfig(
        lr=0.05, batch_size=16, epochs=2, momentum=0.9, weight_decay=1e-3, max_steps=3
    ),
    "adam-drop-last": TrainConfig(lr=0.01, batch_size=16, optimizer="adam", drop_last=True),
}
TOL = 1e-5  # fp32 on CPU; measured differences are about 1e-7


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def clients(seed: int = 0) -> list[ClientData]:
    rng = np.random.default_rng(seed)  # seeded features too: the adam cases sit within 2x of TOL
    return [
        ClientData(
            torch.from_numpy(rng.standard_normal((n, 1, 8, 8), dtype=np.float32)),
            torch.from_numpy(rng.integers(0, C, n)),
        )
        for n in SIZES
    ]


def largest_difference(a: Any, b: Any) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


@pytest.mark.parametrize("model_name", ["mlp", "small_cnn"])
@pytest.mark.parametrize("opt", list(OPTIMISERS))
@pytest.mark.parametrize(("objective", "params"), OBJECTIVES, ids=[o for o, _ in OBJECTIVES])
def test_cohort_trains_every_client_exactly_as_alone(
    model_name: str, opt: str, objective: str, params: dict[str, Any]
) -> None:
    cfg = OPTIMISERS[opt]
    model = make_model(model_name, (1, 8, 8), C, seed=1)
    w0 = parameters_to_vector(model.parameters()).detach().numpy()
    rng = np.random.default_rng(2)
    weights = [w0 + 0.01 * rng.standard_normal(w0.size).astype(np.float32) for _ in SIZES]
    aux = (
        {"scaffold_c": 0.01 * rng.standard_normal(w0.size).astype(np.float32)}
        if objective == "scaffold"
        else {}
    )
    if objective == "federage":
        aux = {"federage_beta": np.array(1.5)}
    start_state = (
        {"scaffold_ci": 0.01 * rng.standard_normal(w0.size).astype(np.float32)}
        if objective == "scaffold"
        else {}
    )
    data = clients()
    alone = LocalTrainer(copy.deepcopy(model), make_objective(objective, **params), cfg, C)
    together = CohortTrainer(copy.deepcopy(model), make_objective(objective, **params), cfg, C)
    s_alone = [dict(start_state) for _ in SIZES]
    s_together = [dict(start_state) for _ in SIZES]
    seq = [
        alone.train(weights[k], d, s_alone[k], aux, torch.Generator().manual_seed(k))
        for k, d in enumerate(data)
    ]
    coh = together.train(
        [
            CohortTask(weights[k], d, s_together[k], aux, torch.Generator().manual_seed(k))
            for k, d in enumerate(data)
        ]
    )
    worst = 0.0
    for a, b, sa, sb in zip(seq, coh, s_alone, s_together):
        assert a.delta is not None and b.delta is not None
        worst = max(worst, largest_difference(a.delta, b.delta))
        assert b.num_samples == a.num_samples
        assert b.stat_utility == pytest.approx(a.stat_utility, rel=1e-5, abs=1e-6)
        assert b.loss == pytest.approx(a.loss, rel=1e-5, abs=1e-6)
        assert sorted(sa) == sorted(sb) and sorted(a.aux) == sorted(b.aux)
        for key in sa:
            assert largest_difference(sa[key], sb[key]) < TOL * 10, key
        for key in a.aux:
            assert largest_difference(a.aux[key], b.aux[key]) < TOL * 10, key
    assert worst < TOL, f"largest weight difference {worst:.2e}"
    assert any(np.abs(u.delta).max() > 0 for u in coh if u.delta is not None)  # training happened


def test_live_stack_gives_every_task_its_one_shot_update() -> None:
    """Continuous batching: tasks join a live stack at different times, step beside whoever is
    there, and one is dropped mid-way; each finished task's update is bit-identical to training
    the whole group at once (an MLP: no kernel depends on the company), and the dropped task
    leaves no trace."""
    cfg = TrainConfig(lr=0.05, batch_size=4, epochs=2, momentum=0.9)
    model = make_model("mlp", (1, 8, 8), C, seed=1)
    w0 = parameters_to_vector(model.parameters()).detach().numpy()
    data = clients()
    weights = [w0 * (1 + 0.01 * k) for k in range(len(data))]

    def task(k: int) -> CohortTask:
        return CohortTask(weights[k], data[k], {}, {}, torch.Generator().manual_seed(k))

    once = CohortTrainer(copy.deepcopy(model), make_objective("ce"), cfg, C).train(
        [task(k) for k in range(len(data))]
    )
    live = CohortTrainer(copy.deepcopy(model), make_objective("ce"), cfg, C)
    for k in (0, 3, 5, 6):
        live.join(k, task(k))
    got = live.advance(6)  # 9 samples, 5 steps: tasks 0 (1 sample) and 6 finish, 3 and 5 go on
    assert sorted(got) == [0, 6] and live.live_count == 2
    for k in (1, 2, 4):
        live.join(k, task(k))
    assert live.drop(4) and not live.drop(4) and live.live(4) is None
    while live.live_count:
        got.update(live.advance(next(k for k in (1, 2, 3, 5) if live.live(k) is not None)))
    assert sorted(got) == [0, 1, 2, 3, 5, 6]
    for k, upd in got.items():
        assert upd.delta is not None and once[k].delta is not None
        assert np.array_equal(upd.delta, once[k].delta), k
        assert upd.stat_utility == once[k].stat_utility and upd.loss == once[k].loss
    with pytest.raises(KeyError):
        live.advance(4)


def test_what_a_finished_task_returns_is_its_own() -> None:
    """A finished task's aux and state leave the stack as arrays of their own: the tasks that go on
    and those that join later reuse its rows, and must not change an update the server has not
    yet aggregated (SCAFFOLD's server control, and a client control that took no step)."""
    cfg = TrainConfig(lr=0.05, batch_size=4, drop_last=True)  # 1 and 3 samples: no step
    model = make_model("mlp", (1, 8, 8), C, seed=1)
    n = sum(p.numel() for p in model.parameters())
    w0 = parameters_to_vector(model.parameters()).detach().numpy()
    data = clients()
    rng = np.random.default_rng(3)
    aux = [
        {"scaffold_c": rng.standard_normal(n, dtype=np.float32), "sum:scaffold_dc": np.zeros(n, np.float32)}
        for _ in data
    ]
    states = [{"scaffold_ci": rng.standard_normal(n, dtype=np.float32)} for _ in data]

    def task(k: int) -> CohortTask:
        return CohortTask(w0, data[k], dict(states[k]), aux[k], torch.Generator().manual_seed(k))

    def objective() -> Any:
        return make_objective("scaffold", num_clients=len(data))

    def owned(tasks: dict[int, Any]) -> dict[int, dict[str, np.ndarray]]:
        return {k: {key: np.array(v, copy=True) for key, v in u.aux.items()} for k, u in tasks.items()}

    whole = [task(k) for k in range(len(data))]
    once = CohortTrainer(copy.deepcopy(model), objective(), cfg, C).train(whole)
    live = CohortTrainer(copy.deepcopy(model), objective(), cfg, C)
    joined = {k: task(k) for k in range(len(data))}
    for k in (0, 1, 3):
        live.join(k, joined[k])
    first = live.advance(3)  # 0 and 1 take no step, 3 takes 4: all finish
    kept = owned(first)
    kept_ci = {k: joined[k].state["scaffold_ci"].copy() for k in first}
    for k in (2, 4, 5, 6):
        live.join(k, joined[k])
    rest = live.advance(5)
    while live.live_count:
        rest.update(live.advance(next(k for k in (2, 4, 6) if live.live(k) is not None)))
    assert sorted(first) == [0, 1, 3] and sorted(first | rest) == list(range(len(data)))
    for k, upd in first.items():
        for key, v in upd.aux.items():
            assert np.array_equal(v, kept[k][key]), (k, key)
            assert np.array_equal(v, once[k].aux[key]), (k, key)
        assert np.array_equal(joined[k].state["scaffold_ci"], kept_ci[k])
        assert np.array_equal(joined[k].state["scaffold_ci"], whole[k].state["scaffold_ci"])
    assert np.array_equal(joined[0].state["scaffold_ci"], states[0]["scaffold_ci"])  # no step: kept


def test_cohort_probe_matches_the_sequential_eval_task() -> None:
    model = make_model("mlp", (1, 8, 8), C, seed=1)
    w = parameters_to_vector(model.parameters()).detach().numpy()
    data = clients() + [ClientData(torch.randn(300, 1, 8, 8), torch.randint(0, C, (300,)))]  # > one batch
    alone = LocalTrainer(copy.deepcopy(model), make_objective("ce"), TrainConfig(), C)
    together = CohortTrainer(copy.deepcopy(model), make_objective("ce"), TrainConfig(), C)
    weights = [w * (1 + 0.01 * k) for k in range(len(data))]
    for a, b in zip([alone.probe(wk, d) for wk, d in zip(weights, data)], together.probe(weights, data)):
        assert b.num_samples == a.num_samples
        assert b.stat_utility == pytest.approx(a.stat_utility, rel=1e-5)
        assert b.loss == pytest.approx(a.loss, rel=1e-5)


def test_packed_probe_gives_the_stacked_probes_bits() -> None:
    """A dense chain's probe packs the samples of the clients sent the same weights into one batch;
    it must give the bits of the stacked probe (each client padded to whole chunks): clients of 0,
    1, 3 samples, about one chunk, several chunks; some sent the same weights, some others."""
    model = make_model("mlp", (1, 8, 8), C, seed=1)
    w = parameters_to_vector(model.parameters()).detach().numpy()
    g = torch.Generator().manual_seed(5)
    sizes = [0, 1, 3, 255, 256, 257, 40, 700, 2]
    data = [
        ClientData(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, C, (n,), generator=g))
        for n in sizes
    ]
    other = w * 1.01
    weights = [w, w, other, w, other, w, w, other, w]
    packed = CohortTrainer(copy.deepcopy(model), make_objective("ce"), TrainConfig(), C)
    assert packed.chain is not None and packed.chain.dense
    got = packed.probe(weights, data)
    stacked = CohortTrainer(copy.deepcopy(model), make_objective("ce"), TrainConfig(), C)
    assert stacked.chain is not None
    stacked.chain.dense = False  # the layout every other model's probe takes
    want = stacked.probe(weights, data)
    assert [(u.num_samples, u.stat_utility, u.loss) for u in got] == [
        (u.num_samples, u.stat_utility, u.loss) for u in want
    ]
    assert got[0].stat_utility == 0.0 and got[0].loss == 0.0 and got[3].loss > 0


def test_masked_ce_without_a_mask_is_the_mask_of_ones() -> None:
    """``mask=None`` (every sample real, most steps) skips the products with the mask: the same bits."""
    g = torch.Generator().manual_seed(6)
    for K, B in [(1, 1), (3, 7), (10, 32)]:
        logits, y = torch.randn(K, B, C, generator=g), torch.randint(0, C, (K, B), generator=g)
        grad_none, aux_none = masked_ce_grad(logits, y, None, {})
        grad_ones, aux_ones = masked_ce_grad(logits, y, torch.ones(K, B), {})
        assert torch.equal(grad_none, grad_ones)
        assert all(torch.equal(a, b) for a, b in zip(aux_none, aux_ones))


def test_batch_rows_follow_the_sequential_batches() -> None:
    cfg = TrainConfig(batch_size=4, epochs=2, max_steps=5)
    rows, ep0_rows, ep0_samples = batch_rows(10, cfg, torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(3)
    first, second = torch.randperm(10, generator=gen), torch.randperm(10, generator=gen)
    assert rows.shape == (5, 4) and (ep0_rows, ep0_samples) == (3, 10)
    assert rows[0].tolist() == first[:4].tolist() and rows[2].tolist() == first[8:].tolist() + [-1, -1]
    assert rows[3].tolist() == second[:4].tolist() and rows[4].tolist() == second[4:8].tolist()
    assert batch_rows(3, TrainConfig(batch_size=4, drop_last=True), torch.Generator())[0].shape == (0, 4)


@pytest.mark.parametrize(
    "cfg",
    [
        TrainConfig(batch_size=4),
        TrainConfig(batch_size=4, epochs=3, max_steps=7),
        TrainConfig(batch_size=4, epochs=2, drop_last=True),
        TrainConfig(batch_size=4, epochs=2, max_steps=2, drop_last=True),
    ],
)
def test_task_steps_count_the_batches_without_drawing(cfg: TrainConfig) -> None:
    """The step count the Ray executor balances its actors by, computed without a draw: batch_rows' rows."""
    for n in [0, 1, 3, 4, 5, 8, 13]:
        assert task_steps(n, cfg) == batch_rows(n, cfg, torch.Generator().manual_seed(0))[0].shape[0]


def test_auto_chooses_per_model_and_device(caplog: pytest.LogCaptureFixture) -> None:
    ce = make_objective("ce")
    mlp, cnn = make_model("mlp", (1, 8, 8), C), make_model("small_cnn", (1, 8, 8), C)
    assert resolve_cohort("auto", mlp, ce, "cpu")[0] == AUTO_COHORT
    assert resolve_cohort("auto", cnn, ce, "cpu") == (1, 1)  # convolutions of unknown cost: sequential
    assert resolve_cohort("auto", cnn, ce, "cpu", (1, 8, 8))[0] == AUTO_COHORT  # tiny convolutions gain
    felix_cnn = make_model("felix_cnn", (3, 32, 32), 10)
    assert conv_macs(felix_cnn, (3, 32, 32)) > 10**7
    assert resolve_cohort("auto", felix_cnn, ce, "cpu", (3, 32, 32)) == (1, 1)  # large ones lose on CPU
    assert resolve_cohort("auto", cnn, ce, "cuda")[0] == AUTO_COHORT
    assert resolve_cohort(1, mlp, ce, "cuda") == (1, 1)
    assert resolve_cohort(12, cnn, ce, "cpu") == (12, 2)
    bn = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.BatchNorm1d(8), nn.Linear(8, C))
    with caplog.at_level(logging.WARNING, logger="felix.cohort"):
        assert resolve_cohort(8, bn, ce, "cpu") == (1, 1)
    assert "BatchNorm" in caplog.text or "buffers" in caplog.text
    with pytest.raises(ValueError, match="cannot train in cohorts"):
        CohortTrainer(bn, ce, TrainConfig(), C)


# ---------------------------------------------------------------------------------- engine
SIM: dict[str, Any] = {
    "model": "mlp",
    "partition": {"num_clients": 20, "alpha": 0.5},
    "run": {"max_aggregations": 6, "stop_at_target": False},
}


def test_a_batch_larger_than_every_client_trains_sequentially(caplog: pytest.LogCaptureFixture) -> None:
    """Every batch would be short, so a stack padded to the batch size would be mostly padding
    (60,000-row batches of a few hundred samples each took 8 GB): auto trains sequentially, and an
    explicit cohort size is refused. At the largest client's size the cohort stays."""
    built = build(resolve_config(None, "fedbuff", SIM))
    largest = max(len(d.data) for d in built.sim.devices)
    assert built.sim.cohort is not None
    with caplog.at_level(logging.INFO, logger="felix.engine.trainers"):
        over = deep_merge(SIM, {"client": {"batch_size": largest + 1}})
        assert build(resolve_config(None, "fedbuff", over)).sim.cohort is None
    assert f"more than the largest client's {largest} samples" in caplog.text
    fits = deep_merge(SIM, {"client": {"batch_size": largest}, "run": {"cohort": 4}})
    assert build(resolve_config(None, "fedbuff", fits)).sim.cohort is not None
    with pytest.raises(ConfigError, match=f"run.cohort 4: client.batch_size {largest + 1} is more than"):
        build(resolve_config(None, "fedbuff", deep_merge(fits, {"client": {"batch_size": largest + 1}})))


def simulate(preset: str, cohort: int, over: dict[str, Any]) -> tuple[Any, int]:
    cfg = resolve_config(None, preset, deep_merge(deep_merge(SIM, over), {"run": {"cohort": cohort}}))
    built = build(cfg)
    passes = 0  # advances of the live cohort stack
    if built.sim.cohort is not None:
        advance = built.sim.cohort.advance  # type: ignore[attr-defined]

        def counted(key: int) -> Any:
            nonlocal passes
            passes += 1
            return advance(key)

        built.sim.cohort.advance = counted  # type: ignore[attr-defined]
    built.sim.run()
    return built, passes


@pytest.mark.parametrize(
    ("preset", "over"),
    [
        # sync rounds with over-commitment: stragglers are cancelled after being trained early
        (
            "fedavg",
            {
                "orchestrator": {"overcommit": 1.5, "agg_goal": 4},
                "client": {"objective": "scaffold", "momentum": 0.5},
            },
        ),
        (
            "fedbuff",
            {
                "orchestrator": {"concurrency": 8, "agg_goal": 3},
                "client": {"objective": "federage", "objective_params": {"alpha": 0.5}},
            },
        ),
    ],
    ids=["sync-scaffold-cancelled", "async-federage"],
)
def test_simulation_in_cohorts_matches_sequential(preset: str, over: dict[str, Any]) -> None:
    seq, none = simulate(preset, 1, over)
    coh, passes = simulate(preset, 8, over)
    assert none == 0 and passes > 0
    assert coh.orch.version == seq.orch.version == 6
    assert largest_difference(coh.orch.weights, seq.orch.weights) < 1e-4
    for a, b in zip(seq.sim.devices, coh.sim.devices):
        assert sorted(a.state) == sorted(b.state)
        for key in a.state:  # a cancelled task's state never reaches its client
            assert largest_difference(a.state[key], b.state[key]) < 1e-4
    if preset == "fedavg":
        assert coh.orch.stats.train_cancelled > 0
    assert [r.version for r in coh.recorder.rows] == [r.version for r in seq.recorder.rows]
    # the same config and seed give the same run
    again, _ = simulate(preset, 8, over)
    assert np.array_equal(again.orch.weights, coh.orch.weights)


class _WholeGroups:
    """The local cohort trainer as a whole-group executor (no live stack), as a remote one is."""

    def __init__(self, trainer: CohortTrainer) -> None:
        self.trainer = trainer

    def train(self, tasks: list[CohortTask]) -> list[Any]:
        return self.trainer.train(tasks)

    def probe(self, weights: list[np.ndarray], datas: list[ClientData]) -> list[Any]:
        return self.trainer.probe(weights, datas)


def test_the_simulator_knows_its_running_devices_without_scanning_them() -> None:
    """Cohorts are formed from the devices whose task's clock runs, kept as runners change rather
    than found by a scan of the whole population at every completion: after every event of a
    churned run (tasks pause and resume with their tier, are cancelled and time out) the kept set is
    exactly the devices with a running task."""
    over = {
        "partition": {"num_clients": 30},
        "trace": {"kind": "slotted", "unavailable_fraction": 0.4, "slot_s": 30},
        "run": {"max_aggregations": 15, "cohort": "auto"},
    }
    sim = build(resolve_config(None, "felix", deep_merge(SIM, over))).sim
    seen: list[int] = []
    progress = sim._progress

    def checked() -> None:
        progress()
        running = {d.cid for d in sim.devices if d.running is not None}
        assert set(sim._running) == running
        seen.append(len(running))

    sim._progress = checked  # type: ignore[method-assign]
    sim.run()
    # many events, over which tasks started, paused and ended
    assert len(seen) > 100 and min(seen) < max(seen)


def test_live_stack_takes_every_running_task_and_gives_the_whole_group_run() -> None:
    """The live stack steps every running training task at each advance, also those no group has
    taken yet; which tasks train alone is still the whole-group rule's. Churn and ``auto``'s
    smallest cohort (8) make some tasks train alone after stepping in the stack."""
    over = {
        "partition": {"num_clients": 30},
        "trace": {"kind": "slotted", "unavailable_fraction": 0.4, "slot_s": 30},
        "run": {"max_aggregations": 15, "cohort": "auto"},
    }
    cfg = resolve_config(None, "felix", deep_merge(SIM, over))
    live = build(cfg)
    sim = live.sim
    assert sim.cfg.min_cohort == 8
    early: set[int] = set()  # tasks that joined the stack before any group took them
    alone: list[int] = []
    join, advance_live = sim.cohort.join, sim._advance_live  # type: ignore[union-attr]

    def joined(key: int, task: CohortTask) -> None:
        if key not in sim._grouped:
            early.add(key)
        join(key, task)

    def advanced(*args: Any) -> Any:
        done = advance_live(*args)
        if done is None:
            alone.append(args[2].task_id)
        return done

    sim.cohort.join = joined  # type: ignore[union-attr]
    sim._advance_live = advanced  # type: ignore[method-assign, assignment]
    out = sim.run()
    whole = build(cfg)
    whole.sim.cohort = _WholeGroups(whole.sim.cohort)  # type: ignore[arg-type]
    whole.sim._live = None
    whole_out = whole.sim.run()

    assert early and set(alone) & early  # stepped early, then trained alone after all
    assert out.trained_unused >= len(set(alone) & early)
    assert live.orch.version == whole.orch.version == 15
    assert np.array_equal(live.orch.weights, whole.orch.weights)
    assert [(r.version, r.accuracy, r.loss) for r in live.recorder.rows] == [
        (r.version, r.accuracy, r.loss) for r in whole.recorder.rows
    ]
    assert whole_out.virtual_time_s == out.virtual_time_s


def test_dafl_augmented_clients_train_in_cohorts() -> None:
    table = [
        [8, 1, 2, 1, 1, 1, 1, 1],
        [1, 9, 1, 1, 1, 1, 1, 1],
        [1, 1, 1, 10, 1, 1, 1, 1],
        [2, 1, 1, 1, 12, 1, 1, 1],
        [1, 1, 1, 1, 1, 20, 1, 1],
        [1, 2, 1, 1, 1, 1, 15, 1],
    ]
    over = {
        "dataset": {"name": "digits", "num_classes": 8},
        "data_plan": "dafl",
        "trace": {"kind": "always"},
        "partition": {"kind": "table", "num_clients": 6, "table": table},
        "runtime": {"kind": "per_sample", "seconds_per_sample": 0.1},
        "orchestrator": {"concurrency": 6, "agg_goal": 3, "task_timeout_s": None},
        "client": {"batch_size": 8, "objective": "wce"},
    }
    seq, _ = simulate("fedbuff", 1, over)
    coh, passes = simulate("fedbuff", 6, over)
    assert passes > 0 and coh.data_plan is not None and coh.data_plan.applier.samples.sum() > 0
    assert largest_difference(coh.orch.weights, seq.orch.weights) < 1e-4


def test_threads_and_precision_apply_to_every_build() -> None:
    cfg = resolve_config(
        None,
        "fedbuff",
        deep_merge(SIM, {"run": {"threads": 2, "max_aggregations": 1, "precision": "bf16", "cohort": 4}}),
    )
    built = build(cfg)
    assert torch.get_num_threads() == 2
    assert built.sim.trainer.autocast_dtype is torch.bfloat16
    built.sim.run()
    assert np.isfinite(built.orch.weights).all()


@pytest.mark.parametrize(
    ("cohort", "objective", "params"),
    [(4, o, p) for o, p in OBJECTIVES] + [(1, "ce", {})],
    ids=[f"cohort-4-{o}" for o, _ in OBJECTIVES] + ["sequential"],
)
def test_a_model_without_convolutions_gives_the_same_run_at_any_thread_count(
    cohort: int, objective: str, params: dict[str, Any], tmp_path: Path
) -> None:
    """run.threads 1 and 2 give the same bits for an MLP (felix.client.trainer.one_thread): its
    sequential tasks, probes and one-client cohort steps stay on one thread, its cohorts split by
    client. felix-cpu-100's MLP on Fashion-MNIST-shaped images the test makes, whose single-client
    products MKL rounds otherwise on two threads; felix (eval tasks) and two epochs with momentum
    (cohorts shrink to one row)."""
    root = fashion_like_idx(tmp_path / "fashion", per_class=300, test_per_class=50)
    runs = []
    for threads in (1, 2):
        over = {
            "model": "mlp",
            "dataset": {"name": "fashion_mnist", "root": str(root), "test_limit": 500},
            "partition": {"num_clients": 24, "alpha": 0.5},
            "client": {"objective": objective, "objective_params": params, "epochs": 2, "momentum": 0.5},
            "run": {"threads": threads, "cohort": cohort, "max_aggregations": 8, "stop_at_target": False},
        }
        built = build(resolve_config(None, "felix", over))
        assert torch.get_num_threads() == threads
        built.sim.run()
        runs.append(built)
    one, two = runs
    assert one.orch.version == two.orch.version == 8
    assert np.array_equal(one.orch.weights, two.orch.weights)
    assert [(r.version, r.accuracy, r.loss) for r in one.recorder.rows] == [
        (r.version, r.accuracy, r.loss) for r in two.recorder.rows
    ]


@pytest.mark.slow  # a benchmark harness (benchmarks/engine_speed.py)
def test_engine_speed_benchmark_prints_one_json_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import engine_speed
    finally:
        sys.path.pop(0)
    assert (
        engine_speed.main(
            [
                "--scenario",
                "default",
                "--aggregations",
                "2",
                "--warmup",
                "1",
                "--bare-repeats",
                "1",
                "--rounds",
                "2",
                "--set",
                "model=mlp",
                "--cohort",
                "4",
                "--json",
                "--profile",
                str(tmp_path / "profile.txt"),
                "--profile-aggregations",
                "1",
            ]
        )
        == 0
    )
    # The profiled run's operator table, under a header naming the run.
    table = (tmp_path / "profile.txt").read_text()
    assert table.startswith("# engine_speed --profile: digits-churn90 / felix, cohort 4, 1 aggregations")
    assert "aten::" in table and "Self CPU" in table
    import json

    line = json.loads(capsys.readouterr().out.strip())
    assert line["updates"] > 0 and line["ratio_to_bare"] > 0 and line["cohort_size"] == 4
    for key in ("wall_s", "updates_per_s", "virtual_h_per_wall_h", "bare_sequential_s"):
        assert line[key] > 0
    # The wall time's split: training, eval tasks, the global evaluation (the initial model's and
    # one per aggregation at least) and the rest, which add up to the whole.
    assert line["eval_s"] > 0 and line["train_s"] > 0 and 0 <= line["probe_s"] < line["wall_s"]
    parts = line["train_s"] + line["probe_s"] + line["eval_s"] + line["other_s"]
    assert parts == pytest.approx(line["wall_s"], abs=0.005)
    # The collector's pauses fall inside those parts.
    assert 0 <= line["gc_s"] <= line["wall_s"]
    assert isinstance(line["gc_collections"], int) and (line["gc_collections"] == 0) <= (line["gc_s"] == 0)
    # The live stack's shape (cohort 4: at most four rows per lockstep step).
    assert line["cohort_advances"] >= 1
    assert line["cohort_client_steps"] >= line["cohort_lockstep_steps"] >= 1
    assert 1 <= line["cohort_mean_rows"] <= 4
    # Two rounds of the same run, each beside its own bare loop: the median round (the lower of
    # two) is the line, with every round's figures beside it.
    assert line["rounds"] == 2 and len(line["wall_s_rounds"]) == len(line["bare_sequential_s_rounds"]) == 2
    assert line["ratio_to_bare_min"] == min(line["ratio_to_bare_rounds"]) == line["ratio_to_bare"]


@pytest.mark.slow  # a benchmark harness (benchmarks/engine_speed.py)
def test_engine_speed_interleaves_the_bare_loop_with_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``--interleave 1`` the run pauses after every aggregation for the bare loop's chunk of
    the updates trained since: every update is in exactly one chunk, in order, the run is the one
    a plain run gives, and the pauses are not in the run's wall time."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import engine_speed
    finally:
        sys.path.pop(0)
    chunks: list[list[int]] = []
    pause = 1.0  # the wall time of the run with its pauses is measured around it

    def fake_bare(built: Any, tasks: list[Any], model: Any) -> tuple[float, float]:
        assert torch.get_num_threads() == 1  # --bare-threads, not the run's two
        chunks.append([task_id for _, task_id, _ in tasks])
        time.sleep(pause)
        return 1.0, 0.5

    monkeypatch.setattr(engine_speed, "bare_loop", fake_bare)
    ns = argparse.Namespace(
        scenario="default",
        preset="felix",
        set=["model=mlp", "run.threads=2"],
        bare_repeats=1,
        bare_threads=1,
        bare_evaluate=False,
        bare_fast_pool=False,
    )
    started = time.perf_counter()
    run = engine_speed.simulate(ns, 4, "4", interleave=1)
    elapsed = time.perf_counter() - started
    assert torch.get_num_threads() == 2  # the run's threads, restored after each chunk
    plain = engine_speed.simulate(ns, 4, "4")
    ids = [task_id for _, task_id, _ in run.tasks]
    assert len(chunks) >= 3 and [i for c in chunks for i in c] == ids  # the last chunk after the run
    assert run.bare is not None and run.bare.wall_s == len(chunks) and run.bare.cpu_s == 0.5 * len(chunks)
    assert plain.bare is None and [t for _, t, _ in plain.tasks] == ids
    assert run.out.virtual_time_s == plain.out.virtual_time_s
    assert run.built.recorder.rows[-1].accuracy == plain.built.recorder.rows[-1].accuracy
    # The pauses inside the run (all chunks but the last) are left out of its wall time, however
    # slowly a loaded machine runs the rest.
    assert 0 < run.out.wall_time_s <= elapsed - pause * len(chunks)


@pytest.mark.parametrize("opt", ["sgd-2-epochs", "adam-drop-last"])
@pytest.mark.parametrize(
    "beta",
    [5.0, None],
    ids=["every-step-below-beta", "free-beta"],
)
def test_cohort_federage_balanced_rule_trains_as_alone(opt: str, beta: float | None) -> None:
    """The ``balanced`` step rule trains the same in cohorts as one client at a time. Own seeded data
    (``clients`` draws from the global generator, so its draws depend on the tests before). Beta
    pinned above every loss checks the raised weight below beta on every step, where no step's weight
    can hang on a near-tie between the two paths' float-rounded losses."""
    g = torch.Generator().manual_seed(5)
    data = [
        ClientData(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, C, (n,), generator=g))
        for n in SIZES
    ]
    params: dict[str, Any] = {"alpha": 0.3, "gamma": 0.5, "step_rule": "balanced"}
    if beta is not None:
        params.update(beta_min=beta, beta_max=beta, beta_init=beta)
    cfg = OPTIMISERS[opt]
    model = make_model("mlp", (1, 8, 8), C, seed=1)
    w0 = parameters_to_vector(model.parameters()).detach().numpy()
    aux = {"federage_beta": np.array(1.5)}
    alone = LocalTrainer(copy.deepcopy(model), make_objective("federage", **params), cfg, C)
    together = CohortTrainer(copy.deepcopy(model), make_objective("federage", **params), cfg, C)
    seq = [alone.train(w0, d, {}, aux, torch.Generator().manual_seed(k)) for k, d in enumerate(data)]
    coh = together.train(
        [CohortTask(w0, d, {}, aux, torch.Generator().manual_seed(k)) for k, d in enumerate(data)]
    )
    for a, b in zip(seq, coh):
        assert a.delta is not None and b.delta is not None
        assert largest_difference(a.delta, b.delta) < TOL
        assert b.loss == pytest.approx(a.loss, rel=1e-5, abs=1e-6)
        assert largest_difference(a.aux["federage_beta"], b.aux["federage_beta"]) < TOL * 10
    assert any(np.abs(u.delta).max() > 0 for u in coh if u.delta is not None)


def assert_kernel_matches_vmap(
    model: nn.Module,
    cfg: TrainConfig,
    objective: str,
    params: dict[str, Any],
    data: list[ClientData],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stacked-chain kernel against functorch's vmap(grad(...)) on the same tasks: the same
    updates, utilities, losses, states and aux to the last bit, and the same probes."""
    shape = tuple(data[0].x.shape[1:])
    w0 = parameters_to_vector(model.parameters()).detach().numpy()
    rng = np.random.default_rng(3)
    weights = [w0 + 0.01 * rng.standard_normal(w0.size).astype(np.float32) for _ in data]
    aux: dict[str, np.ndarray] = {}
    if objective == "scaffold":
        aux = {"scaffold_c": 0.01 * rng.standard_normal(w0.size).astype(np.float32)}
    if objective == "federage":
        aux = {"federage_beta": np.array(1.5)}

    def run() -> tuple[CohortTrainer, list[Any], list[dict[str, Any]]]:
        tr = CohortTrainer(
            copy.deepcopy(model), make_objective(objective, **params), cfg, C, sample_shape=shape
        )
        states: list[dict[str, Any]] = [{} for _ in data]
        ups = tr.train(
            [
                CohortTask(weights[k], d, states[k], aux, torch.Generator().manual_seed(k))
                for k, d in enumerate(data)
            ]
        )
        return tr, ups + tr.probe(weights, data), states

    kernel, got, got_states = run()
    monkeypatch.setattr("felix.client.cohort.StackedChain.of", lambda *a, **k: None)
    plain, want, want_states = run()
    assert kernel.chain is not None and plain.chain is None
    for a, b in zip(got, want):
        assert (a.delta is None) == (b.delta is None)
        if a.delta is not None:
            assert np.array_equal(a.delta, b.delta)
        assert (a.num_samples, a.stat_utility, a.loss) == (b.num_samples, b.stat_utility, b.loss)
        assert sorted(a.aux) == sorted(b.aux)
        assert all(np.array_equal(a.aux[k], b.aux[k]) for k in a.aux)
    for sa, sb in zip(got_states, want_states):
        assert sorted(sa) == sorted(sb) and all(np.array_equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("model_name", ["mlp", "small_cnn"])
@pytest.mark.parametrize("opt", list(OPTIMISERS))
@pytest.mark.parametrize(("objective", "params"), OBJECTIVES, ids=[o for o, _ in OBJECTIVES])
def test_stacked_chain_kernel_is_bit_identical_to_vmap(
    model_name: str, opt: str, objective: str, params: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The MLP's and the small CNN's hand-written stacked kernel (felix.client.stacked_chain), for
    every objective and optimiser, with more tasks than the stack's first capacity (8)."""
    model = make_model(model_name, (1, 8, 8), C, seed=1)
    data = clients() + clients(1) + clients(2)
    assert_kernel_matches_vmap(model, OPTIMISERS[opt], objective, params, data, monkeypatch)


def test_stacked_chain_kernel_is_bit_identical_to_vmap_on_the_felix_cnn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The FeLiX authors' CNN (three unpadded convolutions and pools, then three linear layers) on
    CIFAR-shaped data, ragged clients with short last batches."""
    g = torch.Generator().manual_seed(4)
    data = [
        ClientData(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, C, (n,), generator=g))
        for n in (5, 19, 12)
    ]
    model = make_model("felix_cnn", (3, 32, 32), C, seed=1)
    cfg = TrainConfig(lr=0.05, batch_size=8, momentum=0.9)
    assert_kernel_matches_vmap(model, cfg, "ce", {}, data, monkeypatch)


class _Doubled(nn.Module):
    """Declares a sequential forward but does something else: the kernel's probe must refuse it."""

    sequential_forward = "net"

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, C))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self.net(x)


@pytest.mark.parametrize(
    ("model", "applies"),
    [
        (lambda: make_model("mlp", (1, 8, 8), C), True),
        (lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, C)), True),
        (lambda: nn.Sequential(nn.Linear(64, C, bias=False)), True),
        (lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, C)), False),
        (lambda: nn.Sequential(nn.Flatten(), nn.Dropout(0.1), nn.Linear(64, C)), False),
        (lambda: make_model("small_cnn", (1, 8, 8), C), True),
        (
            lambda: nn.Sequential(nn.Conv2d(1, 4, 3, stride=2, dilation=1), nn.Flatten(), nn.Linear(36, C)),
            True,
        ),
        (
            lambda: nn.Sequential(
                nn.Conv2d(1, 4, 3, bias=False),
                nn.MaxPool2d(3, 2, 1, ceil_mode=True),
                nn.ReLU(),
                nn.Flatten(),
                nn.Linear(64, C),
            ),
            True,
        ),
        (
            lambda: nn.Sequential(
                nn.Conv2d(1, 4, 3, groups=1, padding="same"), nn.Flatten(), nn.Linear(256, C)
            ),
            False,
        ),
        (
            lambda: nn.Sequential(
                nn.Conv2d(1, 2, 3), nn.Conv2d(2, 4, 3, groups=2), nn.Flatten(), nn.Linear(64, C)
            ),
            False,
        ),
        (lambda: nn.Sequential(nn.Conv2d(1, 4, 3), nn.AvgPool2d(2), nn.Flatten(), nn.Linear(36, C)), False),
        (lambda: nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(16, C)), False),
        (lambda: nn.Sequential(nn.Conv2d(1, C, 8)), False),  # no logits out of a Linear
        (lambda: nn.Sequential(nn.Conv2d(1, 4, 3), nn.Linear(6, C)), False),  # a Linear on images
    ],
)
def test_stacked_chain_kernel_applies_to_chains_of_plain_layers_only(model: Any, applies: bool) -> None:
    net = model()
    shape = (1, 8, 8) if any(isinstance(m, nn.Conv2d) for m in net.modules()) else None
    assert (StackedChain.of(net, masked_ce_grad, shape) is not None) == applies


def test_stacked_chain_kernel_checks_what_a_model_declares_and_skips_mixed_precision() -> None:
    assert StackedChain.of(_Doubled(), masked_ce_grad) is None  # its forward is not its chain's
    cfg = OPTIMISERS["sgd-2-epochs"]
    mlp = make_model("mlp", (1, 8, 8), C)
    assert CohortTrainer(mlp, make_objective("ce"), cfg, C).chain is not None
    assert CohortTrainer(mlp, make_objective("ce"), cfg, C, autocast=torch.bfloat16).chain is None
    # A convolutional chain is checked on a sample of its input's shape: without one, vmap trains it.
    cnn = make_model("small_cnn", (1, 8, 8), C)
    assert CohortTrainer(cnn, make_objective("ce"), cfg, C).chain is None
    assert CohortTrainer(cnn, make_objective("ce"), cfg, C, sample_shape=(1, 8, 8)).chain is not None


def test_data_pool_adopts_the_partitioned_training_set_without_copying() -> None:
    """build_population's clients are row slices of one tensor: the cohort trainer's pool takes that
    tensor as it is (no second copy of the training set), an augmented client is appended after it,
    and a client's data pickles with its own rows only."""
    import pickle

    from felix.client.cohort_stack import DataPool

    built = build(resolve_config(None, "fedavg", deep_merge(SIM, {"run": {"cohort": "auto"}})))
    datas = [d.data for d in built.sim.devices]
    base = datas[0].x._base
    assert base is not None and all(d.x._base is base for d in datas)
    pool = DataPool(torch.device("cpu"))
    offsets = pool.offsets(datas[::-1])[::-1]
    assert pool.x is not None and pool.y is not None and pool.x.data_ptr() == base.data_ptr()
    for d, off in zip(datas, offsets):
        assert torch.equal(pool.x[off : off + len(d)], d.x) and torch.equal(pool.y[off : off + len(d)], d.y)
    grown = ClientData(torch.cat([datas[1].x, datas[1].x[:3]]), torch.cat([datas[1].y, datas[1].y[:3]]))
    (at,) = pool.offsets([grown])
    assert pool.x.data_ptr() != base.data_ptr()  # appending never writes into the shared tensor
    assert torch.equal(pool.x[at : at + len(grown)], grown.x)
    assert pool.offsets(datas) == offsets
    for d, off in zip(datas, offsets):
        assert torch.equal(pool.x[off : off + len(d)], d.x)
    one = pickle.loads(pickle.dumps(datas[2]))
    assert torch.equal(one.x, datas[2].x) and one.x.untyped_storage().nbytes() == one.x.nbytes
    assert len(pickle.dumps(datas[2])) < 2 * datas[2].x.nbytes + 10_000


class HostTraffic(TorchDispatchMode):
    """Counts, while active, what moves values between host and device or waits for the device:
    tensors made from host values (``torch.tensor``: ``aten.lift_fresh``), ``.to`` / ``.cuda`` /
    ``.cpu`` calls naming a device, and reads of values (``item``, ``tolist``, ``numpy``,
    ``float`` / ``int`` / ``bool``). On a GPU each is a transfer and a stream sync; on a CPU they
    cost nothing, so they are counted where they are made."""

    READS = ("item", "tolist", "numpy", "cpu", "cuda", "__float__", "__int__", "__bool__")

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self._patches: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.lift_fresh.default:
            self.count += 1
        return func(*args, **(kwargs or {}))

    def _counted(self, name: str) -> Any:
        original = getattr(torch.Tensor, name)

        def wrapper(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            moves = (
                name != "to" or "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args)
            )
            self.count += moves
            return original(t, *args, **kwargs)

        return wrapper

    def __enter__(self) -> Self:
        self._patches = [mock.patch.object(torch.Tensor, n, self._counted(n)) for n in (*self.READS, "to")]
        for p in self._patches:
            p.start()
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for p in reversed(self._patches):
            p.stop()


@pytest.mark.parametrize("model_name", ["mlp", "small_cnn"])
@pytest.mark.parametrize("opt", ["sgd-2-epochs", "adam-drop-last"])
@pytest.mark.parametrize(("objective", "params"), OBJECTIVES, ids=[o for o, _ in OBJECTIVES])
def test_cohort_steps_make_no_host_transfers(
    model_name: str, opt: str, objective: str, params: dict[str, Any]
) -> None:
    """Deliverable 5 of issue 10: no per-batch host-to-device copies or syncs. A cohort's transfers
    and reads are per stack (its batch plan in, its updates out), so a stack of three clients that
    each take six steps makes exactly as many as one whose clients take two; and a stacked eval
    task makes as many over three chunks of its clients' data as over one."""
    cfg = OPTIMISERS[opt]
    model = make_model(model_name, (1, 8, 8), C, seed=1)
    w0 = parameters_to_vector(model.parameters()).detach().numpy()
    aux = {"federage_beta": np.array(1.5)} if objective == "federage" else {}
    params = {**params, "alpha": [0.5, 1.0, 1.0, 1.0, 1.0, 2.0]} if objective == "focal" else params

    def traffic(n: int) -> int:
        trainer = CohortTrainer(copy.deepcopy(model), make_objective(objective, **params), cfg, C)
        data = [ClientData(torch.randn(n, 1, 8, 8), torch.arange(n) % C) for _ in range(3)]
        tasks = [CohortTask(w0, d, {}, aux, torch.Generator().manual_seed(k)) for k, d in enumerate(data)]
        with HostTraffic() as seen:
            trainer.train(tasks)
        return seen.count

    short, long = traffic(2 * cfg.batch_size), traffic(6 * cfg.batch_size)
    assert short > 0  # the counter sees the stack's own transfers
    assert long == short, f"{long - short} more transfers or reads for four more steps per client"


@pytest.mark.parametrize(
    ("objective", "params"),
    [
        *[o for o in OBJECTIVES if o[0] != "focal"],
        ("focal", {"alpha": [0.5, 1, 1, 1, 1, 2]}),
    ],
    ids=["ce", "wce", "fedprox", "scaffold", "federage", "focal-alpha"],
)
def test_sequential_training_makes_no_host_transfers_per_batch(
    objective: str, params: dict[str, Any]
) -> None:
    """The same for a client trained alone (``run.cohort: 1``, models that cannot be stacked): the
    objectives' tensors go to the device once per task, and FedeRage takes each step's risk weight
    from the batch loss on the device (it used to read the loss on the host, a sync per batch)."""
    model = make_model("mlp", (1, 8, 8), C, seed=1)
    w0 = parameters_to_vector(model.parameters()).detach().numpy()
    trainer = LocalTrainer(model, make_objective(objective, **params), TrainConfig(lr=0.05, batch_size=8), C)

    def traffic(n: int) -> int:
        data = ClientData(torch.randn(n, 1, 8, 8), torch.arange(n) % C)
        with HostTraffic() as seen:
            trainer.train(w0, data, {}, {}, torch.Generator().manual_seed(0))
        return seen.count

    assert traffic(8) == traffic(40) > 0  # one batch, then five


def test_cohort_probe_makes_no_host_transfers_per_chunk() -> None:
    model = make_model("mlp", (1, 8, 8), C, seed=1)
    w = parameters_to_vector(model.parameters()).detach().numpy()
    trainer = CohortTrainer(model, make_objective("ce"), TrainConfig(), C)

    def traffic(n: int) -> int:
        data = [ClientData(torch.randn(n, 1, 8, 8), torch.arange(n) % C) for _ in range(3)]
        with HostTraffic() as seen:
            trainer.probe([w, w, w], data, batch_size=16)
        return seen.count

    assert traffic(16) == traffic(48) > 0  # one chunk of 16 samples a client, then three
