"""``felix compare``: several strategies on exactly the same scenario, one table and shared plots.

Every strategy gets the same config apart from its preset, and the scenario's random streams do
not depend on the strategy (see ``build``), so partitions, traces and runtimes are identical.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from felix.config import Config, ConfigError
from felix.engine.run import resolve_config
from felix.experiments.runs import RunSpec, close_backend, make_backend, run_all
from felix.metrics.report import plot_curves


def compare(config_path: str | None, strategies: list[str], sets: dict[str, Any], out_dir: Path,
            scenario: str | None = None, jobs: int | None = None, reference: str | None = None, backend: str = "local",
            address: str | None = None, force: bool = False, gpus_per_run: float = 1.0) -> dict[str, Any]:
    """Run every strategy (skipping those already finished under ``out_dir`` unless ``force``) on
    ``backend`` (see ``felix.experiments.runs.make_backend``), then tabulate and plot those that succeeded."""
    if reference is not None and reference not in strategies:
        raise ConfigError(f"--reference {reference!r} is not one of the compared strategies {strategies}")
    configs = [resolve_config(config_path, s, sets, scenario) for s in strategies]
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    if backend == "local" and (jobs or 1) > 1 and any(not str(c.run.device).startswith("cpu") for c in configs):
        # Processes time-slicing one GPU each run several times slower: one process, one run at a
        # time, keeps the device busy (each run trains its clients in cohorts).
        print(f"felix compare: --jobs {jobs} ignored on {configs[0].run.device}: strategies run one after "
              "another in this process", file=sys.stderr)
        jobs = 1
    specs = [RunSpec(s, cfg, out_dir / _slug(s)) for s, cfg in zip(strategies, configs)]
    runner = make_backend(backend, jobs, address, gpus_per_run)
    try:
        outcome = run_all(specs, runner, force)
    finally:
        close_backend(runner)
    results = {s: (o.summary, o.rows) for s, o in outcome.outputs.items()}
    summaries = {s: r[0] for s, r in results.items()}
    if not summaries:
        return {"scenario": configs[0].name, "seed": configs[0].seed, "reference": None, "strategies": {},
                "failed": outcome.failed}
    wanted = reference or ("felix" if "felix" in summaries else None)
    ref = wanted if wanted in summaries else next(iter(summaries))  # a failed reference falls back
    doc = {"scenario": configs[0].name, "seed": configs[0].seed, "reference": ref, "strategies": summaries,
           "failed": outcome.failed}
    (out_dir / "comparison.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    (out_dir / "comparison.md").write_text(markdown_table(summaries, ref, configs[0]))
    target = configs[0].run.target_accuracy
    plot_curves(out_dir, {s: r[1] for s, r in results.items()}, target, prefix="comparison_")
    bar_plots(out_dir, summaries)
    return doc


def _slug(name: str) -> str:
    return name.replace("*", "-oracle").replace("+", "-")


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.1f}"


def markdown_table(summaries: dict[str, dict[str, Any]], ref: str, cfg: Config) -> str:
    r = summaries[ref]
    lines = [
        (f"# {cfg.name}: target accuracy {cfg.run.target_accuracy} (mean of last {cfg.run.target_window} "
         f"evaluations), seed {cfg.seed}"),
        "",
        f"Speed-up = time to target of the strategy / time to target of {ref} (how much faster {ref} is).",
        "",
        "| strategy | time to target (s) | speed-up of " + ref + " | MB to target | total MB | train MB down/up "
        "| eval MB down/up | control MB | aggregations | updates applied | discarded | dropped mid-task "
        "| agg. interval P50/P95 (s) | staleness mean | final acc |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summaries.items():
        ttt = s["time_to_target_s"]
        if ttt is None:
            speed = "∞ (not reached)" if r["time_to_target_s"] is not None else "-"
        elif r["time_to_target_s"] is None:
            speed = "-"
        else:
            speed = f"{ttt / r['time_to_target_s']:.2f}x"
        b = s["bytes_by_kind"]
        d = s["diagnostics"]
        p50, p95 = d["aggregation_interval_p50_s"], d["aggregation_interval_p95_s"]
        stale = "-" if d["staleness_mean"] is None else f"{d['staleness_mean']:.2f}"
        interval = "-" if p50 is None else f"{p50:.0f}/{p95:.0f}"
        lines.append(
            f"| {name} | {'not reached' if ttt is None else round(ttt)} | {speed} | {_mb(s['bytes_to_target'])} "
            f"| {_mb(s['bytes_down'] + s['bytes_up'])} | {_mb(b['down']['train'])}/{_mb(b['up']['train'])} "
            f"| {_mb(b['down']['eval'])}/{_mb(b['up']['eval'])} "
            f"| {_mb(b['down']['control'] + b['up']['control'])} | {s['aggregations']} | {s['updates_applied']} "
            f"| {s['updates_discarded']} | {d['dropped_share']:.1%} "
            f"| {interval} | {stale} | {s['final_accuracy']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def bar_plots(out_dir: Path, summaries: dict[str, dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summaries)
    ttt = [summaries[n]["time_to_target_s"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 4))
    horizon = max(s["virtual_time_s"] for s in summaries.values())
    ax.bar(names, [(t if t is not None else horizon) / 3600 for t in ttt],
           color=["tab:blue" if t is not None else "lightgrey" for t in ttt])
    for i, t in enumerate(ttt):
        if t is None:
            ax.text(i, horizon / 3600, "not\nreached", ha="center", va="bottom", fontsize=7)
    ax.set_ylabel("time to target (h)")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(out_dir / "comparison_time_to_target.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(names)
    for kind, direction, color in (("train", "down", "tab:blue"), ("train", "up", "tab:cyan"),
                                   ("eval", "down", "tab:orange"), ("eval", "up", "tab:red"),
                                   ("control", "down", "grey"), ("control", "up", "black")):
        vals = [summaries[n]["bytes_by_kind"][direction][kind] / 1e6 for n in names]
        ax.bar(names, vals, bottom=bottom, label=f"{kind} {direction}", color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("total MB")
    ax.legend(fontsize=7)
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(out_dir / "comparison_bytes.png", dpi=110)
    plt.close(fig)
