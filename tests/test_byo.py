"""Bring your own model and data (issue 9, deliverable 8): a model, a dataset, a partitioner and a
trace defined in this file run through the config (import paths ``test_byo:...``) and through the
Python API (felix.api); BatchNorm buffers are aggregated or kept per client, without leaking."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from felix import api
from felix.client.trainer import ClientData, LocalTrainer, TrainConfig
from felix.client.weights import BUFFERS_KEY, ModelWeights
from felix.config import ConfigError
from felix.engine.components import make_evaluator
from felix.engine.setup import resolve_config
from felix.scenario.datasets import ArrayDataset, DatasetError
from felix.scenario.models import MODELS, make_model
from felix.scenario.traces import AvailabilityTrace, always_available, slotted_churn
from felix.sim.run import run_config
from felix.strategies.objectives import make_objective

# The import paths below name this module: make it importable whatever pytest's import mode.
sys.path.insert(0, str(Path(__file__).parent))

NUM_CLASSES = 3
SHAPE = (6,)


# ---------------------------------------------------------------------- the user's own parts
class BNNet(nn.Module):
    """A small net with BatchNorm: parameters plus running statistics and a batch counter."""

    def __init__(self, in_features: int, num_classes: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(in_features, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.out = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.fc(x.flatten(1)))))


def bn_net(sample_shape: tuple[int, ...], num_classes: int, hidden: int = 8) -> nn.Module:
    return BNNet(int(np.prod(sample_shape)), num_classes, hidden)


def not_a_model(sample_shape: tuple[int, ...], num_classes: int, **params: object) -> object:
    return "a string"


def _blobs(n: int, seed: int) -> ArrayDataset:
    """Three Gaussian blobs far apart, offset from zero so BatchNorm statistics are not trivial."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % NUM_CLASSES
    centres = 4.0 * torch.eye(NUM_CLASSES, SHAPE[0]) + 2.0
    x = centres[y] + 0.5 * torch.randn(n, *SHAPE, generator=g)
    return ArrayDataset(x, y.to(torch.int64), ["a", "b", "c"])


def blobs(root: str | None, download: bool, n: int = 120) -> tuple[ArrayDataset, ArrayDataset]:
    return _blobs(n, 0), _blobs(60, 1)


def blobs_in_float64(root: str | None, download: bool) -> tuple[ArrayDataset, ArrayDataset]:
    train, test = blobs(root, download)
    return ArrayDataset(train.x.double(), train.y, train.classes), test


def blobs_without_test(root: str | None, download: bool) -> tuple[ArrayDataset, None]:
    return _blobs(60, 0), None


def shards(labels: np.ndarray, num_classes: int, cfg, rng: np.random.Generator) -> list[np.ndarray]:
    """Label-sorted shards, two per client."""
    order = np.argsort(labels, kind="stable")
    pieces = np.array_split(order, 2 * cfg.num_clients)
    perm = rng.permutation(len(pieces))
    return [
        np.sort(np.concatenate([pieces[perm[2 * k]], pieces[perm[2 * k + 1]]]))
        for k in range(cfg.num_clients)
    ]


def too_few_parts(labels: np.ndarray, num_classes: int, cfg, rng: np.random.Generator) -> list[np.ndarray]:
    return [np.arange(len(labels))]


def churn(
    cfg,
    num_clients: int,
    rng: np.random.Generator,
    fraction: float = 0.2,
    class_counts: np.ndarray | None = None,
) -> AvailabilityTrace:
    """Slotted churn; the clients' class counts arrive because the signature asks for them."""
    assert class_counts is not None and class_counts.shape == (num_clients, NUM_CLASSES)
    return slotted_churn(num_clients, fraction, rng, slot_s=300.0, horizon_s=3000.0)


def not_a_trace(cfg, num_clients: int, rng: np.random.Generator) -> list:
    return [1.0]


def BYO_SETS(**extra: object) -> dict:
    sets = {
        "model": "test_byo:bn_net",
        "model_params": {"hidden": 8},
        "dataset": {"name": "test_byo:blobs", "params": {"n": 120}},
        "partition": {"kind": "test_byo:shards", "num_clients": 6},
        "trace": {"kind": "test_byo:churn", "params": {"fraction": 0.2}},
        "orchestrator": {"concurrency": 4, "agg_goal": 2},
        "client": {"batch_size": 8, "lr": 0.1},
        "run": {"max_aggregations": 6, "stop_at_target": False},
    }
    for key, value in extra.items():
        sets[key] = {**sets.get(key, {}), **value} if isinstance(value, dict) else value  # type: ignore[dict-item]
    return sets


# ---------------------------------------------------------------------- through the config
def test_import_paths_run_through_the_config():
    cfg = resolve_config(None, "fedbuff", BYO_SETS())
    res = run_config(cfg, None, plots=False)
    pop = res.built.population
    assert isinstance(pop.model, BNNet) and len(pop.client_data) == 6
    assert sum(len(d) for d in pop.client_data) == 120
    assert res.built.trace.source.startswith("slotted(0.2)")
    w = ModelWeights(pop.model, "aggregate")
    assert pop.initial_weights.size == w.size > w.num_params  # running mean and variance travel
    assert res.summary["aggregations"] == 6
    assert res.summary["final_accuracy"] > 0.6  # the blobs are separable: it learned
    again = run_config(resolve_config(None, "fedbuff", BYO_SETS()), None, plots=False)
    assert again.summary["final_accuracy"] == res.summary["final_accuracy"]  # one seed, one run


def test_yaml_file_with_import_paths(tmp_path):
    f = tmp_path / "byo.yaml"
    f.write_text(
        "model: test_byo:bn_net\ndataset: {name: test_byo:blobs}\npartition: {kind: iid, num_clients: 4}\n"
        "run: {max_aggregations: 2}\norchestrator: {concurrency: 2, agg_goal: 2}\n"
    )
    res = api.run(f)
    assert res.summary["aggregations"] == 2 and isinstance(res.built.population.model, BNNet)


@pytest.mark.parametrize(
    ("sets", "expect"),
    [
        (
            {"model": "resnet9000"},
            "unknown model 'resnet9000'; registered: felix_cnn, kws_cnn, mlp, resnet34_1d, small_cnn",
        ),
        ({"model": "no_such_pkg.nets:make"}, "cannot import module 'no_such_pkg.nets'"),
        ({"model": "test_byo:nothing_here"}, "module 'test_byo' has no attribute 'nothing_here'"),
        ({"model": "test_byo:NUM_CLASSES"}, "is a int, not callable"),
        (
            {"dataset": {"name": "mnist9"}},
            "unknown dataset 'mnist9'; registered: cifar10, digits, fashion_mnist, fsdd, speech_commands",
        ),
        (
            {"partition": {"kind": "pathological"}},
            "unknown partitioner 'pathological'; registered: dirichlet, iid, rare_clients, speaker, table",
        ),
        ({"trace": {"kind": "weekly"}}, "unknown trace 'weekly'; registered: always,"),
    ],
)
def test_bad_names_and_paths_are_config_errors(sets, expect):
    with pytest.raises(ConfigError) as err:
        resolve_config(None, None, sets)
    assert expect in str(err.value)
    assert "expected" in str(err.value) or "registered" in str(err.value)


@pytest.mark.parametrize(
    ("sets", "expect"),
    [
        (
            {"model": "test_byo:not_a_model"},
            "returned a str, not a torch.nn.Module; expected a model factory",
        ),
        (
            {"partition": {"kind": "test_byo:too_few_parts"}},
            "returned 1 parts for 6 clients; expected a partitioner",
        ),
        (
            {"trace": {"kind": "test_byo:not_a_trace", "params": {}}},
            "returned a list, not a felix.scenario.traces.AvailabilityTrace",
        ),
    ],
)
def test_entries_that_return_the_wrong_thing(sets, expect):
    cfg = resolve_config(None, None, BYO_SETS(**sets))
    with pytest.raises(ConfigError) as err:
        api.build(cfg)
    assert expect in str(err.value)


@pytest.mark.parametrize(
    ("sets", "expect"),
    [
        ({"model_params": {"depth": 3}}, "model_params.depth: unknown key"),
        (
            {"trace": {"kind": "test_byo:churn", "params": {"fracton": 0.2}}},
            "trace.params.fracton: unknown key (did you mean `fraction`?)",
        ),
        (
            {"dataset": {"name": "test_byo:blobs", "params": {"nn": 120}}},
            "dataset.params.nn: unknown key (did you mean `n`?)",
        ),
    ],
)
def test_a_misspelt_parameter_of_an_imported_part_fails_when_the_config_is_read(sets, expect):
    """The keys an imported callable takes come from its signature: a misspelt one is a config
    error in one line naming it, before anything is built."""
    with pytest.raises(ConfigError) as err:
        resolve_config(None, None, BYO_SETS(**sets))
    assert str(err.value).endswith(f": {expect}") and "\n" not in str(err.value)


def test_a_loader_returning_float64_samples_is_refused():
    with pytest.raises(DatasetError, match="train set: x must be a float32 tensor"):
        api.build(
            resolve_config(None, None, BYO_SETS(dataset={"name": "test_byo:blobs_in_float64", "params": {}}))
        )


def test_a_dataset_without_a_test_set_needs_eval_every_0():
    sets = BYO_SETS(dataset={"name": "test_byo:blobs_without_test", "params": {}})
    with pytest.raises(ConfigError, match="no test set, but run.eval_every is 1"):
        api.build(resolve_config(None, None, sets))
    with pytest.raises(ConfigError, match="no test set"):
        make_evaluator(None)(np.zeros(3, dtype=np.float32))


def test_the_shared_setup_imports_no_shell_and_the_deployment_not_the_simulator():
    code = (
        "import sys, felix.engine.setup, felix.engine.components, felix.scenario.build\n"
        "shells = sorted(m for m in sys.modules if m.startswith(('felix.sim', 'felix.deploy')))\n"
        "assert not shells, shells\n"
        "import felix.deploy.server, felix.deploy.client\n"
        "sim = sorted(m for m in sys.modules if m.startswith('felix.sim'))\n"
        "assert not sim, sim\n"
    )
    src = str(Path(__file__).parents[1] / "src")
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr


# ---------------------------------------------------------------------- through the Python API
def _arrays(
    seed: int, clients: int = 5
) -> tuple[list[tuple[np.ndarray, np.ndarray]], tuple[np.ndarray, np.ndarray]]:
    d = _blobs(30 * clients, seed)
    x, y = d.x.numpy(), d.y.numpy()
    parts = [(x[k::clients], y[k::clients]) for k in range(clients)]
    t = _blobs(60, seed + 100)
    return parts, (t.x.numpy(), t.y.numpy())


def test_python_api_runs_a_prepared_population_with_a_model_factory(tmp_path):
    parts, test = _arrays(3)
    data = api.population(parts, test=test)
    res = api.run(
        {
            "strategy": "fedavg",
            "orchestrator": {"agg_goal": 3, "overcommit": 1.0},
            "client": {"batch_size": 10},
            "run": {"max_aggregations": 4, "stop_at_target": False},
        },
        population=data,
        model=bn_net,
        trace=always_available(),
        out_dir=tmp_path / "run",
    )
    assert res.built.cfg.partition.num_clients == 5 and res.summary["num_clients"] == 5
    assert res.built.population.client_data[0] is data.clients[0]
    assert res.summary["aggregations"] == 4 and res.summary["final_accuracy"] > 0.6
    assert '"num_clients": 5' in (tmp_path / "run" / "config.json").read_text()
    # The same from a module instance: its weights are the initial ones.
    net = bn_net(SHAPE, NUM_CLASSES)
    built = api.build({"run": {"max_aggregations": 2}}, population=data, model=net)
    assert np.array_equal(built.population.initial_weights, ModelWeights(net, "aggregate").numpy())
    assert built.sim.run().stop_reason == "max_aggregations"
    # A built Population (model included) is accepted as is; a second model is refused.
    again = api.build({"run": {"max_aggregations": 1}}, population=built.population)
    assert again.population is built.population and again.cfg.partition.num_clients == 5
    with pytest.raises(ConfigError, match="not with a built Population"):
        api.build({}, population=built.population, model=bn_net)


def test_a_prepared_population_is_held_once():
    """Per-client arrays are gathered into one pool once, each client a row slice of it, which the
    run takes as its training set and the cohorts' data pool adopts (no second copy); clients
    that are already row slices of one tensor are not copied at all."""
    parts, test = _arrays(4)
    data = api.population(parts, test=test)
    built = api.build({"run": {"max_aggregations": 1}}, population=data, model=bn_net)
    pool = built.population.train.x
    assert all(d.x._base is pool._base for d in built.population.client_data)
    assert pool.untyped_storage().data_ptr() == data.clients[0].x.untyped_storage().data_ptr()
    assert torch.equal(pool, torch.cat([torch.as_tensor(x) for x, _ in parts]))
    # Row slices of one client-ordered tensor: taken as they are.
    xs = torch.as_tensor(np.concatenate([x for x, _ in parts]))
    ys = torch.as_tensor(np.concatenate([y for _, y in parts]))
    ends = np.cumsum([len(y) for _, y in parts]).tolist()
    slices = [(xs[a:b], ys[a:b]) for a, b in zip([0, *ends[:-1]], ends, strict=True)]
    again = api.build(
        {"run": {"max_aggregations": 1}}, population=api.population(slices, test=test), model=bn_net
    )
    assert again.population.train.x.data_ptr() == xs.data_ptr()
    assert again.population.client_data[2].x.data_ptr() == slices[2][0].data_ptr()
    # Out of order, the clients are gathered (a run's clients must be consecutive rows).
    shuffled = api.population([slices[1], slices[0]], test=test)
    assert shuffled.clients[0].x.data_ptr() != slices[1][0].data_ptr()
    assert torch.equal(shuffled.clients[0].x, slices[1][0])


def test_python_api_rejects_bad_populations():
    parts, test = _arrays(3)
    with pytest.raises(DatasetError, match="client 1: samples of shape"):
        api.population([parts[0], (parts[1][0][:, :3], parts[1][1])], test)
    with pytest.raises(DatasetError, match="labels must be integers"):
        api.population([(parts[0][0], parts[0][1].astype(np.float32))])
    with pytest.raises(DatasetError, match=r"labels span \[0, 2\] but there are 2 classes"):
        api.population(parts, test, classes=2)
    with pytest.raises(ConfigError, match="no test set"):
        api.build({}, population=api.population(parts), model=bn_net)


def test_python_api_rejects_what_could_only_train_in_vain():
    """NaN samples or weights make every update refused, a model with the wrong number of outputs
    trains silently with classes the data never has: each is an error at build. The check runs the
    model once in eval mode, so its BatchNorm statistics and each module's mode stay as they were."""
    parts, test = _arrays(3)
    bad_x = parts[1][0].copy()
    bad_x[0, 0] = np.nan
    with pytest.raises(DatasetError, match="client 1: x holds NaN or infinite values"):
        api.population([parts[0], (bad_x, parts[1][1])], test)
    data = api.population(parts, test)
    with pytest.raises(ConfigError, match=r"maps inputs of shape \(2, 6\) to \(2, 5\), not \(2, 3\) logits"):
        api.build({}, population=data, model=lambda shape, classes: bn_net(shape, 5))
    with pytest.raises(ConfigError, match=r"fails on inputs of shape \(2, 6\)"):
        api.build({}, population=data, model=lambda shape, classes: nn.Linear(7, classes))
    nan_net = bn_net(SHAPE, 3)
    with torch.no_grad():
        next(nan_net.parameters())[0, 0] = float("inf")
    with pytest.raises(ConfigError, match="'BNNet' starts from weights that hold NaN or infinite values"):
        api.build({}, population=data, model=nan_net)
    with pytest.raises(ConfigError, match="trace must be a felix AvailabilityTrace, not str"):
        api.build({}, population=data, model=bn_net, trace="always")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="a config is a Config, a mapping of sections"):
        api.build(5, population=data, model=bn_net)  # type: ignore[arg-type]
    frozen = bn_net(SHAPE, 3)
    frozen.train()
    bn = next(m for m in frozen.modules() if isinstance(m, nn.BatchNorm1d))
    bn.eval()  # a user's frozen statistics
    stats = {k: v.clone() for k, v in frozen.state_dict().items()}
    built = api.build({}, population=data, model=frozen)
    assert frozen.training and not bn.training
    assert all(torch.equal(v, frozen.state_dict()[k]) for k, v in stats.items())
    assert (
        built.population.model.training
        and not next(m for m in built.population.model.modules() if isinstance(m, nn.BatchNorm1d)).training
    )


def test_registered_model_by_name_in_process():
    @MODELS.register("test_byo_tiny")
    def tiny(sample_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(sample_shape)), num_classes))

    cfg = api.config(
        {
            "model": "test_byo_tiny",
            "dataset": {"name": "test_byo:blobs"},
            "partition": {"num_clients": 3},
            "run": {"max_aggregations": 1},
            "orchestrator": {"concurrency": 2, "agg_goal": 1},
        }
    )
    assert api.run(cfg).summary["aggregations"] == 1
    with pytest.raises(ValueError, match="already registered"):
        MODELS.register("test_byo_tiny")(bn_net)


# ---------------------------------------------------------------------- BatchNorm buffers
def _trainer(model: nn.Module, buffers: str) -> LocalTrainer:
    return LocalTrainer(
        copy.deepcopy(model),
        make_objective("ce"),
        TrainConfig(lr=0.1, batch_size=8, buffers=buffers),
        NUM_CLASSES,
    )


def _client(shift: float, seed: int) -> ClientData:
    d = _blobs(24, seed)
    return ClientData(d.x + shift, d.y)


@pytest.mark.parametrize("mode", ["aggregate", "local"])
def test_no_buffer_leaks_between_clients(mode):
    model = make_model(bn_net, SHAPE, NUM_CLASSES, seed=0)
    w0 = ModelWeights(model, mode).numpy()
    a, b = _client(+5.0, 1), _client(-3.0, 2)
    shared = _trainer(model, mode)
    shared.train(w0, a, {}, {}, torch.Generator().manual_seed(1))
    after_a = shared.train(w0, b, {}, {}, torch.Generator().manual_seed(2))
    alone = _trainer(model, mode)
    fresh = alone.train(w0, b, {}, {}, torch.Generator().manual_seed(2))
    # Client a's statistics reach neither b's update nor b's statistics (BatchNorm normalises with
    # batch statistics in training, so only the buffers themselves would show a leak).
    assert np.array_equal(after_a.delta, fresh.delta)
    for leaked, clean in zip(shared.model.buffers(), alone.model.buffers()):
        assert torch.equal(leaked, clean)


def test_aggregate_ships_float_buffers_and_resets_counters():
    model = make_model(bn_net, SHAPE, NUM_CLASSES, seed=0)
    w = ModelWeights(model, "aggregate")
    assert w.size == w.num_params + 2 * 8  # running_mean, running_var; num_batches_tracked stays
    t = _trainer(model, "aggregate")
    state: dict = {}
    upd = t.train(w.numpy(), _client(5.0, 1), state, {}, torch.Generator().manual_seed(1))
    assert upd.delta.shape == (w.size,) and np.abs(upd.delta[w.num_params :]).max() > 0.1
    assert BUFFERS_KEY not in state
    t.train(w.numpy(), _client(5.0, 1), state, {}, torch.Generator().manual_seed(1))
    assert int(t.model.bn.num_batches_tracked) == 3  # 24 samples / 8: counted from 0 again


def test_aggregate_mode_moves_the_servers_buffers():
    cfg = resolve_config(None, "fedbuff", BYO_SETS(run={"max_aggregations": 2}))
    built = api.build(cfg)
    w = ModelWeights(built.population.model, "aggregate")
    start = built.orch.weights[w.num_params :].copy()
    assert np.allclose(start[:8], 0.0) and np.allclose(start[8:], 1.0)  # BatchNorm's initial mean / var
    built.sim.run()
    theta = built.orch.weights
    assert np.abs(theta[w.num_params : w.num_params + 8]).max() > 0.1  # the clients' averaged running means
    # the global model is evaluated with those statistics
    assert built.recorder.rows[-1].accuracy > 0.6


def test_local_mode_keeps_each_clients_buffers():
    model = make_model(bn_net, SHAPE, NUM_CLASSES, seed=0)
    w = ModelWeights(model, "local")
    assert w.size == w.num_params  # only parameters travel
    t = _trainer(model, "local")
    a_state: dict = {}
    t.train(w.numpy(), _client(5.0, 1), a_state, {}, torch.Generator().manual_seed(1))
    saved = a_state[BUFFERS_KEY]
    assert (
        len(saved) == 3 and np.abs(saved[0]).max() > 0.1 and int(saved[2]) == 3
    )  # a's statistics, 3 batches
    t.train(w.numpy(), _client(-3.0, 2), {}, {}, torch.Generator().manual_seed(2))
    # a's next task starts from a's buffers, not from b's (nor the factory's)
    t.weights.begin_task(a_state)
    assert np.array_equal(t.model.bn.running_mean.numpy(), saved[0])
    assert int(t.model.bn.num_batches_tracked) == int(saved[2])


def test_local_mode_runs_and_evaluates_with_the_factorys_buffers():
    cfg = resolve_config(None, "fedbuff", BYO_SETS(client={"buffers": "local"}, run={"max_aggregations": 2}))
    built = api.build(cfg)
    w = ModelWeights(built.population.model, "local")
    assert built.population.initial_weights.size == w.num_params
    assert built.sim.run().stop_reason == "max_aggregations"
    states = [d.state for d in built.sim.devices if d.state]
    assert states and all(BUFFERS_KEY in s for s in states)
    # the evaluator's model keeps BatchNorm's initial statistics
    net = copy.deepcopy(built.population.model)
    assert torch.equal(net.bn.running_var, torch.ones(8))


def test_scaffold_with_aggregated_buffers_is_refused():
    cfg = resolve_config(None, None, BYO_SETS(client={"objective": "scaffold"}))
    with pytest.raises(ConfigError, match="set client.buffers: local"):
        api.build(cfg)


def test_the_python_api_doc_example_runs(capsys):
    doc = (Path(__file__).parents[1] / "docs" / "python-api.md").read_text()
    code = re.findall(r"```python\n(.*?)```", doc, re.DOTALL)[0]
    exec(compile(code, "docs/python-api.md", "exec"), {"__name__": "doc_example"})  # noqa: S102 - our own doc
    accuracy, aggregations, clients = capsys.readouterr().out.split()
    assert float(accuracy) > 0.5 and 0 < int(aggregations) <= 30 and clients == "20"
