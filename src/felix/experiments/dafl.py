"""The DAFL paper's experiment (its Tables IV and V) on the felix simulator.

Eight clients hold the client x class counts of a Table II partition (D1-D6) of the first eight
CIFAR-10 classes, optionally scaled down (``--scale``: every count times the factor, rounded, at
least 1 where the paper has a sample) so that CPU runs finish. Every method trains with
full-participation synchronous FedAvg (all 8 clients every round, always available, nothing
cancelled) through the ordinary run path (``resolve_config`` / ``run_config``), differing only in
what the paper varies:

    nic      plain cross-entropy (No Imbalance Correction)
    wcel     class-weighted cross-entropy (``wce`` objective)
    lb       local balancing: every client augments until its own J_k <= tau (``data_plan: lb``)
    fedprox  FedProx's proximal term (``fedprox`` objective, ``--mu``)
    focal    focal loss (``focal`` objective, ``--gamma``)
    dafl     DAFL's planned augmentation (``data_plan: dafl``, paper settings, ``--lambda2``)

Time is virtual: a training task lasts ``--seconds-per-sample`` times the client's sample count
(runtime ``per_sample``: the paper's T_r grows with the largest client, which is why the amount
of augmentation matters), and a client's first task also carries its augmentation time
(``zeta / zeta'`` of a sample's training time per augmented sample). A round therefore lasts as
long as its slowest client, as in the paper.

Reported per method and case (mean ± std over ``--seeds``), as in Table IV: rounds and virtual
time to convergence by the paper's rule (training-loss change below ``--threshold`` for
``--patience`` consecutive rounds; ``felix.metrics.convergence``), and on the balanced test set
of the eight classes the minority-class F1 (``felix.metrics.classification``), accuracy and
macro F1 of the model at convergence, or of the last model when the run did not converge within
``--rounds`` (the table marks such cells). Also the samples each method added and its
augmentation time (virtual, slowest client).

    felix dafl-experiment --dataset-case D2 --scale 0.1 --rounds 60 --seeds 0 1 2
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import multiprocessing as mp
import platform
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch
from numpy.typing import NDArray
from torch.nn.utils import vector_to_parameters

from felix.config import Config, ConfigError
from felix.core.commands import NewModelVersion
from felix.engine.run import resolve_config, run_config
from felix.metrics.classification import class_metrics, confusion_matrix, minority_classes
from felix.metrics.convergence import convergence_round
from felix.scenario.datasets import ArrayDataset, DatasetError
from felix.sim.build import Built
from felix.strategies.dataplans.dafl_tables import DATASET_NAMES, partition

__all__ = ["METHOD_NAMES", "add_parser", "main", "run", "scale_table"]

COMMAND: Final = "dafl-experiment"
METHOD_NAMES: Final = ("nic", "wcel", "lb", "fedprox", "focal", "dafl")
DEFAULT_ROOT: Final = "../shared/data/cifar10-jpeg.tar.gz"
NUM_CLASSES: Final = 8


@dataclass(frozen=True)
class Method:
    """One row group of the table: a client objective and a data plan."""

    key: str
    label: str
    objective: str = "ce"
    objective_params: dict[str, Any] = field(default_factory=dict)
    data_plan: str = "none"


def build_methods(names: Sequence[str], mu: float, gamma: float) -> list[Method]:
    """The paper's methods by key (see the module docstring), in the order given."""
    catalogue = {
        "nic": Method("nic", "NIC"),
        "wcel": Method("wcel", "WCEL", "wce"),
        "lb": Method("lb", "LB", data_plan="lb"),
        "fedprox": Method("fedprox", "FedProx", "fedprox", {"mu": mu}),
        "focal": Method("focal", "Focal", "focal", {"gamma": gamma}),
        "dafl": Method("dafl", "DAFL", data_plan="dafl"),
    }
    unknown = [n for n in names if n not in catalogue]
    if unknown:
        raise ValueError(f"unknown method {unknown[0]!r}; choose from {', '.join(METHOD_NAMES)}")
    if not names:
        raise ValueError("--methods selects no method")
    if len(set(names)) != len(names):
        raise ValueError("--methods names a method twice")
    return [catalogue[n] for n in names]


def scale_table(table: NDArray[np.int64], scale: float) -> NDArray[np.int64]:
    """``table * scale`` rounded half up, at least 1 wherever ``table`` is positive, so a scaled
    partition keeps every client-class pair the paper has (and every class present)."""
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"--scale must be a finite number > 0, got {scale!r}")
    t = np.asarray(table, dtype=np.int64)
    scaled = np.floor(t * scale + 0.5).astype(np.int64)
    return np.where(t > 0, np.maximum(scaled, 1), 0)


@torch.no_grad()
def confusion_on_test(model: torch.nn.Module, weights: np.ndarray, test: ArrayDataset, device: str,
                   batch_size: int = 1000) -> NDArray[np.int64]:
    """The confusion matrix of ``weights`` (loaded into ``model``) on the test set."""
    model = model.to(device)
    vector_to_parameters(torch.from_numpy(np.array(weights, dtype=np.float32)).to(device), list(model.parameters()))
    model.eval()
    preds = [model(test.x[s:s + batch_size].to(device)).argmax(1).cpu() for s in range(0, len(test), batch_size)]
    return confusion_matrix(test.y.numpy(), torch.cat(preds).numpy(), test.num_classes)


def experiment_config(args: argparse.Namespace, table: NDArray[np.int64], method: Method, seed: int,
                      case: str) -> Config:
    """The run config of one (case, method, seed): sync full-participation FedAvg on the table."""
    sets: dict[str, Any] = {
        "name": f"dafl-{case}-{method.key}",
        "seed": seed,
        "model": args.model,
        "data_plan": method.data_plan,
        "dafl": {"lambda2": args.lambda2, "augmenter": args.augmenter},
        "dataset": {"name": args.dataset, "root": args.root if args.dataset == "cifar10" else None,
                    "num_classes": NUM_CLASSES},
        "partition": {"kind": "table", "num_clients": int(table.shape[0]), "table": table.tolist()},
        "trace": {"kind": "always"},
        "runtime": {"kind": "per_sample", "seconds_per_sample": args.seconds_per_sample},
        "orchestrator": {"mode": "sync", "agg_goal": int(table.shape[0]), "overcommit": 1.0, "deadline_s": None,
                         "task_timeout_s": None, "knowledge": "none"},
        "selector": {"name": "random"},
        "aggregator": {"name": "fedavg", "server_lr": 1.0, "normalize": "weights"},
        "client": {"lr": args.lr, "batch_size": args.batch_size, "epochs": args.epochs, "max_steps": None,
                   "objective": method.objective, "objective_params": dict(method.objective_params)},
        "run": {"max_aggregations": args.rounds, "stop_at_target": False, "eval_every": 0,
                "max_time_s": 1e12, "device": args.device},
    }
    return resolve_config(None, "fedavg", sets)


def run_one(args: argparse.Namespace, table: NDArray[np.int64], method: Method, seed: int,
            case: str) -> dict[str, Any]:
    """Simulate one (case, method, seed) and measure it as the paper does."""
    cfg = experiment_config(args, table, method, seed, case)
    # Every version's weights are kept (read-only arrays, not copies) and only the model at
    # convergence and the last one are evaluated: a test pass costs more than a round here.
    snapshots: dict[int, np.ndarray] = {}

    def keep(cmd: NewModelVersion) -> None:
        snapshots[cmd.version] = cmd.weights

    def instrument(built: Built) -> None:
        built.recorder.aggregation_hooks.append(keep)

    res = run_config(cfg, None, plots=False, prepare=instrument)
    built, rec = res.built, res.built.recorder
    losses = [r.loss for r in rec.train_losses]
    minority = minority_classes(table.sum(axis=0))
    conv = convergence_round(losses, args.threshold, args.patience)
    last = built.orch.version
    if conv is None:
        at_version, conv_time = last, None
    else:
        at_version, conv_time = rec.train_losses[conv - 1].version, rec.train_losses[conv - 1].time_s
    model, test = copy.deepcopy(built.population.model), built.population.test
    if test is None:
        raise DatasetError(f"{cfg.dataset.name}: the DAFL experiment needs a test set")
    at = class_metrics(confusion_on_test(model, snapshots[at_version], test, cfg.run.device), minority)
    final = at if at_version == last else class_metrics(
        confusion_on_test(model, snapshots[last], test, cfg.run.device), minority)
    s = res.summary
    aug = s.get("augmentation", {})
    return {
        "case": case, "method": method.key, "label": method.label, "seed": seed,
        "converged": conv is not None,
        "rounds": conv, "time_s": conv_time, "metrics_version": at_version,
        "minority_f1": at.minority_f1, "accuracy": at.accuracy, "macro_f1": at.macro_f1,
        "per_class_f1": list(at.per_class_f1),
        "final": {"version": last, "minority_f1": final.minority_f1, "accuracy": final.accuracy,
                  "macro_f1": final.macro_f1},
        "added": s.get("data_plan", {}).get("added", 0),
        "augmentation_s": aug.get("max_virtual_s", 0.0),
        "augmentation_wall_s": aug.get("max_wall_s", 0.0),
        "data_plan": s.get("data_plan"),
        "minority_classes": minority.tolist(),
        "virtual_time_s": s["virtual_time_s"], "wall_time_s": s["wall_time_s"], "aggregations": s["aggregations"],
        "train_loss": losses,
        "bytes_down": s["bytes_down"], "bytes_up": s["bytes_up"],
    }


# ---------------------------------------------------------------------- table
ROWS: Final = (
    ("Rounds", "rounds", 1), ("Time (s)", "time_s", 1), ("Minority F1", "minority_f1", 3),
    ("Accuracy", "accuracy", 3), ("Macro F1", "macro_f1", 3), ("Added samples", "added", 0),
    ("Aug. time (s)", "augmentation_s", 2), ("All rounds (s)", "virtual_time_s", 1),
)


#: Rows that describe the whole run, not the model at convergence.
_RUN_KEYS: Final = ("added", "augmentation_s", "virtual_time_s")


def _cell(runs: list[dict[str, Any]], key: str, digits: int, rounds: int) -> str:
    """mean ± std over seeds. Convergence cells average the converged seeds and say how many
    converged; metric cells of a seed that did not converge use its last model (marked ``*``)."""
    if key in ("rounds", "time_s"):
        vals = [r[key] for r in runs if r["converged"]]
        if not vals:
            return f"n/c (>{rounds})"
        note = "" if len(vals) == len(runs) else f" ({len(vals)}/{len(runs)} conv.)"
    else:
        vals = [r[key] for r in runs]
        note = "" if all(r["converged"] for r in runs) or key in _RUN_KEYS else "*"
    arr = np.asarray(vals, dtype=np.float64)
    text = f"{arr.mean():.{digits}f}"
    if len(runs) > 1:
        text += f" ± {arr.std():.{digits}f}"
    return text + note


def markdown_table(results: list[dict[str, Any]], cases: Sequence[str], methods: Sequence[Method],
                   rounds: int) -> str:
    """Table IV's layout: a row per metric and method, a column per partition."""
    lines = ["| Metric | Method | " + " | ".join(cases) + " |", "|---|---|" + "---|" * len(cases)]
    for title, key, digits in ROWS:
        for i, m in enumerate(methods):
            cells = []
            for case in cases:
                runs = [r for r in results if r["case"] == case and r["method"] == m.key]
                cells.append(_cell(runs, key, digits, rounds))
            lines.append(f"| {title if i == 0 else ''} | {m.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def summarise(results: list[dict[str, Any]], cases: Sequence[str], methods: Sequence[Method]) -> list[dict[str, Any]]:
    """Per (case, method): mean and std of every table metric over the seeds (None when no value)."""
    out = []
    for case in cases:
        for m in methods:
            runs = [r for r in results if r["case"] == case and r["method"] == m.key]
            row: dict[str, Any] = {"case": case, "method": m.key, "seeds": len(runs),
                                   "converged": sum(r["converged"] for r in runs)}
            for _, key, _ in ROWS:
                vals = [r[key] for r in runs if r[key] is not None]
                row[key] = float(np.mean(vals)) if vals else None
                row[key + "_std"] = float(np.std(vals)) if vals else None
            out.append(row)
    return out


# ---------------------------------------------------------------------- command
def run(args: argparse.Namespace) -> int:
    """Run every (case, method, seed), write ``dafl_table.md`` and ``dafl_results.json`` under
    ``--out`` and print the table; bad arguments or data are one line on stderr and exit 2."""
    try:
        cases = _cases(args.dataset_case)
        methods = build_methods([s.strip() for s in args.methods.split(",") if s.strip()], args.mu, args.gamma)
        _check(args)
        tables = {case: scale_table(partition(case), args.scale) for case in cases}
        threads = torch.get_num_threads()
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        try:
            work = [(args, tables[case], methods, seed, case) for case in cases for seed in args.seeds]
            if args.jobs > 1 and len(work) > 1:
                # One process per (case, seed); spawned, so no torch state is forked.
                with ProcessPoolExecutor(min(args.jobs, len(work)), mp_context=mp.get_context("spawn")) as pool:
                    results = [r for runs in pool.map(_run_seed, *zip(*work)) for r in runs]
            else:
                results = [r for item in work for r in _run_seed(*item)]
        finally:
            torch.set_num_threads(threads)
    except (ConfigError, DatasetError, ValueError) as exc:
        print(f"felix {COMMAND}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    table = markdown_table(results, cases, methods, args.rounds)
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = (f"# DAFL experiment: {', '.join(cases)} (scale {args.scale:g}, {args.dataset}, {args.model}, "
              f"{args.rounds} rounds, seeds {' '.join(map(str, args.seeds))})\n\n")
    note = (f"\nConvergence: training-loss change < {args.threshold:g} for {args.patience} consecutive rounds. "
            "Metrics are at convergence; `*`: some seeds did not converge and use their last model. "
            f"Time is virtual and includes augmentation; 'All rounds' is the virtual time of all {args.rounds} "
            "rounds.\n")
    (out / "dafl_table.md").write_text(header + table + note)
    (out / "dafl_results.json").write_text(json.dumps(
        {"settings": settings, "provenance": provenance(args.threads),
         "tables": {c: t.tolist() for c, t in tables.items()},
         "summary": summarise(results, cases, methods), "runs": results}, indent=1) + "\n")
    print(table + note)
    return 0


def _run_seed(args: argparse.Namespace, table: NDArray[np.int64], methods: list[Method], seed: int,
              case: str) -> list[dict[str, Any]]:
    """Every method on one (case, seed), in order, with progress lines on stderr."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    results = []
    for m in methods:
        r = run_one(args, table, m, seed, case)
        results.append(r)
        if not args.quiet:
            rounds = r["rounds"] if r["converged"] else f"n/c>{args.rounds}"
            print(f"{case} seed {seed} {m.label:8s} rounds {rounds} minority F1 "
                  f"{r['minority_f1']:.3f} acc {r['accuracy']:.3f} macro F1 {r['macro_f1']:.3f} "
                  f"added {r['added']} ({r['wall_time_s']:.0f} wall s)", file=sys.stderr, flush=True)
    return results


def provenance(threads: int | None) -> dict[str, Any]:
    """What the numbers depend on besides the settings: code version, torch, threads, Python."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                    cwd=Path(__file__).parent, capture_output=True, text=True, timeout=10,
                                    check=True).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {"commit": commit, "dirty": dirty, "torch": torch.__version__,
            "threads": threads if threads is not None else torch.get_num_threads(),
            "python": platform.python_version(), "numpy": np.__version__}


def _cases(spec: str) -> list[str]:
    cases = [c.strip().upper() for c in spec.split(",") if c.strip()]
    if not cases:
        raise ValueError("--dataset-case names no partition")
    for c in cases:
        if c not in DATASET_NAMES:
            raise ValueError(f"unknown partition {c!r}; expected one of {', '.join(DATASET_NAMES)}")
    return cases


def _check(args: argparse.Namespace) -> None:
    for name in ("rounds", "batch_size", "epochs", "patience"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("lr", "seconds_per_sample", "threshold"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0")
    if args.threads is not None and args.threads < 1:
        raise ValueError("--threads must be >= 1")
    if args.jobs < 1:
        raise ValueError("--jobs must be >= 1")
    if not args.seeds:
        raise ValueError("--seeds needs at least one seed")


def _configure(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("data and model")
    d.add_argument("--dataset-case", default="D2", help="Table II partition(s), comma-separated (D1-D6)")
    d.add_argument("--dataset", choices=("cifar10", "digits", "fashion_mnist"), default="cifar10",
                   help="cifar10 as in the paper; the others for quick checks (first 8 classes kept)")
    d.add_argument("--root", default=DEFAULT_ROOT, help="CIFAR-10 image folder or .tar.gz (default: %(default)s)")
    d.add_argument("--scale", type=float, default=1.0, help="multiply the partition's counts (default: %(default)s)")
    d.add_argument("--model", choices=("small_cnn", "felix_cnn", "mlp"), default="small_cnn")
    t = p.add_argument_group("training")
    t.add_argument("--rounds", type=int, default=60, help="FedAvg rounds per run (default: %(default)s)")
    t.add_argument("--lr", type=float, default=0.05)
    t.add_argument("--batch-size", type=int, default=64, help="local batch size (paper: 64)")
    t.add_argument("--epochs", type=int, default=2, help="local epochs per round (paper: 2)")
    t.add_argument("--seconds-per-sample", type=float, default=0.01,
                   help="virtual training seconds per client sample per round (default: %(default)s)")
    t.add_argument("--device", default="cpu")
    t.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    t.add_argument("--jobs", type=int, default=1, help="(case, seed) pairs run in parallel processes (default: 1)")
    m = p.add_argument_group("methods")
    m.add_argument("--methods", default=",".join(METHOD_NAMES), help="comma list from %(default)s")
    m.add_argument("--lambda2", type=float, default=100.0, help="DAFL's augmentation-time weight (paper: 100)")
    m.add_argument("--augmenter", default="rotate_flip", help="augmentation for LB and DAFL (default: %(default)s)")
    m.add_argument("--mu", type=float, default=0.01, help="FedProx mu")
    m.add_argument("--gamma", type=float, default=2.0, help="focal-loss gamma")
    c = p.add_argument_group("convergence rule")
    c.add_argument("--threshold", type=float, default=1e-3, help="training-loss change (paper: 0.001)")
    c.add_argument("--patience", type=int, default=5, help="consecutive rounds (paper: 5)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run per seed; cells show mean ± std")
    p.add_argument("--out", default="runs/dafl-experiment", help="output folder (default: %(default)s)")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-run progress lines")
    p.set_defaults(func=run)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``felix dafl-experiment`` on the CLI's subparsers; dispatch via ``args.func``."""
    p = subparsers.add_parser(COMMAND, help="the DAFL paper's Table IV/V experiment on the simulator",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _configure(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point (``python -m felix.experiments.dafl``)."""
    p = argparse.ArgumentParser(prog="python -m felix.experiments.dafl", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _configure(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
