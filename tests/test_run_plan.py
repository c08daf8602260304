"""The run plan (felix.engine.plan): built once per run, consumed by the simulator, the MQTT server
and each MQTT client process; a client process gathers only its own shard; the run's torch
settings are applied once per run; one test-set pass per evaluated model feeds every measure."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from mqtt_support import load_config, write_config
from synthetic_data import fashion_like_idx

from felix import api, cpu_kernels
from felix.deploy.client import ClientHost, ClientOptions
from felix.deploy.link import BrokerOptions
from felix.deploy.server import ServeOptions, Server
from felix.engine.plan import plan_run
from felix.metrics.per_client import PerClientSetup, make_per_client_eval
from felix.metrics.test_pass import TestPass
from felix.scenario.build import build_population
from felix.scenario.shards import Shards


@pytest.fixture
def settings_applied(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times a run applied its torch settings: ``apply_run_settings`` (threads, device,
    precision) checks the CPU kernels first, whichever module calls it."""
    calls: list[int] = []
    check = cpu_kernels.check

    def counted() -> str:
        calls.append(1)
        return check()

    monkeypatch.setattr(cpu_kernels, "check", counted)
    return calls


def _client_host(cfg: object, ids: list[int]) -> ClientHost:
    opts = ClientOptions(broker=BrokerOptions("127.0.0.1", 1), run_id="t")
    return ClientHost(cfg, ids, opts, lambda cid: (None, None))  # type: ignore[arg-type]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_each_shell_applies_the_run_settings_once(
    tmp_path: Path, settings_applied: list[int], precision: str
) -> None:
    """A simulator build, an MQTT server and an MQTT client process each apply the run's torch
    settings exactly once (they set process-wide torch flags; the simulator's build used to apply
    them four times)."""
    cfg = load_config(write_config(tmp_path / "cfg.yaml"), {"run": {"precision": precision}})
    built = api.build(cfg)
    assert len(settings_applied) == 1
    assert built.plan is not None and built.plan.autocast_dtype == (
        torch.bfloat16 if precision == "bf16" else None
    )
    Server(cfg, ServeOptions(BrokerOptions("127.0.0.1", 1), run_id="t"))
    assert len(settings_applied) == 2
    _client_host(cfg, [0, 5])
    assert len(settings_applied) == 3


def test_a_client_process_gathers_only_its_own_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An MQTT client process holds its clients' rows alone, the simulator's rows to the bit; no
    gather of the whole population happens (it used to build every client's data)."""
    cfg = load_config(write_config(tmp_path / "cfg.yaml"))
    want = build_population(cfg)

    def no_gather(self: Shards) -> None:
        raise AssertionError("a client process gathered the whole population")

    taken: list[int] = []
    client = Shards.client

    def counted(self: Shards, cid: int) -> object:
        taken.append(cid)
        return client(self, cid)

    monkeypatch.setattr(Shards, "gather", no_gather)
    monkeypatch.setattr(Shards, "client", counted)
    host = _client_host(cfg, [3, 17])
    assert sorted(taken) == [3, 17]
    for cid in (3, 17):
        data = host.devices[cid].data
        assert torch.equal(data.x, want.client_data[cid].x) and torch.equal(data.y, want.client_data[cid].y)
        assert data.x.untyped_storage().nbytes() == data.x.numel() * 4  # no view of a larger tensor


def test_the_server_gathers_no_client_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server reads the partition's sizes from the plan's indices: no client's samples move."""
    cfg = load_config(write_config(tmp_path / "cfg.yaml"))

    def no_samples(self: Shards, *args: object) -> None:
        raise AssertionError("the server gathered client data")

    monkeypatch.setattr(Shards, "gather", no_samples)
    monkeypatch.setattr(Shards, "client", no_samples)
    server = Server(cfg, ServeOptions(BrokerOptions("127.0.0.1", 1), run_id="t"))
    monkeypatch.undo()
    assert server.partition_sizes == [len(d) for d in build_population(cfg).client_data]


def test_the_plans_shards_and_counts_are_the_gathered_populations(tmp_path: Path) -> None:
    cfg = load_config(write_config(tmp_path / "cfg.yaml"))
    plan = plan_run(cfg)
    pop = build_population(cfg)
    assert plan.sizes == [len(d) for d in pop.client_data]
    assert np.array_equal(plan.class_counts(), pop.class_counts())
    assert torch.equal(plan.client_data(7).x, pop.client_data[7].x)
    gathered = plan.gathered()
    assert plan.gathered() is gathered and plan.client_data(7) is gathered.client_data[7]


def test_one_test_pass_feeds_accuracy_per_class_and_per_client_measures(tmp_path: Path) -> None:
    """Accuracy, the per-class figures of a stream and the per-client confusion matrix of one
    model come from one forward pass; a new model costs one more; the figures are those of a pass
    of their own."""
    cfg = load_config(write_config(tmp_path / "cfg.yaml"))
    plan = plan_run(cfg)
    tp = plan.test_pass
    assert tp is not None
    w = plan.initial_weights
    counts = plan.class_counts()
    setup = PerClientSetup(counts, np.linspace(0.1, 1.0, len(counts)), np.arange(2))
    per_client = make_per_client_eval(tp, setup)
    acc, loss = tp.accuracy_loss(w)
    per_acc, _ = tp.per_class(w)
    measures = per_client(w)
    assert tp.passes == 1
    assert measures["global_acc"] == pytest.approx(acc)
    n = np.bincount(plan.test.y.numpy(), minlength=plan.num_classes)  # type: ignore[union-attr]
    assert float(np.nansum(per_acc * n) / n.sum()) == pytest.approx(acc)
    moved = w + np.float32(0.05)
    fresh = TestPass(plan.model, plan.test, "cpu")  # type: ignore[arg-type]
    assert tp.accuracy_loss(moved) == fresh.accuracy_loss(moved) and tp.passes == 2
    assert tp.accuracy_loss(w) == (acc, loss) and tp.passes == 3


def test_a_simulated_run_passes_over_the_test_set_once_per_evaluation(tmp_path: Path) -> None:
    """With the per-client measure on, the final model's measures read the logits of its last
    evaluation: passes == evaluations."""
    cfg = load_config(
        write_config(tmp_path / "cfg.yaml", run={"per_client_eval": True, "max_aggregations": 3})
    )
    res = api.run(cfg)
    plan = res.built.plan
    assert plan is not None and plan.test_pass is not None
    assert "per_client" in res.summary
    assert plan.test_pass.passes == res.summary["evaluations"] == 4


def test_a_client_process_reads_only_its_rows_of_fashion_mnist(tmp_path: Path) -> None:
    """Where the dataset can (Fashion-MNIST's idx files), a client process reads its own rows
    alone, without the test set: the same samples, to the bit, as the simulator's client, and the
    same initial model."""
    from felix.scenario.datasets import LazyDataset

    root = fashion_like_idx(tmp_path / "fmnist")  # the suite needs no system dataset
    sets = {
        "model_params": {"hidden": 6},
        "dataset": {"name": "fashion_mnist", "root": str(root), "per_class_limit": 300, "num_classes": 8},
        "partition": {"kind": "dirichlet", "num_clients": 50, "alpha": 0.5},
    }
    cfg = load_config(write_config(tmp_path / "cfg.yaml"), sets)
    client = plan_run(cfg, shards_only=True)
    assert isinstance(client.train, LazyDataset) and client.test is None
    whole = plan_run(cfg)
    assert client.sizes == whole.sizes and np.array_equal(client.class_counts(), whole.class_counts())
    assert np.array_equal(client.initial_weights, whole.initial_weights)
    for cid in (0, 31, 49):
        mine, theirs = client.client_data(cid), whole.gathered().client_data[cid]
        assert torch.equal(mine.x, theirs.x) and torch.equal(mine.y, theirs.y)
