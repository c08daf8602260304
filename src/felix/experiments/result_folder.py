"""Our side of ``felix report``: a comparison folder as the report reads it (``comparison.json``
and ``manifest.json``), and what it reads from the folder's runs beyond the per-target
statistics: the update weights (the paper's Fig. 15) and a server-lr grid's tuning criterion."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from felix.config import ConfigError
from felix.core.key_aliases import renamed
from felix.experiments.paper_catalog import HIGH_WEIGHT


@dataclass
class Folder:
    """One comparison folder as the report reads it."""

    path: Path
    name: str
    description: str
    reference: str
    targets: list[float]
    seeds: list[int]
    stats: dict[str, dict[str, Any]]
    manifest: dict[str, Any] = field(default_factory=dict)
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)
    target_window: int | None = None  # the evaluations a target's mean is over
    #: Later folders of the same comparison combined into this one (``combine_folders``): their
    #: variants replace this folder's of the same name; each keeps its own manifest.
    more: tuple[Folder, ...] = ()

    def spread(self, variant: str, target: float, key: str) -> dict[str, Any] | None:
        per = self.stats.get(variant, {}).get(f"{target:g}")
        return None if per is None else per.get(key)

    def ran_on(self) -> str:
        """What its runs trained (datasets and models, from the manifest's configs), e.g.
        ``digits / mlp``; "" for a folder without a manifest."""
        cfgs = [r.get("config") or {} for r in self.manifest.get("runs", {}).values()]
        pairs = sorted(
            {f"{(c.get('dataset') or {}).get('name', '?')} / {c.get('model', '?')}" for c in cfgs if c}
        )
        return ", ".join(pairs)

    def mean(self, variant: str, target: float, key: str) -> float | None:
        s = self.spread(variant, target, key)
        return None if s is None else s.get("mean")


def combine_folders(folders: Sequence[Folder]) -> list[Folder]:
    """One folder per comparison name, in first-seen order: a comparison run in parts (some
    variants rerun into another output folder) reads as one, each later part's variants replacing
    the earlier parts' of the same name. Parts must agree on the targets and the target rule."""
    by_name: dict[str, Folder] = {}
    for f in folders:
        first = by_name.get(f.name)
        if first is None:
            by_name[f.name] = f
            continue
        if first.targets != f.targets or first.target_window != f.target_window:
            raise ConfigError(
                f"{f.path}: comparison {f.name!r} has other targets or target rule than {first.path}; "
                "give parts of one comparison only"
            )
        by_name[f.name] = replace(
            first,
            stats={**first.stats, **f.stats},
            runs={**first.runs, **f.runs},
            seeds=sorted({*first.seeds, *f.seeds}),
            more=(*first.more, f),
        )
    return list(by_name.values())


def read_folder(path: Path) -> Folder:
    """A folder ``felix compare`` wrote; a clear one-line error for anything else."""
    cj = path / "comparison.json"
    if not path.is_dir():
        raise ConfigError(f"{path}: no such folder")
    if not cj.is_file():
        raise ConfigError(f"{path}: no comparison.json (give folders written by felix compare)")
    try:
        doc = json.loads(cj.read_text())
        manifest = (
            json.loads((path / "manifest.json").read_text()) if (path / "manifest.json").is_file() else {}
        )
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ConfigError(f"{path}: unreadable result file ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("stats"), dict) or not doc.get("targets"):
        raise ConfigError(f"{cj}: not a comparison result (no 'stats' or 'targets')")
    targets, seeds = doc["targets"], doc.get("seeds") or []
    if not isinstance(targets, list) or not all(_is_number(t) for t in targets):
        raise ConfigError(f"{cj}: 'targets' is not a list of numbers")
    if not isinstance(seeds, list) or not all(_is_count(s) for s in seeds):
        raise ConfigError(f"{cj}: 'seeds' is not a list of integers")
    _check_stats(doc["stats"], cj)
    return Folder(
        path=path,
        name=str(doc.get("name") or path.name),
        description=str(doc.get("description") or ""),
        reference=str(doc.get("reference") or ""),
        targets=[float(t) for t in targets],
        seeds=list(seeds),
        stats=doc["stats"],
        manifest=manifest if isinstance(manifest, dict) else {},
        runs=runs if isinstance(runs := doc.get("runs"), dict) else {},
        target_window=window if isinstance(window := doc.get("target_window"), int) else None,
    )


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_stats(stats: dict[str, Any], cj: Path) -> None:
    """``stats`` as ``felix compare`` writes it, variant -> target -> metric -> spread, each spread
    with counts ``n`` <= ``of`` and numbers (or null, where no seed reached the target) for the
    rest, so that a hand-edited file stops the report with the one entry at fault, not deep inside
    a table."""
    for variant, per_target in stats.items():
        if not isinstance(per_target, dict):
            raise ConfigError(f"{cj}: stats[{variant!r}] is not an object of targets")
        for target, metrics in per_target.items():
            if not isinstance(metrics, dict):
                raise ConfigError(f"{cj}: stats[{variant!r}][{target!r}] is not an object of metrics")
            for metric, spread in metrics.items():
                where = f"stats[{variant!r}][{target!r}][{metric!r}]"
                if not isinstance(spread, dict):
                    raise ConfigError(f"{cj}: {where} is not an object")
                for key, value in spread.items():
                    whole = key in ("n", "of")
                    if not (_is_count(value) if whole else value is None or _is_number(value)):
                        kind = "a count" if whole else "a number or null"
                        raise ConfigError(f"{cj}: {where}[{key!r}] is {value!r}, not {kind}")
                if spread.get("n", 0) > spread.get("of", spread.get("n", 0)):
                    raise ConfigError(f"{cj}: {where} counts more seeds reaching it than it ran")


@dataclass(frozen=True)
class UpdateWeights:
    """One variant's update weights w_i, mean over its seeds: the 5th, 50th and 95th percentile
    and, from runs that record every percentile (``agg_weight_percentiles``), the whole
    distribution (percentiles 0-100) and each seed's share of updates weighted ``HIGH_WEIGHT`` or
    more (to 1%)."""

    p5: float
    p50: float
    p95: float
    percentiles: tuple[float, ...] = ()
    share_high: tuple[float, ...] = ()  # one per seed

    @property
    def share_text(self) -> str:
        if not self.share_high:
            return "-"
        mean = sum(self.share_high) / len(self.share_high)
        if len(self.share_high) < 2:
            return f"{mean:.0%}"
        std = math.sqrt(sum((v - mean) ** 2 for v in self.share_high) / (len(self.share_high) - 1))
        return f"{mean:.0%} ± {std:.0%}"


def raw_weights(folder: Folder) -> dict[str, UpdateWeights]:
    """The update weights w_i of each async variant that divides by the buffer size: there the
    recorded weights, w_i / K, times K are the w_i themselves (under the sum of the weights their
    scale is lost, so those variants are left out). From each run's ``diagnostics`` and the
    configs in the manifest."""
    configs: dict[str, dict[str, Any]] = {}
    for run in (folder.manifest.get("runs") or {}).values():
        if isinstance(run, dict) and isinstance(run.get("config"), dict):
            configs.setdefault(str(run.get("variant")), run["config"])
    out: dict[str, UpdateWeights] = {}
    for variant, per_seed in folder.runs.items():
        cfg = renamed(configs.get(variant) or {})  # a manifest written before a key was renamed, too
        orch, agg = cfg.get("orchestrator") or {}, cfg.get("aggregator") or {}
        if orch.get("round_policy") != "async" or agg.get("normalize") != "count" or not per_seed:
            continue
        k = float(orch.get("agg_goal") or 0)
        rows = [(r.get("diagnostics") or {}) for r in per_seed.values() if isinstance(r, dict)]
        pct: list[list[float]] = []
        for q in (5, 50, 95):
            col = [d.get(f"agg_weight_p{q}") for d in rows]
            pct.append([float(v) for v in col if isinstance(v, (int, float))])
        if not (k > 0 and rows and all(len(col) == len(rows) for col in pct)):
            continue
        p5, p50, p95 = (k * sum(col) / len(col) for col in pct)
        curves = [d.get("agg_weight_percentiles") for d in rows]
        if all(isinstance(c, list) and len(c) == 101 for c in curves):
            scaled = [[k * float(v) for v in c] for c in curves if isinstance(c, list)]
            mean_curve = tuple(sum(c[i] for c in scaled) / len(scaled) for i in range(101))
            shares = tuple(sum(v >= HIGH_WEIGHT for v in c) / len(c) for c in scaled)
            out[variant] = UpdateWeights(p5, p50, p95, mean_curve, shares)
        else:
            out[variant] = UpdateWeights(p5, p50, p95)
    return out


_LR_VARIANT = re.compile(r"^(?P<family>.+)-lr(?P<lr>[0-9]+(?:\.[0-9]+)?)$")


@dataclass(frozen=True)
class TuningScore:
    """One variant's tuning criterion and what it is made of."""

    score: float  # mean over the targets of ``times``
    times: tuple[float, ...]  # per target: the seed-mean time, a seed that missed it counted at the cap
    missed: int  # (seed, target) pairs not reached
    runs: int  # seeds x targets
    bytes_last: float | None  # mean bytes to the highest target over the seeds that reached it


@dataclass(frozen=True)
class GridPoint(TuningScore):
    """One server learning rate of a tuning grid: its variant's tuning criterion."""

    lr: float


def tuning_scores(folder: Folder) -> dict[str, TuningScore]:
    """The tuning criterion of every variant whose runs' ``run.max_time_s`` the manifest records.

    The criterion is the mean over the targets of the seed-mean time to the target, where a seed that
    never reached it counts as its run's ``run.max_time_s``, so that a setting that misses a target
    is ranked by how long it was given, not by the seeds that made it. It is computed from the
    folder's statistics alone (mean over the seeds that reached the target, and how many did), so a
    committed folder without its runs' evaluation tables still has it."""
    caps: dict[str, float] = {}
    for run in (folder.manifest.get("runs") or {}).values():
        if isinstance(run, dict) and isinstance(run.get("config"), dict):
            cap = (run["config"].get("run") or {}).get("max_time_s")
            if isinstance(cap, (int, float)):
                caps.setdefault(str(run.get("variant")), float(cap))
    out: dict[str, TuningScore] = {}
    for variant in folder.stats:
        if variant not in caps:
            continue
        cap, times, missed, runs = caps[variant], [], 0, 0
        for t in folder.targets:
            s = folder.spread(variant, t, "time_s") or {}
            n, of = int(s.get("n") or 0), int(s.get("of") or 0)
            if of == 0:
                break
            mean = float(s["mean"]) if n else 0.0
            times.append((mean * n + cap * (of - n)) / of)
            missed, runs = missed + of - n, runs + of
        if len(times) == len(folder.targets):
            out[variant] = TuningScore(
                sum(times) / len(times),
                tuple(times),
                missed,
                runs,
                folder.mean(variant, folder.targets[-1], "bytes_total"),
            )
    return out


def lr_grid(folder: Folder) -> dict[str, list[GridPoint]]:
    """The tuning criterion (``tuning_scores``) of every variant named ``<family>-lr<value>`` (a
    server-lr grid, as in ``felix-lr-tune-<trace>``), by family, lr ascending; families with one
    point are left out."""
    out: dict[str, list[GridPoint]] = {}
    for variant, score in tuning_scores(folder).items():
        m = _LR_VARIANT.match(variant)
        if m is not None:
            out.setdefault(m["family"], []).append(GridPoint(**asdict(score), lr=float(m["lr"])))
    return {f: sorted(points, key=lambda p: p.lr) for f, points in out.items() if len(points) > 1}


def best_point(points: Sequence[GridPoint]) -> GridPoint:
    """The grid point with the lowest criterion; ties by the fewer bytes to the highest target."""
    return min(points, key=lambda p: (p.score, math.inf if p.bytes_last is None else p.bytes_last))


#: The run diagnostics the report shows per variant (``diagnostics`` in each run's summary.json),
#: with their labels; a folder made before a field existed shows it as missing.
DIAGNOSTICS: tuple[tuple[str, str], ...] = (
    ("aggregation_interval_p50_s", "time between aggregations P50 (s)"),
    ("aggregation_interval_p95_s", "time between aggregations P95 (s)"),
    ("aggregator_stall_share", "aggregator stall share of the run"),
    ("aggregator_stall_p95_s", "stall per interval P95 (s)"),
    ("staleness_p50", "staleness P50 (versions)"),
    ("staleness_mean", "staleness mean (versions)"),
    ("staleness_p95", "staleness P95 (versions)"),
    ("utility_age_at_selection_p50", "utility age at selection P50 (rounds)"),
    ("utility_age_at_selection_mean", "utility age at selection mean (rounds)"),
    ("dropped_share", "selections dropped mid-task"),
    ("selected_utility_p50", "utility of the clients picked to train P50"),
    ("selected_compute_s_p50", "compute time of the clients picked to train P50 (s)"),
)


def run_diagnostics(folder: Folder) -> dict[str, dict[str, list[float]]]:
    """Each variant's ``DIAGNOSTICS`` over its seeds: variant -> field -> one value per seed that
    recorded it (a field no seed recorded is left out; a variant without any, too)."""
    out: dict[str, dict[str, list[float]]] = {}
    for variant, per_seed in folder.runs.items():
        rows = [r.get("diagnostics") or {} for r in per_seed.values() if isinstance(r, dict)]
        fields_ = {
            key: [float(d[key]) for d in rows if isinstance(d.get(key), (int, float))]
            for key, _ in DIAGNOSTICS
        }
        kept = {k: v for k, v in fields_.items() if v}
        if kept:
            out[variant] = kept
    return out
