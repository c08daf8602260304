"""``felix sweep``: one scenario over a grid of ``--set`` values, strategies and seeds.

Every point of the grid is one run (a :class:`felix.experiments.runs.RunSpec`) on any backend of
``felix.experiments.runs``; ``sweep.json`` keeps every run's summary and ``sweep.md`` tabulates them, run by run
and as mean and spread over the seeds of each grid point.
"""

from __future__ import annotations

import itertools
import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from felix.config import ConfigError, deep_merge, load_yaml, parse_set
from felix.engine.setup import resolve_config
from felix.experiments.backends import close_backend, make_backend
from felix.experiments.runs import RunSpec, run_all
from felix.metrics.report import make_output_dir


@dataclass(frozen=True)
class Point:
    """One grid point: a strategy (None: the config's own), the swept values and a seed."""

    strategy: str | None
    params: tuple[tuple[str, Any], ...]
    seed: int | None

    @property
    def key(self) -> str:
        parts = [self.strategy or "run", *(f"{k}={_fmt(v)}" for k, v in self.params)]
        if self.seed is not None:
            parts.append(f"seed={self.seed}")
        return "/".join(parts)

    @property
    def group(self) -> str:
        """The key without the seed: the runs whose mean and spread the grouped table shows."""
        return "/".join([self.strategy or "run", *(f"{k}={_fmt(v)}" for k, v in self.params)])


def _fmt(v: Any) -> str:
    return json.dumps(v) if isinstance(v, (list, dict)) else str(v)


def parse_grid(items: list[str]) -> dict[str, list[Any]]:
    """``key=v1,v2,...`` (or a YAML list ``key=[v1, v2]``) into key -> values, each parsed as YAML 1.2
    like ``--set`` values (``trace.series=2,3_75`` is two strings)."""
    grid: dict[str, list[Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or not raw.strip():
            raise ConfigError(f"--grid expects key=v1,v2,..., got {item!r}")
        text = raw.strip()
        try:
            values = load_yaml(text if text.startswith("[") else f"[{text}]")
        except yaml.YAMLError as exc:
            raise ConfigError(f"--grid {key}: cannot parse values {raw!r} ({exc})") from None
        if not isinstance(values, list) or not values:
            raise ConfigError(f"--grid {key}: expected a list of values, got {raw!r}")
        if key in grid:
            raise ConfigError(f"--grid {key} given twice")
        grid[key] = values
    return grid


def points(strategies: list[str | None], grid: dict[str, list[Any]], seeds: list[int | None]) -> list[Point]:
    combos = list(itertools.product(*grid.values())) if grid else [()]
    return [Point(s, tuple(zip(grid, combo)), seed) for s in strategies for combo in combos for seed in seeds]


def _dirname(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=,-]", "_", key.replace("*", "-oracle").replace("+", "-").replace("/", "__"))


def specs_for(
    config_path: str | None, scenario: str | None, sets: dict[str, Any], pts: list[Point], out_dir: Path
) -> list[RunSpec]:
    """Validate every point's config up front, so a bad value fails before anything runs."""
    specs = []
    for p in pts:
        over = sets
        for k, v in p.params:
            over = deep_merge(over, parse_set([f"{k}={json.dumps(v)}"]))
        if p.seed is not None:
            over = deep_merge(over, {"seed": p.seed})
        cfg = resolve_config(config_path, p.strategy, over, scenario)
        specs.append(RunSpec(p.key, cfg, out_dir / _dirname(p.key)))
    return specs


def sweep(
    config_path: str | None,
    scenario: str | None,
    sets: dict[str, Any],
    strategies: list[str | None],
    grid: dict[str, list[Any]],
    seeds: list[int | None],
    out_dir: Path,
    backend: str = "local",
    jobs: int | None = None,
    address: str | None = None,
    force: bool = False,
    gpus_per_run: float = 1.0,
) -> dict[str, Any]:
    pts = points(strategies, grid, seeds)
    out_dir = out_dir.resolve()
    specs = specs_for(config_path, scenario, sets, pts, out_dir)
    make_output_dir(out_dir)
    runner = make_backend(backend, jobs, address, gpus_per_run)
    try:
        outcome = run_all(specs, runner, force)
    finally:
        close_backend(runner)
    runs = []
    for p, s in zip(pts, specs):
        if p.key in outcome.outputs:
            runs.append(
                {
                    "key": p.key,
                    "group": p.group,
                    "strategy": s.config.strategy,
                    "params": dict(p.params),
                    "seed": s.config.seed,
                    "out_dir": s.out_dir.name,
                    "summary": outcome.outputs[p.key].summary,
                }
            )
    doc = {
        "scenario": specs[0].config.name,
        "grid": grid,
        "seeds": [s.config.seed for s in specs[: len(seeds)]],
        "runs": runs,
        "failed": outcome.failed,
        "skipped": outcome.skipped,
        "interrupted": outcome.interrupted,
    }
    (out_dir / "sweep.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    (out_dir / "sweep.md").write_text(markdown(doc))
    return doc


def _mean_sd(xs: list[float]) -> str:
    if not xs:
        return "-"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.fmean(xs):.4g} ± {sd:.2g}"


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"# Sweep of {doc['scenario']}: {len(doc['runs'])} runs", ""]
    if doc["failed"]:
        lines += ["Failed (after one retry): " + "; ".join(f"{k}: {v}" for k, v in doc["failed"].items()), ""]
    lines += [
        (
            "| grid point | seeds | final acc (mean ± sd) | time to target s (mean ± sd) | reached target "
            "| total MB (mean ± sd) |"
        ),
        "|---|---|---|---|---|---|",
    ]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in doc["runs"]:
        groups.setdefault(r["group"], []).append(r["summary"])
    for g, ss in groups.items():
        ttt = [s["time_to_target_s"] for s in ss if s["time_to_target_s"] is not None]
        acc = [s["final_accuracy"] for s in ss if s["final_accuracy"] is not None]
        mb = [(s["bytes_down"] + s["bytes_up"]) / 1e6 for s in ss]
        lines.append(
            f"| {g} | {len(ss)} | {_mean_sd(acc)} | {_mean_sd(ttt)} | {len(ttt)}/{len(ss)} | {_mean_sd(mb)} |"
        )
    lines += [
        "",
        "| run | time to target (s) | final acc | aggregations | total MB | wall s |",
        "|---|---|---|---|---|---|",
    ]
    for r in doc["runs"]:
        s = r["summary"]
        t_txt = "not reached" if s["time_to_target_s"] is None else f"{s['time_to_target_s']:.0f}"
        a_txt = "-" if s["final_accuracy"] is None else f"{s['final_accuracy']:.4f}"
        lines.append(
            f"| {r['key']} | {t_txt} | {a_txt} | {s['aggregations']} | "
            f"{(s['bytes_down'] + s['bytes_up']) / 1e6:.1f} | {s['wall_time_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"
