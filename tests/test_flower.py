"""Flower interop: a Flower ``ClientApp`` written here (Flower's quickstart-pytorch app, with
scikit-learn's digits in place of CIFAR-10) trains felix's tasks through ``felix run`` and
``felix compare`` under the slotted trace; felix-fl's Strategy runs inside Flower's
``run_simulation``; neither opens a socket beyond loopback, and Flower's telemetry is off.

Skipped without the extra: ``pip install "felix-fl[flower]"``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

flwr = pytest.importorskip("flwr", reason='needs Flower: pip install "felix-fl[flower]"')

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from felix import api
from felix.cli import main
from felix.config import ConfigError
from felix.engine.setup import resolve_config
from felix.flower import client_data
from felix.flower.helpers import apply_plan, class_counts_reply, load_arrays, local_train, objective
from felix.sim.run import run_config
from felix.strategies.aggregation.tierfuse import TierFuseAggregator

pytestmark = pytest.mark.flower

# The import paths below (test_flower:app, test_flower:make_net) name this module.
sys.path.insert(0, str(Path(__file__).parent))

#: Every address this process connects or binds a socket to (an audit hook cannot be removed:
#: one for the module, its list cleared by the tests that read it).
SOCKETS: list[Any] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event in ("socket.connect", "socket.bind"):
        SOCKETS.append(args[1])


sys.addaudithook(_audit)


def _non_loopback() -> list[Any]:
    hosts = [a for a in SOCKETS if isinstance(a, tuple) and a and isinstance(a[0], str)]
    return [a for a in hosts if a[0] not in ("127.0.0.1", "::1", "localhost")]


# ------------------------------------------------- the user's Flower app (quickstart-pytorch, digits)
class Net(nn.Module):
    """The quickstart's CNN, sized for 8x8 digits."""

    def __init__(self, in_shape: tuple[int, ...] = (1, 8, 8), num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_shape[0], 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * (in_shape[1] // 4) * (in_shape[2] // 4), 32)
        self.fc2 = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def make_net(sample_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """felix's ``model`` for these runs: the app's own network."""
    return Net(tuple(sample_shape), num_classes)


def load_partition(context: Context) -> tuple[torch.Tensor, torch.Tensor]:
    """The client's partition: felix's data for this client when felix drives the app, else (under
    Flower's runtime) an even split of the digits by ``partition-id``."""
    data = client_data(context)
    if data is None:
        from sklearn.datasets import load_digits

        pid, parts = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
        digits = load_digits()
        # every parts-th sample, and only one in four of classes 0-2: imbalanced classes, each
        # present on every node (DAFL then has something to balance)
        idx = [
            i for i in range(pid, len(digits.target), parts) if digits.target[i] >= 3 or (i // parts) % 4 == 0
        ]
        x_all = torch.tensor(digits.images[idx] / 16.0, dtype=torch.float32).unsqueeze(1)
        data = (x_all, torch.tensor(digits.target[idx]))
    return data


def load_data(context: Context, batch_size: int, seed: int) -> DataLoader:
    x, y = load_partition(context)
    return DataLoader(
        TensorDataset(x, y),
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )


def train_fn(net: nn.Module, loader: DataLoader, epochs: int, lr: float) -> float:
    net.train()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    total, batches = 0.0, 0
    for _ in range(epochs):
        for xb, yb in loader:
            opt.zero_grad()
            loss = F.cross_entropy(net(xb), yb)
            loss.backward()
            opt.step()
            total += float(loss.detach())
            batches += 1
    return total / max(batches, 1)


app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """The quickstart's train handler."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    config = msg.content["config"]
    loader = load_data(context, int(config["batch-size"]), int(config["seed"]))
    epochs = int(context.run_config.get("local-epochs", 1))  # a pyproject.toml setting under Flower
    train_loss = train_fn(model, loader, epochs, float(config["lr"]))
    metrics = MetricRecord({"train_loss": train_loss, "num-examples": len(loader.dataset)})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


exact = ClientApp()


@exact.train()
def train_exact(msg: Message, context: Context) -> Message:
    """felix's own local loop written as a Flower handler (batch order from the task's seed,
    per-sample losses for Oort's utility, felix's objective through the helper): the same updates
    as felix's trainer, bit for bit."""
    config = msg.content["config"]
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    data = client_data(context)
    assert data is not None
    x, y = data
    n, bs = len(y), int(config["batch-size"])
    obj = objective(msg, context, model, class_counts=torch.bincount(y, minlength=int(config["num-classes"])))
    opt = torch.optim.SGD(model.parameters(), lr=float(config["lr"]))
    gen = torch.Generator().manual_seed(int(config["seed"]))
    sq_sum, loss_sum, seen, batches = 0.0, 0.0, 0, 0
    stop = n - n % bs if config["drop-last"] else n
    model.train()
    for epoch in range(int(config["local-epochs"])):
        order = torch.randperm(n, generator=gen)
        for start in range(0, stop, bs):
            idx = order[start : start + bs]
            logits = model(x[idx])
            if epoch == 0:
                per = F.cross_entropy(logits.detach(), y[idx], reduction="none")
                sq_sum += float(per.square().sum())
                seen += len(idx)
            loss = obj.loss(logits, y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            obj.before_step()
            opt.step()
            obj.after_step()
            loss_sum += float(loss.detach())
            batches += 1
    metrics = MetricRecord(
        {
            "num-examples": n,
            "train_loss": loss_sum / max(batches, 1),
            "stat-utility": n * (sq_sum / seen) ** 0.5 if seen else 0.0,
        }
    )
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    obj.finish(content)
    return Message(content, reply_to=msg)


lean = ClientApp()
#: The network ``lean``'s handler keeps between messages ("net", made by "make" on its first).
LEAN: dict[str, Any] = {"make": Net, "net": None}


@lean.train()
def train_lean(msg: Message, context: Context) -> Message:
    """The handler felix's helpers make: one network kept between messages, the message's model
    copied into it and felix's own local loop run on it (``local_train``)."""
    if LEAN["net"] is None:
        LEAN["net"] = LEAN["make"]()
    return Message(local_train(msg, context, LEAN["net"]), reply_to=msg)


helped = ClientApp()


@helped.query("felix_counts")
def counts(msg: Message, context: Context) -> Message:
    """Answers FelixStrategy's DAFL count query."""
    return class_counts_reply(msg, load_partition(context)[1], 10)


@helped.train()
def train_helped(msg: Message, context: Context) -> Message:
    """The quickstart handler with felix's helpers: the DAFL row applied to the data, the
    objective (FedeRage, named in the config) applied to the loop."""
    config = msg.content["config"]
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = apply_plan(msg, context, *load_partition(context))
    obj = objective(msg, context, model, num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=float(config["lr"]))
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    total = 0.0
    for xb, yb in loader:
        loss = obj.loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        obj.before_step()
        opt.step()
        obj.after_step()
        total += float(loss.detach())
    metrics = MetricRecord({"train_loss": total / len(loader), "num-examples": len(y)})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    obj.finish(content)
    return Message(content, reply_to=msg)


own_data = ClientApp()
#: How many tasks ``own_data``'s handler ran.
OWN_CALLS = [0]


@own_data.train()
def train_own_data(msg: Message, context: Context) -> Message:
    """Flower's quickstart-pytorch handler as written for Flower's runtime: it loads its own
    partition (``load_data(partition_id, num_partitions)``: here an even split of a small
    synthetic set), never felix's."""
    OWN_CALLS[0] += 1
    pid, parts = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    gen = torch.Generator().manual_seed(0)
    x_all, y_all = torch.randn(600, 1, 8, 8, generator=gen), torch.randint(0, 10, (600,), generator=gen)
    x, y = x_all[pid::parts], y_all[pid::parts]
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    config = msg.content["config"]
    loader = DataLoader(TensorDataset(x, y), batch_size=int(config["batch-size"]), shuffle=True)
    train_loss = train_fn(model, loader, 1, float(config["lr"]))
    metrics = MetricRecord({"train_loss": train_loss, "num-examples": len(loader.dataset)})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


broken = ClientApp()


@broken.train()
def train_broken(msg: Message, context: Context) -> Message:
    raise RuntimeError("out of cheese")


not_an_app = "a string"

# ----------------------------------------------------------------------------- the runs
SMALL = {
    "model": "test_flower:make_net",
    "partition": {"num_clients": 20},
    "trace": {"kind": "slotted", "unavailable_fraction": 0.3, "slot_s": 60.0},
    "orchestrator": {"agg_goal": 4, "concurrency": 6},
    "run": {"max_aggregations": 12, "stop_at_target": False, "cohort": 1},
}


def test_flower_app_runs_through_felix_run_under_churn(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "run"
    SOCKETS.clear()
    rc = main(
        [
            "run",
            "--flower-app",
            "test_flower:app",
            "--preset",
            "fedbuff",
            "-q",
            "--out",
            str(out),
            *[f"--set={k}" for k in _sets(SMALL)],
            # the buffer's sum of weights (FedScale's reading), whose step learns within 12
            # aggregations of 4 updates; published FedBuff's division by K takes about twice as many
            "--set=aggregator.normalize=weights",
        ]
    )
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["aggregations"] == 12
    rows = (out / "evaluations.csv").read_text().splitlines()
    first = float(rows[1].split(",")[2])
    assert summary["final_accuracy"] > first + 0.05  # it learns
    assert len(rows) == 14  # the header, the initial model and one row per aggregation
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["client"]["flower_app"] == "test_flower:app"
    assert not _non_loopback(), _non_loopback()  # the app ran in process: no network at all


def test_flower_app_in_felix_compare(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "cmp"
    sets = _sets({**SMALL, "run": {**SMALL["run"], "max_aggregations": 6}})
    rc = main(
        [
            "compare",
            "--flower-app",
            "test_flower:app",
            "--strategies",
            "fedbuff,felix",
            "--out",
            str(out),
            *[f"--set={k}" for k in sets],
        ]
    )
    assert rc == 0
    doc = json.loads((out / "comparison.json").read_text())
    assert set(doc["strategies"]) == {"fedbuff", "felix"}
    assert all(s["aggregations"] == 6 for s in doc["strategies"].values())
    assert "fedbuff" in (out / "comparison.md").read_text()


@pytest.mark.parametrize("app", ["exact", "lean"])
@pytest.mark.parametrize(
    "client",
    [{}, {"objective": "federage", "objective_params": {"alpha": 0.2, "gamma": 0.5}}],
    ids=["ce", "federage"],
)
def test_a_flower_app_of_felix_loop_gives_felix_trainer_run_exactly(client: dict[str, Any], app: str) -> None:
    """Everything downstream of the trainer is felix's: an app that computes felix's updates (its
    own loop with the objective helper, or felix's through ``local_train``) gives the run felix's
    own trainer gives (one client at a time, as the Flower path trains), FedeRage included (its
    beta averaged by the server and sent back)."""
    LEAN.update(make=Net, net=None)
    over = {**SMALL, "client": client, "run": {**SMALL["run"], "max_aggregations": 6}}
    own = run_config(resolve_config(None, "felix", over), None, plots=False)
    app_client = {**client, "flower_app": f"test_flower:{app}"}
    via = api.run({**over, "strategy": "felix", "client": app_client})  # the Python API's way in
    if client:
        assert "federage_beta" in via.built.orch.aux
    assert [(r.version, r.time_s, r.accuracy, r.bytes_total) for r in via.rows] == [
        (r.version, r.time_s, r.accuracy, r.bytes_total) for r in own.rows
    ]
    assert len(own.rows) == 7


def test_bad_flower_apps_are_one_line_errors(tmp_path: Path) -> None:
    for ref, says in (
        ("test_flower:broken", "raised on client"),
        ("test_flower:not_an_app", "not a flwr ClientApp"),
        ("test_flower:nothing", "has no attribute"),
        ("no_such_module:app", "cannot import module"),
    ):
        cfg = resolve_config(None, None, {**SMALL, "client": {"flower_app": ref}})
        with pytest.raises(ConfigError, match=says) as err:
            run_config(cfg, None, plots=False)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="import path"):
        resolve_config(None, None, {"client": {"flower_app": "no-colon"}})


def test_an_app_that_loads_its_own_partition_is_refused_at_its_first_result(tmp_path: Path) -> None:
    """Flower's quickstart pattern (the handler loads its partition from ``context.node_config``)
    trains on data felix does not simulate: the run ends at the first result with one line that
    says what to change, instead of the server refusing a third of the results in silence."""
    OWN_CALLS[0] = 0
    cfg = resolve_config(None, "fedbuff", {**SMALL, "client": {"flower_app": "test_flower:own_data"}})
    with pytest.raises(
        ConfigError, match="train on felix.flower.client_data\\(context\\) in the handler"
    ) as err:
        run_config(cfg, None, plots=False)
    msg = str(err.value)
    assert "\n" not in msg and "felix.flower.client_data(context)" in msg
    assert "examples of the app's own, not on felix's" in msg
    assert OWN_CALLS[0] == 1  # the first result, before any update reaches the server


def test_the_quickstart_pattern_on_felix_data_has_no_result_refused() -> None:
    """The same pattern with ``client_data(context) or own partition`` (test_flower:app): every
    result fits the client's registered count."""
    run = api.run({**SMALL, "strategy": "fedbuff", "client": {"flower_app": "test_flower:app"}})
    stats = run.built.orch.stats
    assert stats.rejected == 0 and stats.updates_applied > 0


@pytest.mark.parametrize("app", ["app", "lean"])
def test_an_app_without_felix_model_set_says_which_option_to_set(app: str) -> None:
    """``--flower-app mod:app`` without ``--set model=mod:make_net``: felix's default model does
    not load into the app's network (torch's ``load_state_dict``, or the helpers' ``load_arrays``):
    one line naming the option."""
    LEAN.update(make=Net, net=None)
    cfg = resolve_config(
        None,
        "fedbuff",
        {**{k: v for k, v in SMALL.items() if k != "model"}, "client": {"flower_app": f"test_flower:{app}"}},
    )
    with pytest.raises(ConfigError, match="the app's network does not take felix's model 'small_cnn'") as err:
        run_config(cfg, None, plots=False)
    assert "\n" not in str(err.value)
    assert str(err.value).endswith("set model to the app's network: --set model=test_flower:make_net")
    if app == "app":  # torch's error, one line per kind of key listing each, in short
        assert "load_state_dict: 8 of its keys missing, 6 unexpected, 0 of another shape" in str(err.value)


def test_handler_errors_are_one_line_and_name_the_model_option_for_a_foreign_network() -> None:
    """A reply of another network's arrays names the model option; a multi-line exception of
    the handler is reported by its first line."""
    trainer = _hostile_trainer(BnNet())
    weights = np.zeros(trainer.layout.size, dtype=np.float32)
    with pytest.raises(ConfigError, match="--set model=test_flower:make_net$"):
        _task(trainer, weights, "missing_key")
    assert trainer._handler_error(ValueError("first\nsecond"), 3).endswith("ValueError: first ...")


def _sets(d: dict[str, Any], prefix: str = "") -> list[str]:
    out: list[str] = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += _sets(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}={json.dumps(v)}")
    return out


def test_telemetry_is_off() -> None:
    assert os.environ["FLWR_TELEMETRY_ENABLED"] == "0"


# ------------------------------------------------ felix's strategy inside Flower's simulation
ROUNDS: list[Any] = []
server = ServerApp()


@server.main()
def server_main(grid: Grid, context: Context) -> None:
    from felix.flower.strategy import FelixStrategy

    strategy = FelixStrategy(
        clients_per_round=3,
        aggregator=TierFuseAggregator(server_lr=1.0),
        data_plan="dafl",
        fraction_evaluate=0.0,
        min_available_nodes=6,  # the DAFL plan covers every node
    )
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(Net().state_dict()),
        num_rounds=3,
        train_config=ConfigRecord(
            {
                "lr": 0.1,
                "felix.objective": "federage",
                "felix.objective-params": json.dumps({"alpha": 0.2, "fixed_batch": False}),
            }
        ),
    )
    ROUNDS.append((result, strategy))


@pytest.mark.slow
def test_felix_strategy_runs_inside_flower_simulation_on_loopback_only() -> None:
    ray = pytest.importorskip("ray", reason='needs Ray: pip install "felix-fl[flower]"')
    from test_ray_backend import ConnectionWatch

    from felix.flower.strategy import run_simulation

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import tests/
    SOCKETS.clear()
    ROUNDS.clear()
    with ConnectionWatch() as watch:
        run_simulation(server, helped, num_supernodes=6, num_cpus=2)
    ((result, strategy),) = ROUNDS
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3]
    assert result.arrays is not None
    # felix's selector saw every reply: three nodes per round, their utilities measured.
    assert int(strategy.clients.column("times_selected").sum()) == 9
    assert int((strategy.clients.column("times_updated") > 0).sum()) >= 3
    # DAFL planned over the six nodes' counts; FedeRage's beta came back and was averaged.
    assert strategy.plan is not None and len(strategy.plan_rows) == 6 and strategy.plan.added > 0
    assert "federage_beta" in strategy.aux
    assert watch.seen > 0, "the watch saw no sockets"
    assert not watch.bad, "non-loopback sockets:\n" + "\n".join(watch.bad[:20])
    assert not _non_loopback(), _non_loopback()  # and none of this process's own Python-level sockets


@pytest.mark.parametrize(
    "a",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.array(2.5),
        np.zeros((0, 3), dtype=np.float64),
        np.arange(5, dtype=np.int64),
        np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3)),
    ],
    ids=["matrix", "scalar", "empty", "int64", "fortran"],
)
def test_npy_codec_is_flowers_array_byte_for_byte(a: np.ndarray) -> None:
    """The Flower path's fast arrays hold the bytes Flower's ``Array(a)`` holds, and read back
    (by felix and by ``Array.numpy()`` in the app) as Flower reads them."""
    from flwr.app import Array

    from felix.flower.trainer import NpyCodec

    codec = NpyCodec(Array)
    fast, plain = codec.encode(a), Array(np.ascontiguousarray(a) if a.ndim else a)
    assert (fast.data, fast.dtype, tuple(fast.shape)) == (plain.data, plain.dtype, tuple(plain.shape))
    fortran = [Array(np.asfortranarray(a))] if a.ndim >= 2 else []  # Flower's bytes, Fortran order
    for arr in (fast, plain, *fortran):
        assert np.array_equal(codec.decode(arr), a) and codec.decode(arr).shape == a.shape
    assert np.array_equal(fast.numpy(), a)


def test_flowers_array_records_made_in_a_handler_under_felix_are_flowers_own_bytes() -> None:
    """Inside felix's handler call Flower's ``Array.from_numpy_ndarray`` skips ``np.save``:
    every way a handler makes arrays (``ArrayRecord(state_dict)``, ``Array(ndarray)``,
    ``Array(tensor)``, ``ArrayRecord(list)``) holds the fields Flower's own gives, for C-ordered,
    Fortran-ordered, strided, 0-d, empty, integer, bool, half, big-endian and complex arrays; the
    method is Flower's again afterwards, also when the handler raises."""
    from flwr.app import Array

    from felix.flower.trainer import flower_codec

    base = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    arrays = [
        base,
        np.asfortranarray(base),
        base[:, ::2, 1:],
        base.transpose(2, 0, 1),
        np.array(2.5),
        np.zeros((0, 3)),
        np.arange(5, dtype=np.int64),
        np.array([True, False]),
        base.astype(np.float16),
        base.astype(">f4"),
        base.astype(np.complex64),
    ]
    own = Array.__dict__["from_numpy_ndarray"]
    sd = BnNet().state_dict()

    def make() -> list[Any]:
        return [
            *[Array(a) for a in arrays],
            Array(torch.arange(6.0).reshape(2, 3).t()),
            *ArrayRecord(sd).values(),
            *ArrayRecord(arrays).values(),
        ]

    theirs = make()
    with flower_codec().saving():
        assert Array.__dict__["from_numpy_ndarray"] is not own
        ours = make()
    assert Array.__dict__["from_numpy_ndarray"] is own
    fields = ("dtype", "shape", "stype", "data")
    assert len(ours) == len(theirs) == 2 * len(arrays) + 1 + len(sd)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert type(a) is type(b) is Array and [getattr(a, f) for f in fields] == [
            getattr(b, f) for f in fields
        ], i
    with pytest.raises(RuntimeError, match="out"), flower_codec().saving():
        raise RuntimeError("out")
    assert Array.__dict__["from_numpy_ndarray"] is own


# ------------------------------------------------ the Flower path's encoding and its reply checks
class BnNet(nn.Module):
    """A network with BatchNorm: float buffers (shipped under ``aggregate``) and an integer
    counter (always kept), a tied weight, for the state_dict layout."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 8 * 8, 10)
        self.head = self.fc  # the same tensors under two state_dict names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.bn(self.conv(x))).flatten(1))


def make_bn_net(sample_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    assert tuple(sample_shape) == (1, 8, 8) and num_classes == 10
    return BnNet()


#: What ``hostile``'s handler does to the reply (set by the tests).
REPLY: dict[str, Any] = {}
hostile = ClientApp()


@hostile.train()
def train_hostile(msg: Message, context: Context) -> Message | str:
    """Replies as ``REPLY["kind"]`` says: the received model plus one (``plus_one``) or a bad reply."""
    kind = REPLY["kind"]
    sd = msg.content["arrays"].to_torch_state_dict()
    sd = {k: v + 1 if v.is_floating_point() else v + 5 for k, v in sd.items()}
    key = next(iter(sd))
    data = client_data(context)  # it trains on nothing, so it counts felix's samples
    metrics = MetricRecord({"num-examples": 7 if data is None else len(data[1]), "train_loss": 0.5})
    if kind == "not_a_message":
        return "done"
    if kind == "error":
        return Message(flwr.app.Error(code=0, reason="out of memory"), reply_to=msg)
    if kind == "no_arrays":
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)
    arrays = ArrayRecord(sd)
    if kind == "nan_some":  # NaN from odd clients, the received model from the others
        kind = "nan" if int(context.node_config["partition-id"]) % 2 else "echo"
    if kind == "echo":
        arrays = msg.content["arrays"]
    elif kind == "missing_key":
        del arrays[key]
    elif kind == "shape":
        arrays[key] = flwr.app.Array(np.zeros((2, 2), dtype=np.float32))
    elif kind == "strings":
        arrays[key] = flwr.app.Array(np.full(tuple(sd[key].shape), "x"))
    elif kind == "truncated":
        good = arrays[key]
        arrays[key] = flwr.app.Array(
            dtype=good.dtype, shape=tuple(good.shape), stype=good.stype, data=good.data[:-4]
        )
    elif kind == "float64":
        arrays[key] = flwr.app.Array(sd[key].double().numpy())
    elif kind == "nan":
        arrays[key] = flwr.app.Array(np.full(tuple(sd[key].shape), np.nan, dtype=np.float32))
    return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)


def _hostile_trainer(model: nn.Module, buffers: str = "aggregate") -> Any:
    from felix.client.trainer import TrainConfig
    from felix.flower.trainer import FlowerTrainer
    from felix.strategies.objectives import make_objective

    return FlowerTrainer(
        hostile, "test_flower:hostile", model, make_objective("ce"), TrainConfig(buffers=buffers), 10, 4, {}
    )


def _task(trainer: Any, weights: np.ndarray, kind: str, state: dict[str, Any] | None = None) -> Any:
    from felix.client.trainer import ClientData
    from felix.flower.trainer import CLIENT_KEY

    REPLY["kind"] = kind
    data = ClientData(torch.zeros(7, 1, 8, 8), torch.zeros(7, dtype=torch.long))
    state = {CLIENT_KEY: 2} if state is None else state
    return trainer.train(weights, data, state, {}, torch.Generator().manual_seed(3))


@pytest.mark.parametrize("buffers", ["aggregate", "local"])
def test_the_flower_path_lays_the_vector_out_as_the_models_state_dict(buffers: str) -> None:
    """The message carries the received vector as the workspace model's state_dict (the kept
    counter at the factory's value or the client's own), byte for byte what Flower's
    ``ArrayRecord(state_dict)`` holds; the reply comes back as its difference from it (a tied
    tensor once), the kept counter into the client's state under ``local``."""
    from felix.client.weights import BUFFERS_KEY, ModelWeights

    model = BnNet()
    trainer = _hostile_trainer(model, buffers)
    layout = ModelWeights(model, buffers)
    weights = np.random.default_rng(0).standard_normal(layout.size).astype(np.float32)
    sent: list[Any] = []
    handler = hostile._registered_funcs["train.default"]

    def spy(msg: Message, context: Context) -> Message:
        sent.append(msg.content["arrays"])
        return handler(msg, context)

    hostile._registered_funcs["train.default"] = spy
    try:
        state: dict[str, Any] = {"flower_client_id": 1}
        upd = _task(trainer, weights, "plus_one", state)
        echo = _task(trainer, weights, "echo", state)
    finally:
        hostile._registered_funcs["train.default"] = handler
    reference = BnNet()
    ModelWeights(reference, buffers).load(torch.from_numpy(weights.copy()))
    expected = ArrayRecord(reference.state_dict())
    fields = ("dtype", "shape", "stype", "data")
    assert list(sent[0].keys()) == list(expected.keys())
    for k in expected:
        assert [getattr(sent[0][k], f) for f in fields] == [getattr(expected[k], f) for f in fields], k
        got = sent[0][k].numpy()
        got += 1  # a writable copy: the record's next reader still sees the sent values
        assert np.array_equal(sent[0][k].numpy(), expected[k].numpy())
    assert upd.delta.dtype == np.float32 and upd.delta.shape == weights.shape
    assert np.array_equal(upd.delta, (weights + 1) - weights)  # every shipped value, tied ones once
    assert not echo.delta.any()
    assert (upd.num_samples, upd.loss) == (7, 0.5)
    counter = int(sent[1]["bn.num_batches_tracked"].numpy())
    if buffers == "local":  # the client's buffers as its reply left them, sent with its next task
        mean, var, count = state[BUFFERS_KEY]
        assert (mean == 1).all() and (var == 2).all() and int(count) == 5 == counter
        assert np.array_equal(sent[1]["bn.running_var"].numpy(), np.full(4, 2, dtype=np.float32))
    else:  # the counter does not travel: every task starts from the factory's
        assert BUFFERS_KEY not in state and counter == 0


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("not_a_message", "is a str, not a flwr Message"),
        ("error", "is an error: out of memory"),
        ("no_arrays", "has no ArrayRecord"),
        ("missing_key", "does not fit felix's model \\(its arrays"),
        ("shape", "conv.weight: shape \\(2, 2\\), the model's \\(4, 1, 3, 3\\)"),
        ("strings", "conv.weight: dtype <U1, not a number type"),
        ("truncated", "conv.weight: its bytes are not a .npy array"),
    ],
)
def test_the_flower_path_refuses_replies_that_do_not_fit(kind: str, says: str) -> None:
    trainer = _hostile_trainer(BnNet())
    weights = np.zeros(trainer.layout.size, dtype=np.float32)
    with pytest.raises(ConfigError, match=says) as err:
        _task(trainer, weights, kind)
    assert "\n" not in str(err.value) and "client 2" in str(err.value)


def test_the_flower_path_reads_other_dtypes_and_leaves_non_finite_values_to_the_server() -> None:
    trainer = _hostile_trainer(BnNet())
    weights = np.full(trainer.layout.size, 0.1, dtype=np.float32)
    upd = _task(trainer, weights, "float64")  # cast to float32 as torch's copy_ casts it
    assert np.array_equal(upd.delta, (np.float32(0.1) + 1) - weights)
    nan = _task(trainer, weights, "nan")
    assert np.isnan(nan.delta[: 4 * 9]).all() and np.isfinite(nan.delta[4 * 9 :]).all()


def test_a_flower_app_that_sends_nan_has_its_updates_refused_by_the_server() -> None:
    """Non-finite values pass the trainer, as from felix's own, and the orchestrator's update
    validation refuses them: the run goes on with a finite model."""
    REPLY["kind"] = "nan_some"
    run = {**SMALL["run"], "max_aggregations": 2}
    via = api.run(
        {
            **SMALL,
            "model": "test_flower:make_bn_net",
            "client": {"flower_app": "test_flower:hostile"},
            "run": run,
        }
    )
    assert via.built.orch.stats.rejected > 0
    assert via.built.orch.version == 2 and np.isfinite(via.built.orch.weights).all()


def test_state_dict_record_is_flowers_array_record() -> None:
    """The helper's reply record holds plain Flower ``Array`` s with Flower's bytes (a
    non-contiguous tensor: the same values, written in C order), and felix reads it back."""
    from felix.flower.helpers import state_dict_record

    sd = {**BnNet().state_dict(), "t": torch.arange(6.0).reshape(2, 3).t(), "s": torch.tensor(3)}
    ours, flowers = state_dict_record(sd), ArrayRecord(sd)
    assert list(ours.keys()) == list(flowers.keys())
    for k, arr in ours.items():
        assert type(arr) is flwr.app.Array and np.array_equal(arr.numpy(), flowers[k].numpy())
        if k != "t":
            assert arr == flowers[k], k
    assert ours["t"].numpy().flags.c_contiguous and tuple(ours["t"].shape) == (3, 2)


# ------------------------------------------------ felix's local loop as a Flower helper
@pytest.mark.parametrize(
    ("make", "cfg", "obj", "dtype"),
    [
        (BnNet, {}, ("ce", {}), None),
        (BnNet, {"buffers": "local", "epochs": 2, "batch_size": 3}, ("ce", {}), None),
        (
            Net,
            {
                "momentum": 0.9,
                "weight_decay": 1e-3,
                "epochs": 2,
                "batch_size": 4,
                "drop_last": True,
                "max_steps": 5,
            },
            ("federage", {"alpha": 0.2, "gamma": 0.5}),
            None,
        ),
        (Net, {"optimizer": "adam", "lr": 0.01, "batch_size": 5}, ("fedprox", {"mu": 0.1}), None),
        (Net, {"probe_loss_key": "qffl_loss", "epochs": 2}, ("ce", {}), None),
        (BnNet, {"buffers": "local"}, ("federage", {"alpha": 0.2, "gamma": 0.5}), torch.bfloat16),
    ],
    ids=["bn-tied", "bn-local-buffers", "momentum-federage", "adam-fedprox", "qffl-probe-loss", "bf16"],
)
def test_local_train_gives_felix_trainers_updates_bit_for_bit(
    make: Any, cfg: dict[str, Any], obj: tuple[str, dict[str, Any]], dtype: torch.dtype | None
) -> None:
    """``local_train`` in a handler that keeps its network is felix's trainer on the same tasks:
    the same deltas, losses, utilities and aux state, bit for bit, over several clients' tasks
    (the objective's and the buffers' per-client state carried between them), with BatchNorm
    buffers, a tied weight, momentum, weight decay, Adam, drop_last, max_steps, q-FFL's loss at
    the received model (``client.probe_loss``) and bf16 autocast (``run.precision``)."""
    from felix.client.trainer import ClientData, LocalTrainer, TrainConfig
    from felix.client.weights import ModelWeights
    from felix.flower.trainer import CLIENT_KEY, FlowerTrainer
    from felix.strategies.objectives import make_objective

    torch.manual_seed(0)
    train_cfg = TrainConfig(**{"lr": 0.05, **cfg})
    objective_ = make_objective(obj[0], **obj[1])
    own = LocalTrainer(make(), objective_, train_cfg, 10, autocast_dtype=dtype)
    via = FlowerTrainer(
        lean, "test_flower:lean", make(), objective_, train_cfg, 10, 3, obj[1], autocast_dtype=dtype
    )
    LEAN.update(make=make, net=None)
    rng = np.random.default_rng(1)
    size = ModelWeights(make(), train_cfg.buffers).size
    states: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {c: ({}, {CLIENT_KEY: c}) for c in range(3)}
    for task in range(6):
        cid = task % 3
        n = 9 + 4 * cid
        data = ClientData(
            torch.from_numpy(rng.standard_normal((n, 1, 8, 8)).astype(np.float32)),
            torch.from_numpy(rng.integers(0, 10, n)),
        )
        weights = (0.1 * rng.standard_normal(size)).astype(np.float32)
        a = own.train(weights, data, states[cid][0], {}, torch.Generator().manual_seed(100 + task))
        b = via.train(weights, data, states[cid][1], {}, torch.Generator().manual_seed(100 + task))
        assert np.array_equal(a.delta, b.delta) and a.delta.any(), task
        assert (a.num_samples, a.loss, a.stat_utility) == (b.num_samples, b.loss, b.stat_utility), task
        assert sorted(a.aux) == sorted(b.aux) and all(np.array_equal(a.aux[k], b.aux[k]) for k in a.aux)
    if obj[0] == "federage":
        assert "federage_beta" in a.aux
    if train_cfg.probe_loss_key is not None:
        assert a.aux["qffl_loss"] > 0 and a.aux["qffl_loss"] != a.loss


def _train_message(config: dict[str, Any] | None, arrays: Any) -> Message:
    content = RecordDict({"arrays": arrays})
    if config is not None:
        content["config"] = ConfigRecord(config)
    meta = flwr.app.Metadata(
        run_id=1,
        message_id="m",
        src_node_id=0,
        dst_node_id=1,
        reply_to_message_id="",
        group_id="1",
        created_at=0.0,
        ttl=60.0,
        message_type="train",
    )
    return Message(content, metadata=meta)


def _context() -> Context:
    return Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})


def test_local_train_and_load_arrays_refuse_bad_input_in_one_line() -> None:
    """A message without the config entries ``local_train`` needs, without a config, with a
    precision it does not know, or with arrays that are not the model's: a one-line ``ValueError`` saying which; under felix, the
    one-line error naming the app and the client."""
    x, y = torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.long)
    arrays = ArrayRecord(Net().state_dict())
    full = {"lr": 0.1, "batch-size": 2, "local-epochs": 1, "seed": 0}
    cases = [
        (_train_message({"lr": 0.1, "batch-size": 2}, arrays), "config has no 'local-epochs', 'seed'"),
        (_train_message(None, arrays), "has no ConfigRecord 'config'"),
        (_train_message(full, ArrayRecord(BnNet().state_dict())), "are not the model's state_dict"),
        (
            _train_message({**full, "precision": "fp8"}, arrays),
            "precision 'fp8' is none of \\['bf16', 'fp32'\\]",
        ),
    ]
    shapes = ArrayRecord(Net().state_dict())
    shapes["fc2.bias"] = flwr.app.Array(np.zeros(3, dtype=np.float32))
    cases.append((_train_message(full, shapes), "fc2.bias: shape \\(3,\\), the model's \\(10,\\)"))
    for msg, says in cases:
        with pytest.raises(ValueError, match=says) as err:
            local_train(msg, _context(), Net(), x, y)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="give x and y"):  # no felix data outside felix
        local_train(
            _train_message(full, arrays),
            _context(),
            Net(),
        )
    with pytest.raises(ValueError, match="load_arrays: fc2.bias: shape"):
        load_arrays(cases[-1][0], Net())
    LEAN.update(make=Net, net=None)
    cut = ClientApp()

    @cut.train()
    def train_cut(msg: Message, context: Context) -> Message:
        del msg.content["config"]["seed"]
        return train_lean(msg, context)

    from felix.client.trainer import ClientData, TrainConfig
    from felix.flower.trainer import CLIENT_KEY, FlowerTrainer
    from felix.strategies.objectives import make_objective

    trainer = FlowerTrainer(cut, "mine:cut", Net(), make_objective("ce"), TrainConfig(), 10, 4, {})
    weights = np.zeros(trainer.layout.size, dtype=np.float32)
    with pytest.raises(
        ConfigError, match="mine:cut: the train handler raised on client 2: ValueError: .*no 'seed'"
    ) as cerr:
        trainer.train(weights, ClientData(x, y), {CLIENT_KEY: 2}, {}, torch.Generator().manual_seed(0))
    assert "\n" not in str(cerr.value)


def test_load_arrays_is_load_state_dict_in_place() -> None:
    """``load_arrays`` leaves the model as ``load_state_dict(to_torch_state_dict())`` does (its
    buffers, its integer counter and its tied weight included), in the model's own tensors."""
    torch.manual_seed(0)
    source = BnNet()
    with torch.no_grad():
        source.bn.running_mean.add_(1.5)
        source.bn.num_batches_tracked.add_(7)
    msg = _train_message({}, ArrayRecord(source.state_dict()))
    ours, theirs = BnNet(), BnNet()
    before = [t.data_ptr() for t in ours.state_dict().values()]
    load_arrays(msg, ours)
    theirs.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    assert [t.data_ptr() for t in ours.state_dict().values()] == before
    for (k, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), k


def test_records_filled_in_one_step_are_flowers_own() -> None:
    """The records the Flower path and the helpers fill without ``__setitem__``'s checks equal
    the ones Flower builds, down to their content hash (``object_id``, what Flower serialises)."""
    from felix.flower.trainer import filled, flower_codec

    arrays = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.array(4)}
    config = {"lr": 0.1, "seed": 3, "optimizer": "sgd", "drop-last": False}
    metrics = {"num-examples": 3, "train_loss": 0.5}
    ours_arrays = filled(ArrayRecord, {k: flower_codec().plain(v) for k, v in arrays.items()})
    theirs_arrays = ArrayRecord({k: flwr.app.Array(v) for k, v in arrays.items()})
    pairs = [
        (ours_arrays, theirs_arrays),
        (filled(ConfigRecord, config), ConfigRecord(config)),
        (filled(MetricRecord, metrics), MetricRecord(metrics)),
        (
            filled(RecordDict, {"arrays": ours_arrays, "config": filled(ConfigRecord, config)}),
            RecordDict({"arrays": theirs_arrays, "config": ConfigRecord(config)}),
        ),
    ]
    for ours, theirs in pairs:
        assert type(ours) is type(theirs) and ours == theirs and ours.object_id == theirs.object_id
