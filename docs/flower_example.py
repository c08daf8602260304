"""A Flower app (Flower's quickstart-pytorch, on scikit-learn's digits) run both ways (docs/flower.md).

Under felix's simulator, with churn, any felix strategy and felix's outputs::

    PYTHONPATH=docs felix run --flower-app flower_example:app --set model=flower_example:make_net

Inside Flower's simulation, with felix-fl's selection and aggregation (FelixStrategy)::

    python docs/flower_example.py

Needs ``pip install "felix-fl[flower]"``.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from felix.flower import client_data
from felix.flower.helpers import apply_plan, class_counts_reply, objective


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
    """felix's ``model`` for these runs (``--set model=flower_example:make_net``): the app's network."""
    return Net(tuple(sample_shape), num_classes)


def load_partition(context: Context) -> tuple[torch.Tensor, torch.Tensor]:
    """felix's data for this client when felix drives the app (after any DAFL augmentation);
    under Flower, an even split of the digits by ``partition-id``."""
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
        x = torch.tensor(digits.images[idx] / 16.0, dtype=torch.float32).unsqueeze(1)
        data = (x, torch.tensor(digits.target[idx]))
    return data


app = ClientApp()


@app.query("felix_counts")
def counts(msg: Message, context: Context) -> Message:
    """FelixStrategy(data_plan="dafl") asks each node for its class counts once."""
    return class_counts_reply(msg, load_partition(context)[1], 10)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """The quickstart's train handler, with felix's objective and DAFL row applied by the helpers."""
    config = msg.content["config"]
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = apply_plan(msg, context, *load_partition(context))
    obj = objective(msg, context, model, num_classes=10)  # felix.objective from the config; ce by default
    seed = int(config.get("seed", context.node_id))
    loader = DataLoader(
        TensorDataset(x, y),
        batch_size=int(config.get("batch-size", 16)),
        shuffle=True,
        drop_last=bool(config.get("drop-last", False)),
        generator=torch.Generator().manual_seed(seed),
    )
    opt = torch.optim.SGD(model.parameters(), lr=float(config["lr"]))
    model.train()
    total, batches = 0.0, 0
    for _ in range(int(config.get("local-epochs", 1))):
        for xb, yb in loader:
            loss = obj.loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            obj.before_step()
            opt.step()
            obj.after_step()
            total += float(loss.detach())
            batches += 1
    metrics = MetricRecord({"train_loss": total / max(batches, 1), "num-examples": len(y)})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    obj.finish(content)  # FedeRage's beta (felix.aux) and the objective's state for next time
    return Message(content=content, reply_to=msg)


server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    """felix-fl's Oort selection, TierFuse aggregation and DAFL plan, FedeRage on the clients."""
    from felix.flower.strategy import FelixStrategy

    strategy = FelixStrategy(
        clients_per_round=5, data_plan="dafl", fraction_evaluate=0.0, min_available_nodes=10
    )
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(Net().state_dict()),
        num_rounds=5,
        train_config=ConfigRecord(
            {"lr": 0.1, "felix.objective": "federage", "felix.objective-params": json.dumps({"alpha": 0.2})}
        ),
    )
    print("train loss by round:", {r: m["train_loss"] for r, m in result.train_metrics_clientapp.items()})


if __name__ == "__main__":
    from felix.flower.strategy import run_simulation

    run_simulation(server, app, num_supernodes=10, num_cpus=2)
