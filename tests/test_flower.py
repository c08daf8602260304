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

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

flwr = pytest.importorskip("flwr", reason='needs Flower: pip install "felix-fl[flower]"')

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from felix.cli import main
from felix.config import ConfigError
from felix.engine.run import resolve_config, run_config
from felix.flower import client_data

# The import paths below (test_flower:app, test_flower:make_net) name this module.
sys.path.insert(0, str(Path(__file__).parent))


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


def load_data(context: Context, batch_size: int, seed: int) -> DataLoader:
    """The client's partition: felix's data for this client when felix drives the app."""
    data = client_data(context)
    assert data is not None, "this test app runs under felix"
    x, y = data
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
    train_loss = train_fn(model, loader, int(context.run_config["local-epochs"]), float(config["lr"]))
    metrics = MetricRecord({"train_loss": train_loss, "num-examples": len(loader.dataset)})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


exact = ClientApp()


@exact.train()
def train_exact(msg: Message, context: Context) -> Message:
    """felix's own local loop written as a Flower handler (batch order from the task's seed,
    per-sample losses for Oort's utility): the same updates as felix's trainer, bit for bit."""
    config = msg.content["config"]
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    data = client_data(context)
    assert data is not None
    x, y = data
    n, bs = len(y), int(config["batch-size"])
    opt = torch.optim.SGD(model.parameters(), lr=float(config["lr"]))
    gen = torch.Generator().manual_seed(int(config["seed"]))
    sq_sum, loss_sum, seen, batches = 0.0, 0.0, 0, 0
    model.train()
    for epoch in range(int(config["local-epochs"])):
        order = torch.randperm(n, generator=gen)
        for start in range(0, n, bs):
            idx = order[start : start + bs]
            per = F.cross_entropy(model(x[idx]), y[idx], reduction="none")
            if epoch == 0:
                sq_sum += float(per.detach().square().sum())
                seen += len(idx)
            loss = per.mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += float(loss.detach())
            batches += 1
    metrics = MetricRecord(
        {
            "num-examples": n,
            "train_loss": loss_sum / max(batches, 1),
            "stat-utility": n * (sq_sum / seen) ** 0.5 if seen else 0.0,
        }
    )
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)


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


def test_a_flower_app_of_felix_loop_gives_felix_trainer_run_exactly() -> None:
    """Everything downstream of the trainer is felix's: an app that computes felix's updates gives
    the run felix's own trainer gives (one client at a time, as the Flower path trains)."""
    over = {**SMALL, "run": {**SMALL["run"], "max_aggregations": 6}}
    own = run_config(resolve_config(None, "felix", over), None, plots=False)
    via = run_config(
        resolve_config(None, "felix", {**over, "client": {"flower_app": "test_flower:exact"}}),
        None,
        plots=False,
    )
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
