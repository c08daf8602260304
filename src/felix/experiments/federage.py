"""The FedeRage comparison: client-side methods under the Random Access Model (RAM).

The paper's setting, as a self-contained round loop: each round the RAM (probabilities never
shown to the methods) draws the participating set ``S_t``; every participant trains from the
current global model with its method's objective; the server aggregates with the method's
aggregator and reduces the aux state (FedeRage's beta, SCAFFOLD's control) as the orchestrator
does. All methods see the same data split, the same participation draws and the same mini-batch
orders, so their differences are the methods' own.

The default scenario (``--scenario coupled``) couples data and availability heterogeneity as the
paper's Fig. 1 does: Fashion-MNIST made long-tailed (a random class order, ``imbalance``
head/tail ratio), split over clients by Dirichlet label skew (concentration 0.1), and
Beta-distributed participation probabilities given in ascending order to the clients whose data
is globally rarest. ``--scenario rare-clients`` makes the coupling strict: the tail classes are
held only by a quarter of the clients, who join with p = 0.03 (``_rare_clients_scenario``).

Evaluation, per method, of the final global model: each client's accuracy is the global test
set *reweighted to the client's label distribution*, ``sum_c pi_ic acc_c`` with ``acc_c`` the
per-class test accuracy (the paper does not say how per-client test sets are formed; this uses
the whole balanced test set and no client data is held out of training). Reported: the mean,
the worst client, the bottom 10%, the rare clients (``p_i <= --rare-p`` when given, else the
quarter of clients with the lowest ``p`` by rank: see ``rare_client_mask``), the std across
clients, global test accuracy, the mean test accuracy of the tail classes (the rarest 30% of
classes; under rare-clients, the rare clients' classes), and the wall seconds of local work per
round and per local step (for q-FFL these include the forward pass that measures ``F_k``).
FedeRage's overhead is also timed on identical tasks, interleaved with plain CE, which cancels
the CPU contention that separate runs see.

    python -m felix.experiments.federage --seeds 0 1 2 --out runs/federage-compare

Every table is the mean and the sample standard deviation (ddof 1) over the seeds; the JSON keeps
each seed's values and the provenance (commit, torch version, threads). docs/federage.md gives
the commands that regenerate the committed tables under docs/results/.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from felix.client.trainer import ClientData, LocalTrainer, TrainConfig
from felix.core.policies import Aggregator
from felix.core.types import BufferedUpdate
from felix.metrics.provenance import provenance
from felix.scenario.datasets import DatasetError, load_dataset
from felix.scenario.models import make_model
from felix.scenario.partition import dirichlet_partition
from felix.scenario.random_access import (
    RandomAccessModel,
    beta_probabilities,
    correlate_with_rarity,
    rare_client_mask,
    two_level_probabilities,
)
from felix.strategies.aggregation.fedavg import FedAvgAggregator
from felix.strategies.aggregation.ips import IPSAggregator
from felix.strategies.aggregation.qffl import QFFLAggregator
from felix.strategies.objectives import FEDERAGE_STEP_RULES, make_objective

BASE_METHODS = ("fedavg", "fedprox", "scaffold", "qffl", "ips", "wce", "focal")
DEFAULT_METHODS = "fedavg,fedprox,scaffold,qffl,ips,federage"


@dataclass(frozen=True)
class Method:
    """One row of the comparison: a client objective and a server aggregator."""

    name: str
    objective: str
    params: dict[str, Any] = field(default_factory=dict)  # the objective's, or q-FFL's {"q": q}
    aggregator: str = "fedavg"  # "fedavg", "qffl" or "ips"

    @property
    def objective_params(self) -> dict[str, Any]:
        return {} if self.aggregator == "qffl" else self.params

    def __post_init__(self) -> None:
        if self.aggregator not in ("fedavg", "qffl", "ips"):
            raise ValueError(f"method {self.name}: unknown aggregator {self.aggregator!r}")


@dataclass(frozen=True)
class Scenario:
    """The federation every method is run on."""

    clients: list[ClientData]
    counts: np.ndarray  # clients x classes, training samples
    probabilities: np.ndarray  # RAM participation probabilities, hidden from the methods
    test_x: torch.Tensor
    test_y: torch.Tensor
    in_shape: tuple[int, ...]
    num_classes: int
    class_order: np.ndarray  # classes from head to tail of the long-tailed training set
    rare_classes: np.ndarray  # the "tail classes" column: the rarest 30%, or rare-clients' own classes
    rare_p: float | None = None  # rare clients are p <= rare_p (None: the lowest-p quarter by rank)


def parse_federage(spec: str, default_rule: str = "capped") -> list[tuple[float, float, str]]:
    """``"0.5:0.5,0.2:1:paper"`` -> [(alpha, gamma, step_rule), ...]; the rule defaults to ``default_rule``."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        rule = parts.pop() if len(parts) == 3 else default_rule
        try:
            a, g = (float(v) for v in parts)
        except ValueError:
            raise ValueError(f"--federage expects alpha:gamma[:rule] items like 0.5:0.5 or 0.1:1:paper, "
                             f"got {item!r}") from None
        if rule not in FEDERAGE_STEP_RULES:
            raise ValueError(f"--federage item {item!r}: step rule must be one of {', '.join(FEDERAGE_STEP_RULES)}")
        out.append((a, g, rule))
    return out


def parse_floats(spec: str, flag: str) -> list[float]:
    try:
        return [float(v) for v in spec.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} expects comma-separated numbers, got {spec!r}") from None


def build_methods(args: argparse.Namespace, num_clients: int) -> list[Method]:
    methods: list[Method] = []
    for name in filter(None, (s.strip() for s in args.methods.split(","))):
        if name == "federage":
            for a, g, rule in parse_federage(args.federage, args.step_rule):
                params: dict[str, Any] = {"alpha": a, "gamma": g, "beta_max": args.beta_max, "step_rule": rule}
                if args.beta_lr is not None:
                    params["beta_lr"] = args.beta_lr
                tag = "norm" if rule == "normalised" else rule
                methods.append(Method(f"federage-{tag}(a={a:g},g={g:g})", "federage", params))
        elif name == "fedavg":
            methods.append(Method("fedavg", "ce"))
        elif name == "fedprox":
            methods.append(Method(f"fedprox(mu={args.mu:g})", "fedprox", {"mu": args.mu}))
        elif name == "scaffold":
            methods.append(Method("scaffold", "scaffold", {"num_clients": num_clients}))
        elif name == "qffl":
            for q in parse_floats(args.q, "--q"):
                methods.append(Method(f"qffl(q={q:g})", "ce", {"q": q}, aggregator="qffl"))
        elif name == "ips":
            methods.append(Method("fedavg-ips(oracle)", "ce", aggregator="ips"))
        elif name == "wce":
            methods.append(Method("wce", "wce"))
        elif name == "focal":
            methods.append(Method("focal(g=2)", "focal", {"gamma": 2.0}))
        else:
            raise ValueError(f"unknown method {name!r}; choose from {', '.join(BASE_METHODS + ('federage',))}")
    if not methods:
        raise ValueError("--methods selects no method")
    for m in methods:  # fail on bad hyperparameters now, not after loading the data
        make_objective(m.objective, **m.objective_params)
        if m.aggregator == "qffl":
            QFFLAggregator(q=m.params["q"], lipschitz=1.0)
    return methods


def make_aggregator(method: Method, scenario: Scenario, lr: float) -> Aggregator:
    if method.aggregator == "qffl":
        return QFFLAggregator(q=method.params["q"], lipschitz=1.0 / lr)  # L = 1/lr, as the q-FFL reference code
    if method.aggregator == "ips":
        return IPSAggregator({i: float(p) for i, p in enumerate(scenario.probabilities)})
    return FedAvgAggregator()


def long_tail_indices(labels: np.ndarray, num_classes: int, head: int, imbalance: float,
                      rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Keep ``head * imbalance^(-r/(C-1))`` samples of the class ranked ``r`` (random class order)."""
    if imbalance < 1:
        raise ValueError(f"imbalance (head/tail ratio) must be >= 1, not {imbalance}")
    order = rng.permutation(num_classes)
    keep = []
    for rank, c in enumerate(order):
        idx = np.flatnonzero(labels == c)
        n = int(head * imbalance ** (-rank / max(num_classes - 1, 1)))
        keep.append(rng.permutation(idx)[:max(n, 1)])
    return np.sort(np.concatenate(keep)), order


def build_scenario(args: argparse.Namespace, seed: int) -> Scenario:
    train, test = load_dataset(args.dataset, root=args.data_root)
    if test is None:
        raise DatasetError(f"dataset {args.dataset!r} has no test set")
    rng = np.random.default_rng([seed, 0])
    labels = train.y.numpy()
    keep, order = long_tail_indices(labels, train.num_classes, args.head_per_class, args.imbalance, rng)
    if args.scenario == "rare-clients":
        return _rare_clients_scenario(args, train, test, keep, order, rng)
    parts = dirichlet_partition(labels[keep], args.clients, args.dirichlet, rng, min_samples=args.batch_size)
    clients = [ClientData(train.x[torch.from_numpy(keep[p])], train.y[torch.from_numpy(keep[p])]) for p in parts]
    counts = np.stack([np.bincount(c.y.numpy(), minlength=train.num_classes) for c in clients])
    if args.p_dist == "beta":
        p = beta_probabilities(args.clients, rng, a=args.beta_a, b=args.beta_b, p_min=args.p_min, p_max=args.p_max)
    else:
        p = two_level_probabilities(args.clients, rng, args.frequent_fraction, args.p_frequent, args.p_rare)
    return Scenario(clients, counts, correlate_with_rarity(p, counts), test.x, test.y,
                    tuple(train.sample_shape), train.num_classes, order,
                    order[-max(1, train.num_classes * 3 // 10):], args.rare_p)


def _rare_clients_scenario(args: argparse.Namespace, train: Any, test: Any, keep: np.ndarray, order: np.ndarray,
                           rng: np.random.Generator) -> Scenario:
    """Rare clients hold the rare classes and are rarely heard: the issue's (and Fig. 1's) setting.

    The ``--rare-classes`` tail classes of the long-tailed set go, by Dirichlet label skew, to the
    ``--rare-fraction`` of clients only (the last ones), who join with ``--p-rare``; the other
    classes go the same way to all clients, who otherwise join with ``--p-frequent``. Rare
    clients are then exactly those with ``p <= p_rare`` (unless ``--rare-p`` says otherwise).
    """
    labels = train.y.numpy()
    n_rare = round(args.rare_fraction * args.clients)
    if not (1 <= n_rare < args.clients) or not (1 <= args.rare_classes < train.num_classes):
        raise ValueError(f"rare-clients needs 1 <= rare clients ({n_rare}) < --clients and "
                         f"1 <= --rare-classes ({args.rare_classes}) < {train.num_classes} classes")
    rare_classes = order[-args.rare_classes:]
    is_rare = np.isin(labels[keep], rare_classes)
    common, rare = keep[~is_rare], keep[is_rare]
    parts = [common[ix] for ix in dirichlet_partition(labels[common], args.clients, args.dirichlet, rng,
                                                      min_samples=args.batch_size)]
    rare_parts = dirichlet_partition(labels[rare], n_rare, args.dirichlet, rng)
    first_rare = args.clients - n_rare
    for k, ix in enumerate(rare_parts):
        parts[first_rare + k] = np.sort(np.concatenate([parts[first_rare + k], rare[ix]]))
    if min(len(ix) for ix in parts) < args.batch_size:
        raise ValueError(f"rare-clients: a client holds fewer than --batch-size {args.batch_size} samples; "
                         "raise --head-per-class or lower --clients")
    clients = [ClientData(train.x[torch.from_numpy(ix)], train.y[torch.from_numpy(ix)]) for ix in parts]
    counts = np.stack([np.bincount(c.y.numpy(), minlength=train.num_classes) for c in clients])
    if not (0.0 < args.p_rare <= args.p_frequent <= 1.0):
        raise ValueError(f"need 0 < --p-rare <= --p-frequent <= 1, got {args.p_rare}, {args.p_frequent}")
    p = np.array([args.p_frequent] * (args.clients - n_rare) + [args.p_rare] * n_rare)
    return Scenario(clients, counts, p, test.x, test.y, tuple(train.sample_shape), train.num_classes, order,
                    np.sort(rare_classes), args.p_rare if args.rare_p is None else args.rare_p)


def train_config(args: argparse.Namespace, method: Method) -> TrainConfig:
    """The local-training settings of one method: ``drop_last`` when its objective fixes the model
    mini-batch size b (FedeRage: every step sees exactly b samples, as the paper assumes)."""
    fixed = getattr(make_objective(method.objective, **method.objective_params), "fixed_batch", False)
    return TrainConfig(lr=args.lr, batch_size=args.batch_size, epochs=args.epochs, max_steps=args.max_steps,
                       drop_last=bool(fixed))


def local_steps(n: int, cfg: TrainConfig) -> int:
    """Local steps of a task on ``n`` samples (as the trainer counts them)."""
    per_epoch = n // cfg.batch_size if cfg.drop_last else math.ceil(n / cfg.batch_size)
    steps = per_epoch * cfg.epochs
    return steps if cfg.max_steps is None else min(steps, cfg.max_steps)


@torch.no_grad()
def per_class_accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int,
                       batch: int = 1000) -> tuple[np.ndarray, float]:
    model.eval()
    pred = torch.cat([model(x[i:i + batch]).argmax(1) for i in range(0, len(y), batch)])
    hit = (pred == y).double()
    per = torch.zeros(num_classes, dtype=torch.float64).index_add_(0, y, hit)
    n = torch.bincount(y, minlength=num_classes).double()
    return (per / n.clamp(min=1)).numpy(), float(hit.mean())


def client_metrics(acc_c: np.ndarray, counts: np.ndarray, p: np.ndarray,
                   rare_p: float | None = None) -> tuple[dict[str, float], np.ndarray]:
    """Per-client accuracy = global test accuracy reweighted to the client's label mix.

    Rare clients: ``rare_client_mask(p, rare_p)`` (``p <= rare_p``, or the lowest-p quarter by rank).
    """
    pi = counts / counts.sum(axis=1, keepdims=True)
    acc = pi @ acc_c
    k = max(1, math.ceil(0.1 * len(acc)))
    rare = rare_client_mask(p, rare_p)
    return {
        "mean_client_acc": float(acc.mean()),
        "worst_client_acc": float(acc.min()),
        "bottom10_acc": float(np.sort(acc)[:k].mean()),
        "rare_client_acc": float(acc[rare].mean()),
        "std_client_acc": float(acc.std()),
    }, acc


def _task_generator(seed: int, round_: int, client: int) -> torch.Generator:
    """The batch order of one (round, client) task: the same for every method."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, round_, client]).generate_state(1)[0]))


def paired_overhead(scenario: Scenario, participation: np.ndarray, args: argparse.Namespace, seed: int,
                    federage: Method, tasks: int = 24, repeats: int = 3) -> dict[str, float]:
    """FedeRage's local cost against plain CE on identical tasks, interleaved to cancel CPU drift.

    The same ``tasks`` (round, client) pairs of the RAM draw are trained from the initial model
    with each objective, alternating, ``repeats`` times; each task keeps its fastest time. The
    first pass doubles as the warm-up that the per-method timings would otherwise pay.
    """
    cfg = train_config(args, federage)  # the same steps for both: FedeRage's fixed b (drop_last) applies to CE too
    model = make_model(args.model, scenario.in_shape, scenario.num_classes, seed=seed)
    theta = parameters_to_vector(model.parameters()).detach().numpy().copy()
    pairs = [(r, int(c)) for r, row in enumerate(participation) for c in np.flatnonzero(row)][:tasks]
    best = {"ce": np.full(len(pairs), np.inf), "federage": np.full(len(pairs), np.inf)}
    for _ in range(repeats):
        for i, (r, cid) in enumerate(pairs):
            for name, params in (("ce", {}), ("federage", federage.objective_params)):
                trainer = LocalTrainer(model, make_objective(name, **params), cfg, scenario.num_classes)
                t0 = time.perf_counter()
                trainer.train(theta, scenario.clients[cid], {}, {}, _task_generator(seed, r, cid))
                best[name][i] = min(best[name][i], time.perf_counter() - t0)
    ce, fr = float(best["ce"].sum()), float(best["federage"].sum())
    return {"tasks": len(pairs), "ce_s": ce, "federage_s": fr, "overhead": fr / ce - 1.0 if ce > 0 else 0.0}


def run_method(method: Method, scenario: Scenario, participation: np.ndarray, args: argparse.Namespace,
               seed: int, log: bool) -> dict[str, Any]:
    """The RAM round loop for one method; returns its metrics and per-client accuracies."""
    cfg = train_config(args, method)
    model = make_model(args.model, scenario.in_shape, scenario.num_classes, seed=seed)
    theta = parameters_to_vector(model.parameters()).detach().numpy().copy()
    aggregator = make_aggregator(method, scenario, args.lr)
    aux: dict[str, np.ndarray] = {}
    states: dict[int, dict[str, Any]] = {}
    round_seconds: list[float] = []
    steps_total, train_seconds, betas, last_loss = 0, 0.0, [], float("nan")
    for r, mask in enumerate(participation):
        chosen = np.flatnonzero(mask)
        if chosen.size == 0:
            continue  # nobody showed up: the model stands still this round
        buffer, spent = [], 0.0
        for cid in chosen:
            data = scenario.clients[cid]
            gen = _task_generator(seed, r, int(cid))
            objective = make_objective(method.objective, **method.objective_params)
            trainer = LocalTrainer(model, objective, cfg, scenario.num_classes)
            t0 = time.perf_counter()
            pre_loss = trainer.probe(theta, data).loss if method.aggregator == "qffl" else None
            upd = trainer.train(theta, data, states.setdefault(int(cid), {}), aux, gen)
            spent += time.perf_counter() - t0
            if pre_loss is not None:
                upd.aux["qffl_loss"] = np.array(pre_loss)  # F_k at the received model
            steps_total += local_steps(len(data), cfg)
            buffer.append(BufferedUpdate(int(cid), r, r, 0.0, upd))
        theta, _, reduced = aggregator.aggregate(theta, buffer)
        aux.update(reduced)
        last_loss = float(np.mean([b.update.loss for b in buffer]))
        round_seconds.append(spent)
        train_seconds += spent
        if "federage_beta" in aux:
            betas.append(float(aux["federage_beta"]))
        if log and (r + 1) % max(1, len(participation) // 5) == 0:
            print(f"  {method.name}: round {r + 1}/{len(participation)}", file=sys.stderr)
    vector_to_parameters(torch.from_numpy(theta.copy()), model.parameters())
    acc_c, global_acc = per_class_accuracy(model, scenario.test_x, scenario.test_y, scenario.num_classes)
    metrics, acc = client_metrics(acc_c, scenario.counts, scenario.probabilities, scenario.rare_p)
    tail = scenario.rare_classes
    return {
        "method": method.name,
        **metrics,
        "global_acc": global_acc,
        "tail_class_acc": float(acc_c[tail].mean()),
        "round_compute_s": float(np.mean(round_seconds)) if round_seconds else 0.0,
        "ms_per_step": 1000.0 * train_seconds / steps_total if steps_total else 0.0,
        "per_class_acc": acc_c.tolist(),
        "client_acc": acc.tolist(),
        "server_beta": betas,
        "last_round_train_loss": last_loss,  # a blow-up here flags divergence (accuracy at chance)
        "finite_model": bool(np.isfinite(theta).all()),
    }


METRICS = ("mean_client_acc", "worst_client_acc", "bottom10_acc", "rare_client_acc", "std_client_acc",
           "global_acc", "tail_class_acc", "round_compute_s", "ms_per_step")
HEADERS = ("mean", "worst", "bottom 10%", "rare clients", "std", "global", "tail classes",
           "local s/round", "ms/step")


def summarise(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Mean and sample std (ddof 1; 0 for one seed) over seeds of each method's metrics, and how
    many seeds ended with a finite model."""
    rows = []
    for per_seed in zip(*runs):
        row: dict[str, Any] = {"method": per_seed[0]["method"]}
        for m in METRICS:
            vals = np.array([s[m] for s in per_seed])
            row[m] = float(vals.mean())
            row[m + "_std"] = float(vals.std(ddof=1)) if len(vals) > 1 else 0.0
        row["finite_seeds"] = sum(bool(s["finite_model"]) for s in per_seed)
        rows.append(row)
    return rows


def markdown_table(rows: list[dict[str, Any]], n_seeds: int) -> str:
    def cell(row: dict[str, Any], m: str) -> str:
        digits = 2 if m == "ms_per_step" else 3
        s = f"{row[m]:.{digits}f}"
        return s + f" ± {row[m + '_std']:.{digits}f}" if n_seeds > 1 else s

    lines = ["| method | " + " | ".join(HEADERS) + " | finite |", "|" + "---|" * (len(HEADERS) + 2)]
    for row in rows:
        lines.append(f"| {row['method']} | " + " | ".join(cell(row, m) for m in METRICS)
                     + f" | {row['finite_seeds']}/{n_seeds} |")
    return "\n".join(lines) + "\n"


DELTA_METRICS = ("mean_client_acc", "bottom10_acc", "rare_client_acc", "tail_class_acc", "global_acc")


def paired_delta_table(runs: list[list[dict[str, Any]]], reference: str = "fedavg") -> str:
    """Each method minus ``reference`` on the same seed (same data, draws and batch orders), mean
    ± sample std over seeds, and the seeds where the method is ahead: the scenario changes a lot
    from seed to seed, the paired difference much less."""
    names = [r["method"] for r in runs[0]]
    if reference not in names:
        return ""
    ref = names.index(reference)
    heads = ("mean", "bottom 10%", "rare clients", "tail classes", "global")
    lines = [f"| method - {reference} (paired by seed) | " + " | ".join(heads) + " |", "|" + "---|" * (len(heads) + 1)]
    for i, name in enumerate(names):
        if i == ref:
            continue
        cells = []
        for m in DELTA_METRICS:
            d = np.array([seed_runs[i][m] - seed_runs[ref][m] for seed_runs in runs])
            std = f" ± {d.std(ddof=1):.3f}" if len(d) > 1 else ""
            cells.append(f"{d.mean():+.3f}{std} ({int((d > 0).sum())}/{len(d)})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def report_markdown(doc: dict[str, Any]) -> str:
    """The markdown report of a ``federage_compare.json`` document: settings, provenance, tables."""
    prov, seeds, runs = doc["provenance"], [s["seed"] for s in doc["scenarios"]], doc["runs"]
    git = prov.get("git") or {"commit": "unknown (not a git checkout)", "dirty": False}
    table = markdown_table(doc["summary"], len(seeds))
    deltas = paired_delta_table(runs)
    if deltas:
        table += "\nIn parentheses: the seeds on which the method is ahead.\n\n" + deltas
    ov = [info["paired_overhead"] for info in doc["scenarios"] if info.get("paired_overhead")]
    if ov:
        table += (f"\nFedeRage's local-training overhead vs FedAvg (plain CE) on the same {ov[0]['tasks']} tasks, "
                  "interleaved, fastest of 3: " + ", ".join(f"{100 * o['overhead']:+.1f}%" for o in ov)
                  + " (per seed). The per-method s/round columns come from separate runs and include any CPU "
                  "contention of their moment.\n")
    return ("# FedeRage comparison under the Random Access Model\n\n"
            f"Mean ± sample std over seeds {seeds}. Provenance: commit {git['commit'][:12]}"
            f"{' (with local changes)' if git['dirty'] else ''}, torch {prov['torch']}, "
            f"{prov['run']['torch_threads_per_process']} torch thread(s) per process.\n\n"
            f"Command settings: `{json.dumps(doc['settings'])}`\n\n" + table)


def _rounded(value: Any, digits: int = 5) -> Any:
    """Per-run floats to ``digits`` decimals: keeps the committed result JSON small."""
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, list):
        return [_rounded(v, digits) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v, digits) for k, v in value.items()}
    return value


def plot_distribution(path: Path, runs: list[list[dict[str, Any]]]) -> None:
    """Box plot of per-client accuracy per method (clients of all seeds pooled)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["method"] for r in runs[0]]
    data = [np.concatenate([seed_runs[i]["client_acc"] for seed_runs in runs]) for i in range(len(names))]
    fig, ax = plt.subplots(figsize=(1.3 * len(names) + 2, 4.5))
    ax.boxplot(data, whis=(5, 95), showmeans=True)
    ax.set_xticks(range(1, len(names) + 1), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("client accuracy (test set reweighted to client labels)")
    ax.set_title("Accuracy across clients under the Random Access Model")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _run_seeds(args: argparse.Namespace, methods: list[Method],
               seeds: list[int]) -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]:
    """Per seed: build the scenario, draw the RAM rounds once, time FedeRage's overhead, run every method."""
    runs: list[list[dict[str, Any]]] = []
    scenario_info: list[dict[str, Any]] = []
    fr = next((m for m in methods if m.objective == "federage"),
              Method("federage", "federage", {"alpha": 0.5, "gamma": 0.5}))
    for seed in seeds:
        scenario = build_scenario(args, seed)
        participation = RandomAccessModel(scenario.probabilities).draw_rounds(args.rounds, np.random.default_rng([seed, 1]))
        p = scenario.probabilities
        sizes = participation.sum(axis=1)
        scenario_info.append({
            "seed": seed,
            "train_samples": int(scenario.counts.sum()),
            "class_counts": scenario.counts.sum(axis=0).tolist(),
            "class_order_head_to_tail": scenario.class_order.tolist(),
            "p_min": float(p.min()), "p_median": float(np.median(p)), "p_max": float(p.max()),
            "expected_participants": float(p.sum()),
            "mean_participants": float(sizes.mean()),
            "empty_rounds": int((sizes == 0).sum()),
            "rare_clients": int(rare_client_mask(p, scenario.rare_p).sum()),
            "rare_client_p_max": float(p[rare_client_mask(p, scenario.rare_p)].max()),
            "tail_classes": scenario.rare_classes.tolist(),
            "paired_overhead": (paired_overhead(scenario, participation, args, seed, fr, tasks=args.overhead_tasks)
                                if args.overhead_tasks else None),
        })
        if not args.quiet:
            print(f"seed {seed}: {len(scenario.clients)} clients, {int(scenario.counts.sum())} samples, "
                  f"{sizes.mean():.1f} participants/round", file=sys.stderr)
        seed_runs = []
        for method in methods:
            res = run_method(method, scenario, participation, args, seed, log=not args.quiet)
            if not args.quiet:
                print(f"  {method.name}: mean {res['mean_client_acc']:.3f} worst {res['worst_client_acc']:.3f} "
                      f"rare {res['rare_client_acc']:.3f} global {res['global_acc']:.3f} "
                      f"{res['round_compute_s']:.3f} s/round", file=sys.stderr)
            seed_runs.append(res)
        runs.append(seed_runs)
    return runs, scenario_info


def _run_one_seed(job: tuple[argparse.Namespace, list[Method], int | list[int]]
                  ) -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]:
    """``_run_seeds`` under ``--threads`` torch threads (a worker process's entry point for ``--jobs``)."""
    args, methods, seeds = job
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run_seeds(args, methods, seeds if isinstance(seeds, list) else [seeds])
    finally:
        torch.set_num_threads(threads)


def run(args: argparse.Namespace) -> int:
    """Run every method on every seed's scenario; write the table, the JSON and the plot."""
    _check(args)
    methods = build_methods(args, args.clients)
    seeds = [int(s) for s in args.seeds]
    # the code as it was when the runs started; each worker process runs --threads torch threads
    prov = provenance({"torch_threads_per_process": args.threads, "jobs": args.jobs, "command": " ".join(sys.argv)})
    if args.jobs > 1 and len(seeds) > 1:
        # One process per seed; each runs exactly what the serial loop would, so results match.
        with ProcessPoolExecutor(min(args.jobs, len(seeds)), mp_context=multiprocessing.get_context("spawn")) as pool:
            parts = list(pool.map(_run_one_seed, [(args, methods, seed) for seed in seeds]))
        runs = [r for part in parts for r in part[0]]
        scenario_info = [i for part in parts for i in part[1]]
    else:
        runs, scenario_info = _run_one_seed((args, methods, seeds))
    rows = summarise(runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    doc = {"settings": settings, "provenance": prov, "scenarios": scenario_info, "summary": rows,
           "runs": _rounded(runs)}
    report = report_markdown(doc)
    (out / "federage_compare.md").write_text(report)
    (out / "federage_compare.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot_distribution(out / "client_accuracy.png", runs)
    print(report)
    print(f"wrote {out / 'federage_compare.md'}, {out / 'federage_compare.json'}, {out / 'client_accuracy.png'}",
          file=sys.stderr)
    return 0


def _configure(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("data and model")
    d.add_argument("--dataset", default="fashion_mnist", help="dataset name for felix.scenario.datasets.load_dataset")
    d.add_argument("--data-root", default=None, help="dataset folder (default: the loader's)")
    d.add_argument("--model", default="small_cnn", help="felix.scenario.models name (small_cnn, mlp, felix_cnn)")
    d.add_argument("--clients", type=int, default=100)
    d.add_argument("--head-per-class", type=int, default=3000, help="training samples of the most frequent class")
    d.add_argument("--imbalance", type=float, default=20.0, help="head/tail class-size ratio of the long tail")
    d.add_argument("--scenario", choices=("coupled", "rare-clients"), default="coupled",
                   help="coupled: Dirichlet split, p coupled to data rarity (--p-dist); rare-clients: the "
                        "--rare-classes tail classes held only by --rare-fraction of clients at --p-rare")
    d.add_argument("--rare-classes", type=int, default=2, help="rare-clients: tail classes the rare clients hold")
    d.add_argument("--rare-fraction", type=float, default=0.25, help="rare-clients: fraction of rare clients")
    d.add_argument("--dirichlet", type=float, default=0.1,
                   help="Dirichlet label-skew concentration (0.1: most clients hold one or two classes)")
    r = p.add_argument_group("Random Access Model")
    r.add_argument("--p-dist", choices=("beta", "two-level"), default="beta")
    r.add_argument("--beta-a", type=float, default=0.5)
    r.add_argument("--beta-b", type=float, default=3.0)
    r.add_argument("--p-min", type=float, default=0.02)
    r.add_argument("--p-max", type=float, default=0.9)
    r.add_argument("--frequent-fraction", type=float, default=0.2)
    r.add_argument("--p-frequent", type=float, default=0.5)
    r.add_argument("--p-rare", type=float, default=0.05)
    r.add_argument("--rare-p", type=float, default=None,
                   help="rare clients are those with p <= this (default: the lowest-p quarter by rank)")
    t = p.add_argument_group("training and methods")
    t.add_argument("--rounds", type=int, default=100)
    t.add_argument("--lr", type=float, default=0.05)
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--epochs", type=int, default=1)
    t.add_argument("--max-steps", type=int, default=10, help="cap on local steps per round (0: none)")
    t.add_argument("--methods", default=DEFAULT_METHODS,
                   help=f"comma list from {', '.join(BASE_METHODS + ('federage',))}")
    t.add_argument("--federage", default="0.5:0.5,0.2:0.5,0.2:1.0",
                   help="FedeRage alpha:gamma[:rule] items (rule: paper or normalised; default --step-rule)")
    t.add_argument("--step-rule", choices=FEDERAGE_STEP_RULES, default="capped",
                   help="FedeRage's step rule for items without one (see FedeRage's docstring)")
    t.add_argument("--beta-lr", type=float, default=None, help="FedeRage's beta learning rate (default: --lr)")
    t.add_argument("--beta-max", type=float, default=10.0, help="FedeRage's interval B = [0, beta_max]")
    t.add_argument("--mu", type=float, default=0.01, help="FedProx mu")
    t.add_argument("--q", default="0.1,1", help="q-FFL q values, comma-separated (one row each)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads; small models run fastest on one (more oversubscribe the CPU)")
    p.add_argument("--seeds", nargs="+", default=["0"], help="one run per seed; the table shows mean ± std")
    p.add_argument("--jobs", type=int, default=1, help="seeds run in parallel processes (same results as serial)")
    p.add_argument("--overhead-tasks", type=int, default=24,
                   help="tasks timed for FedeRage's paired overhead per seed (0: skip the timing)")
    p.add_argument("--out", default="runs/federage-compare")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=run_cli)


def _check(args: argparse.Namespace) -> None:
    for name in ("clients", "rounds", "batch_size", "epochs", "head_per_class", "threads", "jobs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_steps is not None and args.max_steps < 0:
        raise ValueError("--max-steps must be >= 0 (0: no cap)")
    if args.max_steps == 0:
        args.max_steps = None
    if args.overhead_tasks < 0:
        raise ValueError("--overhead-tasks must be >= 0")
    if args.rare_p is not None and not (0.0 <= args.rare_p <= 1.0):
        raise ValueError(f"--rare-p must lie in [0, 1], not {args.rare_p}")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``felix federage-compare`` on the CLI's subparsers."""
    p = subparsers.add_parser("federage-compare", help="FedeRage vs FedAvg/FedProx/SCAFFOLD/q-FFL/IPS under the RAM",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _configure(p)
    return p


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m felix.experiments.federage", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _configure(p)
    return run_cli(p.parse_args(argv))


def run_cli(args: argparse.Namespace) -> int:
    """``run`` with bad input (arguments, hyperparameters, dataset) answered by a one-line error and
    exit status 2, for ``felix federage-compare`` and ``python -m felix.experiments.federage`` alike."""
    try:
        return run(args)
    except ValueError as exc:  # DatasetError is a ValueError too
        print(f"federage-compare: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
