"""``run.executor: ray`` (felix.sim.ray_cohorts): a run's cohorts split over Ray actors give
the run the local cohort path gives, bit for bit.

The identity rests on one property of the cohort trainer, checked here without Ray: a client's update
does not depend on which other clients share its vectorised pass. The Ray test runs one tiny
simulation both ways on one local Ray instance with two CPU actors."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from torch.nn.utils import parameters_to_vector

from felix.client.cohort import CohortTask, CohortTrainer
from felix.client.schedule import task_steps
from felix.client.trainer import ClientData, TrainConfig
from felix.config import deep_merge
from felix.engine.setup import resolve_config
from felix.scenario.models import make_model
from felix.sim.ray_cohorts import generator_seed, make_generator, split_shares
from felix.sim.run import run_config
from felix.strategies.objectives import make_objective

SIZES = [1, 3, 17, 40, 16, 65, 9, 33, 20]


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("model_name", ["mlp", "small_cnn"])
@pytest.mark.parametrize(
    ("objective", "params", "cfg"),
    [
        ("ce", {}, TrainConfig(lr=0.05, batch_size=16, epochs=2, momentum=0.9)),
        ("scaffold", {"num_clients": 9}, TrainConfig(lr=0.01, batch_size=16, optimizer="adam")),
        ("federage", {"alpha": 0.3}, TrainConfig(lr=0.05, batch_size=8, max_steps=3)),
    ],
    ids=["ce-momentum", "scaffold-adam", "federage-max-steps"],
)
@pytest.mark.parametrize("actors", [2, 3])
def test_shares_with_companions_train_as_the_whole_cohort(
    model_name: str, objective: str, params: dict[str, Any], cfg: TrainConfig, actors: int
) -> None:
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(0)
    datas = [
        ClientData(torch.randn(n, 1, 8, 8, generator=g), torch.from_numpy(rng.integers(0, 6, n)))
        for n in SIZES
    ]
    model = make_model(model_name, (1, 8, 8), 6, seed=1)
    w = parameters_to_vector(model.parameters()).detach().numpy().copy()
    aux = {"scaffold_c": np.full(w.size, 0.01, np.float32)} if objective == "scaffold" else {}

    def train(idx: list[int]) -> list[tuple[Any, dict[str, Any]]]:
        trainer = CohortTrainer(copy.deepcopy(model), make_objective(objective, **params), cfg, 6)
        tasks = [CohortTask(w, datas[k], {}, aux, torch.Generator().manual_seed(k)) for k in idx]
        return list(zip(trainer.train(tasks), [t.state for t in tasks]))

    whole = train(list(range(len(SIZES))))
    steps = [task_steps(n, cfg) for n in SIZES]
    for members, companion in split_shares(steps, actors):
        for k, (v, other) in zip(members, train(members + ([companion] if companion >= 0 else []))):
            u, state = whole[k]
            assert np.array_equal(u.delta, v.delta) and u.loss == v.loss and u.stat_utility == v.stat_utility
            assert sorted(u.aux) == sorted(v.aux) and all(np.array_equal(u.aux[a], v.aux[a]) for a in u.aux)
            assert sorted(state) == sorted(other)
            assert all(np.array_equal(np.asarray(state[s]), np.asarray(other[s])) for s in state)


def test_without_a_companion_a_lone_client_differs() -> None:
    """Why companions exist: a conv model's client trained alone does not get its cohort update."""
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(0)
    datas = [
        ClientData(torch.randn(64, 1, 8, 8, generator=g), torch.from_numpy(rng.integers(0, 6, 64)))
        for _ in range(2)
    ]
    model = make_model("small_cnn", (1, 8, 8), 6, seed=1)
    w = parameters_to_vector(model.parameters()).detach().numpy().copy()
    trainer = CohortTrainer(model, make_objective("ce"), TrainConfig(lr=0.05, batch_size=16), 6)
    pair = trainer.train(
        [CohortTask(w, d, {}, {}, torch.Generator().manual_seed(k)) for k, d in enumerate(datas)]
    )
    alone = trainer.train([CohortTask(w, datas[0], {}, {}, torch.Generator().manual_seed(0))])
    with_itself = trainer.train([CohortTask(w, datas[0], {}, {}, torch.Generator().manual_seed(0))] * 2)
    assert np.array_equal(with_itself[0].delta, pair[0].delta)
    # On the pinned torch build a lone client's convolutions round differently from a cohort's;
    # a build where they agree would make companions unnecessary, and this test says so.
    assert not np.array_equal(alone[0].delta, pair[0].delta)


def test_shares_balance_steps_and_keep_who_is_alone() -> None:
    steps = [5, 40, 3, 30, 10, 1]
    shares = split_shares(steps, 2)
    assert sorted(k for members, _ in shares for k in members) == list(range(6))
    assert all(members == sorted(members) for members, _ in shares)
    assert sorted(sum(steps[k] for k in members) for members, _ in shares) == [44, 45]
    # task 1 (longest) is alone once task 3 (second) ends, as in the whole cohort; the other share's
    # longest gets a copy of itself for company
    assert sorted(shares) == [([0, 1], 3), ([2, 3, 4, 5], 3)]
    assert split_shares([7, 2], 3) == [([0], 1), ([1], 1)]
    assert split_shares([7, 7, 2], 2) == [([0, 2], 1), ([1], 1)]


def test_generator_travels_as_seed_or_state() -> None:
    fresh = torch.Generator().manual_seed(12345)
    assert generator_seed(fresh) == 12345
    used = torch.Generator().manual_seed(7)
    torch.randperm(10, generator=used)
    state = generator_seed(used)
    assert isinstance(state, torch.Tensor)
    assert torch.equal(
        torch.randperm(50, generator=make_generator(state)), torch.randperm(50, generator=used)
    )


# ---------------------------------------------------------------------------------- on Ray
TINY: dict[str, Any] = {
    "model": "small_cnn",  # convolutions: a lone client differs, the companions matter
    "partition": {"num_clients": 16, "alpha": 0.5},
    # over-committed sync rounds cancel stragglers trained early; SCAFFOLD sends aux and keeps state
    "orchestrator": {"overcommit": 1.5, "agg_goal": 6},
    "client": {"objective": "scaffold"},
    "run": {"max_aggregations": 4, "stop_at_target": False, "cohort": 8, "threads": 1},
}
VARIES = ("wall_time_s", "provenance")  # wall time, and the run settings (executor) in the provenance


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray", reason='Ray is not installed: pip install "felix-fl[ray]"')
    from felix.distributed import ray_runtime

    if ray.is_initialized():
        ray.shutdown()
    ray_runtime.start_local(num_cpus=2)
    yield ray
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.ray
def test_ray_actors_give_the_local_cohort_run(local_ray: Any) -> None:
    local = run_config(resolve_config(None, "fedavg", TINY), plots=False)
    ray_cfg = resolve_config(None, "fedavg", deep_merge(TINY, {"run": {"executor": "ray", "ray_actors": 2}}))
    calls: list[int] = []

    def count_cohorts(built: Any) -> None:
        executor = built.sim.cohort
        assert type(executor).__name__ == "RayCohortExecutor" and len(executor.actors) == 2
        train = executor.train

        def counted(tasks: list[CohortTask]) -> Any:
            calls.append(len(tasks))
            return train(tasks)

        executor.train = counted

    remote = run_config(ray_cfg, plots=False, prepare=count_cohorts)
    built = remote.built
    assert calls and max(calls) > 2  # cohorts were split over both actors
    assert built.sim.cohort.actors == []  # the run ended its actors
    assert built.orch.stats.train_cancelled > 0
    assert np.array_equal(built.orch.weights, local.built.orch.weights)
    for a, b in zip(local.built.sim.devices, built.sim.devices):
        assert sorted(a.state) == sorted(b.state)
        assert all(np.array_equal(np.asarray(a.state[k]), np.asarray(b.state[k])) for k in a.state)
    assert {k: v for k, v in remote.summary.items() if k not in VARIES} == {
        k: v for k, v in local.summary.items() if k not in VARIES
    }
    assert [(r.version, r.accuracy) for r in remote.rows] == [(r.version, r.accuracy) for r in local.rows]


@pytest.mark.slow
@pytest.mark.ray
def test_executor_probes_and_ships_replaced_data_once(local_ray: Any) -> None:
    from felix.sim.ray_cohorts import RayCohortExecutor

    g = torch.Generator().manual_seed(3)
    rng = np.random.default_rng(3)
    datas = [
        ClientData(torch.randn(n, 1, 8, 8, generator=g), torch.from_numpy(rng.integers(0, 6, n)))
        for n in (300, 20, 5, 70)
    ]
    replaced = ClientData(torch.randn(33, 1, 8, 8, generator=g), torch.from_numpy(rng.integers(0, 6, 33)))
    model = make_model("small_cnn", (1, 8, 8), 6, seed=1)
    w = parameters_to_vector(model.parameters()).detach().numpy().copy()
    w.flags.writeable = False  # a model version, as the orchestrator hands it out: shipped once
    cfg = TrainConfig(lr=0.05, batch_size=8)
    local = CohortTrainer(copy.deepcopy(model), make_objective("ce"), cfg, 6)
    executor = RayCohortExecutor(CohortTrainer(copy.deepcopy(model), make_objective("ce"), cfg, 6), datas, 2)
    try:
        probe_data = [*datas, replaced]
        want = local.probe([w] * 5, probe_data)
        got = executor.probe([w] * 5, probe_data)
        assert [(u.loss, u.stat_utility, u.num_samples) for u in got] == [
            (u.loss, u.stat_utility, u.num_samples) for u in want
        ]
        used = torch.Generator().manual_seed(9)
        torch.rand(3, generator=used)  # a generator already drawn from travels as its state

        def tasks() -> list[CohortTask]:
            gens = [torch.Generator().manual_seed(k) for k in range(4)] + [used.clone_state()]
            return [CohortTask(w, d, {}, {}, gen) for d, gen in zip(probe_data, gens)]

        for u, v in zip(local.train(tasks()), executor.train(tasks())):
            assert np.array_equal(u.delta, v.delta) and u.loss == v.loss
        assert (
            len(executor._shipped) == 1 and len(executor._data_shipped) == 1
        )  # one version, one replaced client
    finally:
        executor.close()


@pytest.mark.ray
def test_more_actors_than_the_cluster_holds_is_a_clear_error(local_ray: Any) -> None:
    from felix.config import ConfigError
    from felix.sim.ray_cohorts import RayCohortExecutor

    model = make_model("mlp", (1, 8, 8), 6, seed=1)
    trainer = CohortTrainer(model, make_objective("ce"), TrainConfig(), 6)
    with pytest.raises(ConfigError, match="3 cohort actors of 1 CPUs each do not fit"):
        RayCohortExecutor(trainer, [], actors=3)
    assert local_ray.is_initialized()  # a Ray the caller started stays up
