"""Same seed, same summary: run every strategy preset (and the data plans) for a few aggregations
and write each summary without its wall-clock fields, so that two trees can be compared.

    PYTHONPATH=<tree>/src python benchmarks/policy_equivalence.py OUT_DIR     # write summaries
    python benchmarks/policy_equivalence.py --compare DIR_A DIR_B             # diff two runs

Used to check that moving the round, availability and data-plan decisions into policies changed
no result.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PRESETS = (
    "fedavg",
    "oort",
    "oort*",
    "oort-async",
    "oort-async*",
    "refl*",
    "felix",
    "fedbuff",
    "felix-no-eval",
    "felix-no-tierfuse",
    "oort-async+tiertrack",
)
PLANS = ("lb", "dafl")


def _strip(summary: dict[str, Any]) -> dict[str, Any]:
    out = {
        k: v for k, v in summary.items() if k not in ("wall_time_s", "provenance")
    }  # wall clock, git state
    if "data_plan" in out:
        out["data_plan"] = {k: v for k, v in out["data_plan"].items() if k != "plan_seconds"}
        out["augmentation"] = {k: v for k, v in out["augmentation"].items() if "wall" not in k}
    return out


def write(out: Path) -> None:
    import torch

    from felix.config import parse_set
    from felix.engine.setup import resolve_config
    from felix.sim.run import run_config

    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    runs: list[tuple[str, str, list[str]]] = [(p, p, ["run.max_aggregations=40"]) for p in PRESETS]
    for plan in PLANS:
        for preset in ("fedavg", "fedbuff", "felix"):
            runs.append(
                (
                    f"{preset}-{plan}",
                    preset,
                    [
                        "run.max_aggregations=10",
                        f"data_plan={plan}",
                        "partition.num_clients=20",
                        "partition.kind=iid",
                    ],
                )
            )
    for name, preset, sets in runs:
        cfg = resolve_config(None, preset, parse_set(sets))
        summ = run_config(cfg, None, plots=False).summary
        (out / f"{name.replace('*', '_star')}.json").write_text(
            json.dumps(_strip(summ), indent=1, sort_keys=True)
        )
        print(name, summ["aggregations"], summ["final_accuracy"], summ["virtual_time_s"], flush=True)


def _load(p: Path) -> dict[str, Any]:
    return _strip(json.loads(p.read_text()))


def compare(a: Path, b: Path) -> int:
    bad = 0
    names = sorted({p.name for p in a.glob("*.json")} | {p.name for p in b.glob("*.json")})
    for name in names:
        pa, pb = a / name, b / name
        if not (pa.exists() and pb.exists()):
            print(f"{name}: missing on one side")
            bad += 1
            continue
        same = _load(pa) == _load(pb)
        print(f"{name}: {'equal' if same else 'DIFFERENT'}")
        bad += not same
    return bad


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        sys.exit(1 if compare(Path(sys.argv[2]), Path(sys.argv[3])) else 0)
    write(Path(sys.argv[1]))
