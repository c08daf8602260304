"""run.workers: clients trained side by side on single-threaded workers give the run of one worker."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from synthetic_data import fashion_like_idx

from felix.client.cohort_split import SplitCohort
from felix.client.trainer import one_thread
from felix.client.trainer_pool import TrainerPool
from felix.client.workers import Workers
from felix.config import ConfigError
from felix.engine.setup import resolve_config
from felix.metrics.test_pass import TestPass
from felix.scenario.datasets import ArrayDataset
from felix.scenario.models import mlp, small_cnn
from felix.sim.build import build

THREADS = torch.get_num_threads()


def test_workers_return_results_in_order_each_piece_on_one_thread() -> None:
    before = torch.get_num_threads()
    workers = Workers(2)
    try:
        assert torch.get_num_threads() == before  # the caller keeps its count
        seen: list[tuple[int, int, str]] = []

        def piece(worker: int, item: int) -> int:
            seen.append((worker, torch.get_num_threads(), threading.current_thread().name))
            return item * item

        assert workers.map(piece, range(40)) == [i * i for i in range(40)]
        assert len(seen) == 40 and {threads for _, threads, _ in seen} == {1}
        assert {w for w, _, _ in seen} <= {0, 1}
        assert torch.get_num_threads() == before

        def fails(worker: int, item: int) -> int:
            if item == 3:
                raise ValueError("piece 3")
            return item

        with pytest.raises(ValueError, match="piece 3"):
            workers.map(fails, range(6))
        assert workers.map(piece, [5]) == [25]
    finally:
        workers.close()
    assert workers.map(lambda w, i: (w, i), [1, 2]) == [(0, 1), (0, 2)]  # closed: the caller takes all
    with pytest.raises(ValueError, match="at least 1"):
        Workers(0)


def test_the_dearest_pieces_are_taken_first_and_the_results_stay_in_order() -> None:
    """Longest first: a job of unequal pieces ends with the small ones, so two workers finish close
    together; on one worker the order of the calls shows it, ties kept in the items' order."""
    workers = Workers(1)
    taken: list[str] = []

    def piece(worker: int, item: str) -> str:
        taken.append(item)
        return item.upper()

    items = ["a", "b", "c", "d", "e"]
    assert workers.map(piece, items, cost=[1, 30, 4, 30, 2]) == ["A", "B", "C", "D", "E"]
    assert taken == ["b", "d", "c", "e", "a"]
    with pytest.raises(ValueError, match="2 costs for 5 items"):
        workers.map(piece, items, cost=[1, 2])

    two = Workers(2)
    try:
        sizes = [1, 9, 2, 8, 3, 7, 30, 1]
        assert two.map(lambda w, s: s * 10, sizes, cost=sizes) == [s * 10 for s in sizes]
    finally:
        two.close()


class Dealt(Workers):
    """Two workers that take the pieces last first, the odd ones on worker 1, each piece on a thread
    of its own (grad mode and thread counts are per thread): a deal unlike one worker's order."""

    def __init__(self) -> None:
        super().__init__(1)
        self.n = 2
        self.taken: list[int] = []

    def map(self, fn: Any, items: Any, cost: Any = None) -> list[Any]:
        out: list[Any] = [None] * len(items)

        def one(i: int) -> None:
            torch.set_num_threads(1)
            out[i] = fn(i % 2, items[i])

        for i in reversed(range(len(items))):
            self.taken.append(i % 2)
            t = threading.Thread(target=one, args=(i,))
            t.start()
            t.join()
        return out


@pytest.mark.parametrize("make", [mlp, small_cnn], ids=["mlp", "small_cnn"])
def test_the_evaluation_spread_over_workers_is_the_unsplit_one(make: Any) -> None:
    """Each test batch forwarded on a worker's own model copy, the sums added in batch order: the
    accuracy, loss, per-class figures and confusion matrix of one worker, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    test = ArrayDataset(
        torch.randn(230, 1, 28, 28, generator=gen),
        torch.randint(0, 10, (230,), generator=gen),
        [str(c) for c in range(10)],
    )
    torch.manual_seed(1)
    model = make((1, 28, 28), 10)
    weights = [torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()]
    weights.append(
        weights[0]
        + np.float32(0.01) * np.random.default_rng(2).standard_normal(weights[0].size, dtype=np.float32)
    )
    with torch.no_grad():
        one = TestPass(model, test, "cpu", batch_size=50)
        spread = TestPass(model, test, "cpu", batch_size=50)
    workers = Dealt()
    spread.spread(workers)
    for w in weights:
        with one_thread():  # a run on workers has the bits of run.threads 1 (a convolution's differ)
            want = (one.accuracy_loss(w), one.per_class(w), one.confusion(w))
        assert spread.accuracy_loss(w) == want[0]
        for a, b in zip(spread.per_class(w), want[1]):
            assert np.array_equal(a, b, equal_nan=True)
        assert np.array_equal(spread.confusion(w), want[2])
        assert all(not lg.requires_grad for lg, _ in spread.batches(w))  # no graph kept on a worker
    assert workers.taken == [0, 1, 0, 1, 0] * 2  # five batches per pass, two passes, dealt round both
    assert one.passes == spread.passes == 2


@pytest.mark.parametrize(
    ("model", "cohort", "clients", "executor"),
    [
        ("mlp", "auto", 24, SplitCohort),
        ("mlp", 16, 100, SplitCohort),
        ("mlp", 1, 24, TrainerPool),
        ("small_cnn", "auto", 24, TrainerPool),
    ],
    ids=["mlp-live-cohort", "mlp-live-cohort-probes", "mlp-sequential", "cnn-sequential"],
)
def test_a_run_on_two_workers_is_the_run_on_one(
    model: str, cohort: Any, clients: int, executor: type, tmp_path: Path
) -> None:
    """The same weights, evaluations and client states: each task's arithmetic is its own and on
    one thread, whichever worker does it. FeLiX (eval tasks, on both workers), two epochs with
    momentum (stacks shrink to one row), an evaluation in four batches spread over the workers."""
    root = fashion_like_idx(tmp_path / "fashion", per_class=300, test_per_class=50)
    runs = []
    for workers in (1, 2):
        over = {
            "model": model,
            "dataset": {"name": "fashion_mnist", "root": str(root), "test_limit": 500},
            "partition": {"num_clients": clients, "alpha": 0.5},
            "client": {"epochs": 2, "momentum": 0.5},
            "run": {
                "threads": 1,
                "workers": workers,
                "cohort": cohort,
                "max_aggregations": 8,
                "stop_at_target": False,
            },
        }
        built = build(resolve_config(None, "felix", over))
        assert isinstance(built.sim.cohort, executor) == (workers == 2)
        assert built.plan is not None and built.plan.test_pass is not None
        built.plan.test_pass.batch_size = 128  # four batches, spread over the workers
        built.sim.run()
        runs.append(built)
    one, two = runs
    assert one.orch.version == two.orch.version == 8
    assert np.array_equal(one.orch.weights, two.orch.weights)
    assert [(r.version, r.time_s, r.accuracy, r.loss) for r in one.recorder.rows] == [
        (r.version, r.time_s, r.accuracy, r.loss) for r in two.recorder.rows
    ]
    for a, b in zip(one.sim.devices, two.sim.devices):
        assert sorted(a.state) == sorted(b.state)
    if clients == 100:  # eval tasks in groups (at least two ready), each dealt round both shares
        assert isinstance(two.sim.cohort, SplitCohort)
        assert all(t.stats.probe_rows > 0 for t in two.sim.cohort.trainers)


def test_workers_need_the_local_executor() -> None:
    pytest.importorskip("ray", reason="extra felix-fl[ray] not installed (the ray executor is refused first)")
    cfg = resolve_config(None, "felix", {"model": "mlp", "run": {"workers": 2, "executor": "ray"}})
    with pytest.raises(ConfigError, match="run.workers 2 needs run.executor local"):
        build(cfg)


@pytest.mark.slow  # a benchmark harness (benchmarks/engine_speed.py)
def test_engine_speed_times_each_worker_count_in_turn(capsys: pytest.CaptureFixture[str]) -> None:
    """``--workers 2,1``: one line per count, the same run on each, with the load averages;
    ``--bare-evaluate``: the bare loop redoes the run's evaluations and eval tasks too (a second ratio)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import engine_speed
    finally:
        sys.path.pop(0)
    argv = ["--scenario", "default", "--aggregations", "3", "--warmup", "1", "--bare-repeats", "1"]
    argv += ["--set", "model=mlp", "--cohort", "4", "--workers", "2,1", "--json", "--bare-evaluate"]
    assert engine_speed.main(argv) == 0
    lines = [json.loads(ln) for ln in capsys.readouterr().out.strip().splitlines()]
    assert [ln["workers"] for ln in lines] == [2, 1]
    assert lines[0]["virtual_s"] == lines[1]["virtual_s"] and lines[0]["updates"] == lines[1]["updates"]
    assert lines[0]["final_accuracy"] == lines[1]["final_accuracy"]
    assert lines[0]["bare_probes"] == lines[1]["bare_probes"] > 0  # FeLiX's eval tasks, the same on both
    for ln in lines:
        assert len(ln["load_avg_before"]) == len(ln["load_avg_after"]) == 3 and ln["ratio_to_bare"] > 0
        assert ln["bare_evaluations"] == 4  # the initial model's and three aggregations'
        # The ratio from the parts, which are rounded to the millisecond: within the bounds their
        # rounding allows (a few milliseconds each here, so a relative tolerance would not do).
        wall, loop = ln["wall_s"], ln["bare_sequential_s"] + ln["bare_eval_s"]
        low, high = (wall - 0.0005) / (loop + 0.001), (wall + 0.0005) / max(loop - 0.001, 1e-9)
        assert low - 0.0005 <= ln["ratio_to_bare_with_eval"] <= high + 0.0005 and ln["bare_eval_s"] > 0
