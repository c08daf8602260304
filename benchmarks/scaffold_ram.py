"""Why SCAFFOLD diverges under the Random Access Model: per-round control-variate norms and staleness.

Runs the ``scaffold`` variant of ``configs/comparisons/federage.yaml`` through the engine on the
former default comparison scenario (small CNN, Fashion-MNIST long tail with head/tail 20,
Dirichlet 0.1 split, Beta participation coupled to data rarity; ``COUPLED`` below, changeable
with ``--set``) and records, for every task, the staleness of the client's control (RAM rounds
since its last task; -1 for a first task), ``||c||``, ``||c_i||`` before and after,
``||c - c_i||`` and the norm of the client's update. Prints the rounds around the blow-up and a
summary: the round the model turns non-finite, and the staleness and control norms of the
largest updates.

    PYTHONPATH=src python benchmarks/scaffold_ram.py --seed 0 [--set client.lr=0.02]
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
from felix.engine.run import run_config
from felix.experiments.compare import load_comparison, variant_config
from felix.experiments.shipped import COMPARISONS
from felix.sim.build import Built
from felix.strategies import objectives

COUPLED = [
    "model=small_cnn",
    "partition.kind=dirichlet",
    "partition.imbalance=20",
    "trace.ram.p_dist=beta",
    "trace.ram.coupling=rarity",
    "run.rare_p=null",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override (repeatable)"
    )
    args = parser.parse_args(argv)
    cfg = variant_config(
        load_comparison(COMPARISONS / "federage.yaml"), "scaffold", parse_set(COUPLED + args.set), args.seed
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
    summary = {
        "lr": cfg.client.lr,
        "rounds": int(cfg.trace.horizon_s // slot),
        "seed": args.seed,
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
        "corr_update_vs_correction": float(np.corrcoef(upd, [x["correction"] for x in finite])[0, 1]),
        "corr_update_vs_staleness_returning": float(np.corrcoef(upd[returning], stale[returning])[0, 1]),
        "mean_client_acc": pc["mean_client_acc"],
    }
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
