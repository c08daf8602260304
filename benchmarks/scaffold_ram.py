"""Why SCAFFOLD diverges under the Random Access Model: per-round control-variate norms and staleness.

Runs the ``scaffold`` variant of ``configs/comparisons/federage.yaml`` through the engine on the
former default comparison scenario (small CNN, Fashion-MNIST long tail with head/tail 20,
Dirichlet 0.1 split, Beta participation coupled to data rarity; ``COUPLED`` below, changeable
with ``--set``) and records, for every task, the staleness of the client's control (RAM rounds
since its last task; -1 for a first task), ``||c||``, ``||c_i||`` before and after,
``||c - c_i||`` and the norm of the client's update. Prints, per seed, the rounds around the
blow-up and a summary (the round an update first turns non-finite, the staleness and control norms
of the largest updates), then one table over the seeds: each seed's row and the mean ± sample std.

    PYTHONPATH=src python benchmarks/scaffold_ram.py --seeds 0 1 2 [--set client.lr=0.02]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np
import torch

from felix.client.trainer import LocalTrainer
from felix.config import parse_set
from felix.experiments.compare import load_comparison, variant_config
from felix.experiments.shipped import COMPARISONS
from felix.sim.build import Built
from felix.sim.run import run_config
from felix.strategies import objectives

COUPLED = [
    "model=small_cnn",
    "partition.kind=dirichlet",
    "partition.imbalance=20",
    "trace.ram.p_dist=beta",
    "trace.ram.coupling=rarity",
    "run.rare_p=null",
]


def rank_corr(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rank correlation (no ties expected in float norms): the update norms are heavy
    tailed near a blow-up, where Pearson's correlation is set by a handful of values."""
    return float(np.corrcoef(np.argsort(np.argsort(x)), np.argsort(np.argsort(y)))[0, 1])


def run_seed(seed: int, sets: list[str]) -> dict[str, Any]:
    """One SCAFFOLD run on the coupled scenario with per-task logging; prints the trace, returns the summary."""
    cfg = variant_config(
        load_comparison(COMPARISONS / "federage.yaml"), "scaffold", parse_set(COUPLED + sets), seed
    )
    torch.set_num_threads(cfg.run.threads or 1)
    slot = cfg.trace.slot_s
    tasks: list[dict[str, Any]] = []
    end, train = objectives.Scaffold.end, LocalTrainer.train
    clients: dict[int, int] = {}
    built_ref: list[Built] = []

    def logged_end(self: objectives.Scaffold, ctx: objectives.TaskContext) -> None:
        end(self, ctx)
        with torch.no_grad():
            y = torch.nn.utils.parameters_to_vector(ctx.model.parameters())
            tasks[-1].update(
                {
                    "c": float(self._c.norm()),
                    "ci_old": float(self._ci.norm()),
                    "ci_new": float(np.linalg.norm(ctx.state["scaffold_ci"])),
                    "correction": float((self._c - self._ci).norm()),
                    "update": float((ctx.global_params - y).norm()),
                }
            )

    def logged_train(self: LocalTrainer, weights: np.ndarray, data: Any, *rest: Any) -> Any:
        tasks.append({"round": int(built_ref[0].sim.now // slot), "client": clients[id(data)]})
        return train(self, weights, data, *rest)

    def prepare(built: Built) -> None:
        built_ref.append(built)
        clients.update({id(d): k for k, d in enumerate(built.population.client_data)})

    objectives.Scaffold.end = logged_end  # type: ignore[method-assign]
    LocalTrainer.train = logged_train  # type: ignore[method-assign]
    try:
        res = run_config(cfg, prepare=prepare)
    finally:
        objectives.Scaffold.end = end  # type: ignore[method-assign]
        LocalTrainer.train = train  # type: ignore[method-assign]
    last_seen: dict[int, int] = {}
    rows = []
    for t in tasks:  # a task completes in the slot it was drawn for: its round is the slot's
        t["staleness"] = t["round"] - last_seen.get(t["client"], t["round"] + 1)
        last_seen[t["client"]] = t["round"]
        rows.append(t)
    by_round: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_round.setdefault(row["round"], []).append(row)
    blowup = next(
        (r for r, rs in sorted(by_round.items()) if not all(np.isfinite(x["update"]) for x in rs)), None
    )
    print(
        "round  tasks  max||c||  max||c-c_i||  max||c_i new||  max update  (staleness of the largest update)"
    )
    for r, rs in sorted(by_round.items()):
        if blowup is not None and not (blowup - 12 <= r <= blowup) and r % 10:
            continue
        big = max(rs, key=lambda x: x["update"] if np.isfinite(x["update"]) else np.inf)
        print(
            f"{r:5d}  {len(rs):5d}  {max(x['c'] for x in rs):8.3g}  {max(x['correction'] for x in rs):12.3g}  "
            f"{max(x['ci_new'] for x in rs):14.3g}  {big['update']:10.3g}  ({big['staleness']})"
        )
    finite = [x for x in rows if np.isfinite(x["update"]) and (blowup is None or x["round"] < blowup)]
    upd = np.array([x["update"] for x in finite])
    stale = np.array([x["staleness"] for x in finite])
    top = np.argsort(-upd)[: max(1, len(upd) // 50)]  # the largest 2% of updates before the blow-up
    returning = stale >= 0
    pc = res.summary["per_client"]
    correction = np.array([x["correction"] for x in finite])
    summary = {
        "lr": cfg.client.lr,
        "rounds": int(cfg.trace.horizon_s // slot),
        "seed": seed,
        "finite_model": pc["finite_model"],
        "first_non_finite_round": blowup,
        "median_update": float(np.median(upd)),
        "top2pct_update_min": float(upd[top].min()),
        "median_staleness_returning": float(np.median(stale[returning])),
        "median_staleness_top2pct": float(np.median(stale[top])),
        "top2pct_first_tasks": int((stale[top] < 0).sum()),
        "top2pct_tasks": len(top),
        "median_c_norm": float(np.median([x["c"] for x in finite])),
        "median_correction_norm": float(np.median([x["correction"] for x in finite])),
        "corr_update_vs_correction": float(np.corrcoef(upd, correction)[0, 1]),
        "rank_corr_update_vs_correction": rank_corr(upd, correction),
        "corr_update_vs_staleness_returning": float(np.corrcoef(upd[returning], stale[returning])[0, 1]),
        "rank_corr_update_vs_staleness_returning": rank_corr(upd[returning], stale[returning]),
        "mean_client_acc": pc["mean_client_acc"],
    }
    print(json.dumps(summary, indent=1), flush=True)
    return summary


TABLE = {  # column -> summary key
    "first non-finite round": "first_non_finite_round",
    "median update": "median_update",
    "median ||c - c_i||": "median_correction_norm",
    "median ||c||": "median_c_norm",
    "rank corr(update, ||c - c_i||)": "rank_corr_update_vs_correction",
    "rank corr(update, staleness)": "rank_corr_update_vs_staleness_returning",
    "median staleness, largest 2%": "median_staleness_top2pct",
    "mean client acc": "mean_client_acc",
}


def table(summaries: list[dict[str, Any]]) -> str:
    """Markdown: one row per seed, then mean ± sample std (a round never non-finite counts as none)."""
    lines = ["| seed | " + " | ".join(TABLE) + " |", "|---" * (len(TABLE) + 1) + "|"]
    for s in summaries:
        cells = ["none" if s[k] is None else f"{s[k]:.3g}" for k in TABLE.values()]
        lines.append(f"| {s['seed']} | " + " | ".join(cells) + " |")
    cells = []
    for k in TABLE.values():
        vals = np.array([s[k] for s in summaries if s[k] is not None], dtype=float)
        none = len(summaries) - len(vals)
        spread = f" ± {vals.std(ddof=1):.3g}" if len(vals) > 1 else ""
        cell = f"{vals.mean():.3g}{spread}" if len(vals) else ""
        cells.append(f"{cell} ({none} none)" if none else cell)
    lines.append("| mean ± std | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override (repeatable)"
    )
    args = parser.parse_args(argv)
    summaries = [run_seed(seed, args.set) for seed in args.seeds]
    print(table(summaries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
