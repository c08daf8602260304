"""Why SCAFFOLD diverges under the Random Access Model: per-round control-variate norms and staleness.

Runs the ``felix federage-compare`` round loop for SCAFFOLD alone (same scenario, same RAM draws,
same batch orders) and records, for every task, the staleness of the client's control (rounds
since its last task; -1 for a first task), ``||c||``, ``||c_i||`` before and after, ``||c - c_i||``
and the norm of the client's update. Prints the rounds around the blow-up and a summary:
the round the model turns non-finite, and the staleness and control norms of the largest updates.

    PYTHONPATH=src python benchmarks/scaffold_ram.py --rounds 100 --seeds 0 [--lr 0.02] [federage-compare flags]
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np
import torch

from felix.experiments import federage
from felix.strategies import objectives


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    federage._configure(parser)
    args = parser.parse_args(argv)
    federage._check(args)
    torch.set_num_threads(args.threads)
    seed = int(args.seeds[0])
    scenario = federage.build_scenario(args, seed)
    participation = federage.RandomAccessModel(scenario.probabilities).draw_rounds(
        args.rounds, np.random.default_rng([seed, 1]))
    tasks: list[dict[str, Any]] = []
    end = objectives.Scaffold.end

    def logged_end(self: objectives.Scaffold, ctx: objectives.TaskContext) -> None:
        end(self, ctx)
        with torch.no_grad():
            y = torch.nn.utils.parameters_to_vector(ctx.model.parameters())
            tasks.append({"c": float(self._c.norm()), "ci_old": float(self._ci.norm()),
                          "ci_new": float(np.linalg.norm(ctx.state["scaffold_ci"])),
                          "correction": float((self._c - self._ci).norm()),
                          "update": float((ctx.global_params - y).norm())})

    objectives.Scaffold.end = logged_end  # type: ignore[method-assign]
    last_seen: dict[int, int] = {}
    rows = []
    for r, mask in enumerate(participation):
        for cid in np.flatnonzero(mask):
            rows.append({"round": r, "client": int(cid), "staleness": r - last_seen.get(int(cid), r + 1)})
            last_seen[int(cid)] = r
    method = federage.Method("scaffold", "scaffold", {"num_clients": args.clients})
    res = federage.run_method(method, scenario, participation, args, seed, log=False)
    objectives.Scaffold.end = end  # type: ignore[method-assign]
    for row, t in zip(rows, tasks):
        row.update(t)
    by_round: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_round.setdefault(row["round"], []).append(row)
    blowup = next((r for r, rs in sorted(by_round.items()) if not all(np.isfinite(x["update"]) for x in rs)), None)
    print("round  tasks  max||c||  max||c-c_i||  max||c_i new||  max update  (staleness of the largest update)")
    for r, rs in sorted(by_round.items()):
        if blowup is not None and not (blowup - 12 <= r <= blowup) and r % 10:
            continue
        big = max(rs, key=lambda x: x["update"] if np.isfinite(x["update"]) else np.inf)
        print(f"{r:5d}  {len(rs):5d}  {max(x['c'] for x in rs):8.3g}  {max(x['correction'] for x in rs):12.3g}  "
              f"{max(x['ci_new'] for x in rs):14.3g}  {big['update']:10.3g}  ({big['staleness']})")
    finite = [x for x in rows if np.isfinite(x["update"]) and (blowup is None or x["round"] < blowup)]
    upd = np.array([x["update"] for x in finite])
    stale = np.array([x["staleness"] for x in finite])
    top = np.argsort(-upd)[:max(1, len(upd) // 50)]  # the largest 2% of updates before the blow-up
    returning = stale >= 0
    summary = {
        "lr": args.lr, "rounds": args.rounds, "seed": seed, "finite_model": res["finite_model"],
        "first_non_finite_round": blowup,
        "median_update": float(np.median(upd)), "top2pct_update_min": float(upd[top].min()),
        "median_staleness_returning": float(np.median(stale[returning])),
        "median_staleness_top2pct": float(np.median(stale[top])),
        "top2pct_first_tasks": int((stale[top] < 0).sum()), "top2pct_tasks": len(top),
        "median_c_norm": float(np.median([x["c"] for x in finite])),
        "median_correction_norm": float(np.median([x["correction"] for x in finite])),
        "corr_update_vs_correction": float(np.corrcoef(upd, [x["correction"] for x in finite])[0, 1]),
        "corr_update_vs_staleness_returning": float(np.corrcoef(upd[returning], stale[returning])[0, 1]),
        "mean_client_acc": res["mean_client_acc"],
    }
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
