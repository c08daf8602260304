"""``felix compare``: named variants of one scenario, over several seeds, on exactly the same clients.

A comparison is a base run config plus named variants, each a set of overrides (the comparison
file format of ``configs/comparisons/*.yaml``, described in docs/configs.md); ``felix compare
--strategies a,b`` builds one on the fly, one variant per strategy preset. Every variant x seed is
one run on any backend of ``felix.experiments.runs`` (finished runs are skipped unless ``force``).
The scenario's random streams do not depend on the strategy (see ``build``), so for one seed every
variant sees the same partition, trace and runtimes, and speed-ups are paired by seed.

The report (``felix.metrics.multiseed``): per variant and target, mean, standard deviation and
range over seeds of the time and bytes to the target, how many seeds reached it, and the paired
speed-up of the reference; the per-run details of every seed; zoomed plots with seed bands and
error bars; ``manifest.json`` (command, every run's resolved config, commit, versions, times).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from felix.config import Config, ConfigError, deep_merge, read_yaml, validate
from felix.experiments.backends import close_backend, make_backend
from felix.experiments.runs import Outcome, RunSpec, run_all
from felix.metrics.multiseed import (
    compare_seeds,
    plot_accuracy_vs_bytes,
    plot_comparison,
    stats_json,
    table_markdown,
)
from felix.metrics.provenance import provenance
from felix.metrics.report import make_output_dir
from felix.presets import CONFIG_DIR, comparison_file, scenario_preset, slug, strategy_preset

_FILE_KEYS = ("name", "description", "extends", "base", "variants", "seeds", "targets", "reference")


@dataclass(frozen=True)
class Comparison:
    """A comparison file, read and checked. ``seeds`` / ``targets`` None: not given (the base
    config's seed; its ``run.target_accuracy``)."""

    name: str
    variants: dict[str, dict[str, Any]]
    base: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    seeds: list[int] | None = None
    targets: list[float] | None = None
    reference: str | None = None
    source: str = "command line"


def expand_dotted(tree: dict[str, Any]) -> dict[str, Any]:
    """``{"client.objective": "ce"}`` -> ``{"client": {"objective": "ce"}}``, at every level; keys
    that meet (``client.lr`` and ``client: {epochs: 2}``) merge."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            value = expand_dotted(value)
        parts = str(key).split(".")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {p} is set both as a value and as a section")
        node[parts[-1]] = _merged(node[parts[-1]], value) if parts[-1] in node else value
    return out


def _merged(a: Any, b: Any) -> Any:
    """Two expanded trees as one (every nested mapping merged key by key; otherwise ``b``)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {**a, **{k: _merged(a[k], v) if k in a else v for k, v in b.items()}}
    return b


def _check_seeds(seeds: object, source: str) -> list[int]:
    if (
        not isinstance(seeds, list)
        or not seeds
        or any(isinstance(s, bool) or not isinstance(s, int) for s in seeds)
        or len(set(seeds)) != len(seeds)
    ):
        raise ConfigError(f"{source}: seeds must be a non-empty list of distinct integers, got {seeds!r}")
    return list(seeds)


def _check_targets(targets: object, source: str) -> list[float]:
    if (
        not isinstance(targets, list)
        or not targets
        or any(isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 1 for t in targets)
    ):
        raise ConfigError(
            f"{source}: targets must be a non-empty list of accuracies in (0, 1], got {targets!r}"
        )
    return sorted({float(t) for t in targets})


def parse_comparison(doc: dict[str, Any], source: str, default_name: str = "comparison") -> Comparison:
    """Check a comparison file's tree (see the module docstring); every error names ``source``."""
    unknown = sorted(set(doc) - set(_FILE_KEYS))
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {unknown}; a comparison file has {list(_FILE_KEYS)}")
    variants = doc.get("variants")
    if not isinstance(variants, dict) or not variants:
        raise ConfigError(f"{source}: 'variants' must map each variant's name to its overrides")
    checked: dict[str, dict[str, Any]] = {}
    for name, over in variants.items():
        if over is None:
            over = {}
        if not isinstance(over, dict):
            raise ConfigError(f"{source}: variant {name!r}: overrides must be a mapping, got {over!r}")
        checked[str(name)] = expand_dotted(over)
    base = doc.get("base") or {}
    if not isinstance(base, dict):
        raise ConfigError(f"{source}: 'base' must be a run config mapping")
    reference = doc.get("reference")
    if reference is not None and str(reference) not in checked:
        raise ConfigError(f"{source}: reference {reference!r} is not one of the variants {list(checked)}")
    return Comparison(
        name=str(doc.get("name") or default_name),
        variants=checked,
        base=expand_dotted(base),
        description=str(doc.get("description") or ""),
        seeds=None if doc.get("seeds") is None else _check_seeds(doc["seeds"], source),
        targets=None if doc.get("targets") is None else _check_targets(doc["targets"], source),
        reference=None if reference is None else str(reference),
        source=source,
    )


def _comparison_path(path_or_name: str | Path) -> Path:
    path_or_name = str(path_or_name)
    p = Path(path_or_name)
    if not p.is_file() and p.suffix not in (".yaml", ".yml") and "/" not in path_or_name:
        p = comparison_file(path_or_name)
    return p


def _read_extended(p: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The file's tree with ``extends: OTHER`` resolved: OTHER's ``base`` (itself resolved first)
    under this file's ``base``. OTHER is a shipped comparison's name or a path relative to this
    file; only the base is shared, every other key is this file's own. So a sweep states its
    scenario once, in the comparison it extends."""
    doc = read_yaml(p)
    parent = doc.get("extends")
    if parent is None:
        return doc
    if not isinstance(parent, str) or not parent:
        raise ConfigError(f"{p}: extends must name one comparison file, got {parent!r}")
    rel = p.parent / parent
    q = rel if rel.is_file() else _comparison_path(parent)
    if q.resolve() in chain or q.resolve() == p.resolve():
        raise ConfigError(f"{p}: extends {parent!r} makes a cycle ({' -> '.join(str(c) for c in chain)})")
    if not q.is_file():
        raise ConfigError(f"{p}: extends {parent!r}: no such comparison file ({q})")
    base = doc.get("base") or {}
    if not isinstance(base, dict):
        raise ConfigError(f"{p}: 'base' must be a run config mapping")
    inherited = _read_extended(q, (*chain, p.resolve())).get("base") or {}
    merged = {k: v for k, v in doc.items() if k != "extends"}
    merged["base"] = _merged(expand_dotted(inherited), expand_dotted(base))
    return merged


def portable_source(source: str) -> str:
    """``source`` as result files record it: a shipped file as ``felix/configs/comparisons/NAME.yaml``,
    a file under the working directory relative to it, any other file by its name alone, so that
    results carry no path of the machine they were made on (a description such as ``command line``
    is kept)."""
    p = Path(source)
    if not p.is_absolute() and not p.suffix:
        return source
    resolved = p.resolve()
    for root, prefix in ((CONFIG_DIR.parent, "felix/"), (Path.cwd().resolve(), "")):
        if resolved.is_relative_to(root):
            return prefix + resolved.relative_to(root).as_posix()
    return p.name


def load_comparison(path_or_name: str | Path) -> Comparison:
    """A comparison file by path, or a shipped one by name (``configs/comparisons/<name>.yaml``);
    ``extends`` resolved (see ``_read_extended``)."""
    p = _comparison_path(path_or_name)
    return parse_comparison(_read_extended(p), _source_name(p), p.stem)


def _source_name(p: Path) -> str:
    """How results name a comparison file: a shipped one as ``configs/comparisons/<name>.yaml``
    (where it is in any installation, so manifests hold no machine's path), another as given."""
    try:
        return str(Path("configs") / p.resolve().relative_to(CONFIG_DIR))
    except ValueError:
        return str(p)


def is_comparison_file(path: str) -> bool:
    """Whether ``path`` names a comparison (a file with ``variants``, or a shipped name) rather than
    a run config."""
    p = Path(path)
    if p.is_file():
        return "variants" in read_yaml(p)
    return p.suffix not in (".yaml", ".yml") and "/" not in path


def on_the_fly(
    config_path: str | None, strategies: list[str], scenario: str | None, reference: str | None
) -> Comparison:
    """The old form, ``--strategies a,b [--scenario S] [CONFIG]``: one variant per strategy preset
    on the same scenario (the embedded default when neither a file nor a scenario is given)."""
    if not strategies:
        raise ConfigError("felix compare needs at least one strategy")
    if reference is not None and reference not in strategies:
        raise ConfigError(f"--reference {reference!r} is not one of the compared strategies {strategies}")
    base: dict[str, Any] = {}
    if config_path is None or scenario is not None:
        base["scenario"] = scenario or "default"
    if config_path is not None:
        base = deep_merge(base, read_yaml(config_path))
    return Comparison(
        name="compare",
        variants={s: {"strategy": s} for s in strategies},
        base=base,
        reference=reference,
        source=config_path or f"scenario {scenario or 'default'}",
    )


def variant_config(
    comp: Comparison,
    variant: str,
    sets: dict[str, Any],
    seed: int | None = None,
    stop_target: float | None = None,
) -> Config:
    """One run's config: defaults <- scenario <- base <- strategy preset <- variant <- ``--set``;
    then the seed and (when targets are given) the stop target, the highest one."""
    raw = dict(comp.base)
    scenario = raw.pop("scenario", None)
    raw = deep_merge(scenario_preset(str(scenario)) if scenario else {}, raw)
    over = dict(comp.variants[variant])
    strategy = over.pop("strategy", None) or sets.get("strategy") or raw.get("strategy")
    if strategy and strategy != "custom":
        raw = deep_merge(raw, strategy_preset(str(strategy)))
        raw["strategy"] = strategy
    raw = deep_merge(deep_merge(raw, over), sets)
    if seed is not None:
        raw["seed"] = seed
    if stop_target is not None:
        raw = deep_merge(raw, {"run": {"target_accuracy": stop_target}})
    return validate(raw, f"{comp.source}, variant {variant}")


@dataclass(frozen=True)
class _Run:
    variant: str
    seed: int
    spec: RunSpec


def run_comparison(
    comp: Comparison,
    sets: dict[str, Any],
    out_dir: Path,
    seeds: list[int] | None = None,
    targets: list[float] | None = None,
    only: list[str] | None = None,
    jobs: int | None = None,
    backend: str = "local",
    address: str | None = None,
    force: bool = False,
    gpus_per_run: float = 1.0,
    argv: list[str] | None = None,
) -> dict[str, Any]:
    """Run every variant x seed of ``comp`` (``seeds`` / ``targets`` override the file's; ``only``
    keeps some variants), then write comparison.json/.md, the plots and manifest.json under
    ``out_dir``. Runs stop at the highest target, so that every lower one is measured too."""
    started = _now()
    if only:
        missing = [v for v in only if v not in comp.variants]
        if missing:
            raise ConfigError(
                f"{comp.source}: no variant(s) {missing}; the variants are {list(comp.variants)}"
            )
    variants = [v for v in comp.variants if not only or v in only]
    seeds = _check_seeds(seeds, "--seeds") if seeds is not None else comp.seeds
    targets = _check_targets(targets, "--targets") if targets is not None else comp.targets
    stop_target = max(targets) if targets else None
    out_dir = out_dir.resolve()
    runs: list[_Run] = []
    for v in variants:
        for seed in seeds if seeds is not None else [None]:
            cfg = variant_config(comp, v, sets, seed, stop_target)
            # No seeds asked for: one run per variant, in <variant>/ as the single-seed compare always wrote.
            key, folder = (
                (v, out_dir / slug(v))
                if seeds is None
                else (f"{v}/seed={cfg.seed}", out_dir / slug(v) / f"seed-{cfg.seed}")
            )
            runs.append(_Run(v, cfg.seed, RunSpec(key, cfg, folder)))
    configs = [r.spec.config for r in runs]
    if targets is None:
        targets = [configs[0].run.target_accuracy]
    if (
        backend == "local"
        and (jobs or 1) > 1
        and any(not str(c.run.device).startswith("cpu") for c in configs)
    ):
        # Processes time-slicing one GPU each run several times slower: one process, one run at a
        # time, keeps the device busy (each run trains its clients in cohorts).
        print(
            f"felix compare: --jobs {jobs} ignored on {configs[0].run.device}: runs go one after another "
            "in this process",
            file=sys.stderr,
        )
        jobs = 1
    make_output_dir(out_dir)
    _write_manifest(out_dir, comp, runs, argv, started, None, None)
    runner = make_backend(backend, jobs, address, gpus_per_run)
    try:
        outcome = run_all([r.spec for r in runs], runner, force)
    finally:
        close_backend(runner)
    _write_manifest(out_dir, comp, runs, argv, started, _now(), outcome)
    by_variant: dict[str, dict[int, Any]] = {}
    for r in runs:
        if r.spec.key in outcome.outputs:
            by_variant.setdefault(r.variant, {})[r.seed] = outcome.outputs[r.spec.key]
    first_seed = runs[0].seed
    doc: dict[str, Any] = {
        "name": comp.name,
        "description": comp.description,
        "source": portable_source(comp.source),
        "scenario": configs[0].name,
        "seed": first_seed,
        "seeds": sorted({r.seed for r in runs}),
        "targets": targets,
        "target_window": configs[0].run.target_window,
        "reference": None,
        "strategies": {},
        "runs": {},
        "stats": {},
        "failed": outcome.failed,
        "skipped": outcome.skipped,
        "interrupted": outcome.interrupted,
    }
    if not by_variant:
        return doc
    wanted = comp.reference or ("felix" if "felix" in variants else variants[0])
    ref = wanted if wanted in by_variant else next(iter(by_variant))  # a failed reference falls back
    curves = {v: {seed: o.rows for seed, o in per.items()} for v, per in by_variant.items()}
    window = next(r.spec.config.run.target_window for r in runs if r.variant == ref)
    stats = compare_seeds(curves, targets, window, ref)
    doc.update(
        {
            "reference": ref,
            "target_window": window,
            "stats": stats_json(stats),
            # The summaries of the first seed, one per variant (the single-seed table's rows).
            "strategies": {v: per[first_seed].summary for v, per in by_variant.items() if first_seed in per},
            "runs": {v: {str(seed): o.summary for seed, o in per.items()} for v, per in by_variant.items()},
        }
    )
    # Compact: a tuning grid's file holds every run's summary twice over (``strategies`` and
    # ``runs``), and indentation alone would take it past 2 MB; comparison.md is the readable table.
    (out_dir / "comparison.json").write_text(json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n")
    (out_dir / "comparison.md").write_text(_markdown(comp, doc, stats, runs, by_variant, ref))
    plot_comparison(out_dir, curves, stats)
    plot_accuracy_vs_bytes(out_dir, curves, stats)
    bytes_by_kind_plot(out_dir, {v: [o.summary for o in per.values()] for v, per in by_variant.items()})
    return doc


def compare(
    config_path: str | None,
    strategies: list[str],
    sets: dict[str, Any],
    out_dir: Path,
    scenario: str | None = None,
    jobs: int | None = None,
    reference: str | None = None,
    backend: str = "local",
    address: str | None = None,
    force: bool = False,
    gpus_per_run: float = 1.0,
    seeds: list[int] | None = None,
    targets: list[float] | None = None,
    argv: list[str] | None = None,
) -> dict[str, Any]:
    """The old form: ``strategies`` on one scenario, as a comparison built on the fly."""
    comp = on_the_fly(config_path, strategies, scenario, reference)
    return run_comparison(
        comp, sets, out_dir, seeds, targets, None, jobs, backend, address, force, gpus_per_run, argv
    )


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _write_manifest(
    out_dir: Path,
    comp: Comparison,
    runs: list[_Run],
    argv: list[str] | None,
    started: str,
    ended: str | None,
    outcome: Outcome | None,
) -> None:
    """What produced this folder: the command, the comparison, every run's resolved config and
    status, and the code and machine (``felix.metrics.provenance``). Written before the runs start
    (``ended_utc`` null) and again when they are done."""

    def status(key: str) -> str:
        if outcome is None:
            return "pending"
        if key in outcome.failed:
            return "failed: " + outcome.failed[key]
        if key in outcome.interrupted:
            return "interrupted"
        return "finished before (not rerun)" if key in outcome.skipped else "ran"

    doc = {
        "command": list(sys.argv if argv is None else argv),
        "comparison": {
            "name": comp.name,
            "source": portable_source(comp.source),
            "description": comp.description,
        },
        "started_utc": started,
        "ended_utc": ended,
        "provenance": provenance(),
        "devices": sorted({r.spec.config.run.device for r in runs}),
        "threads": sorted({r.spec.config.run.threads or 0 for r in runs}),
        "runs": {
            r.spec.key: {
                "variant": r.variant,
                "seed": r.seed,
                "folder": str(r.spec.out_dir.relative_to(out_dir)),
                "status": status(r.spec.key),
                "config": r.spec.config.model_dump(mode="json"),
            }
            for r in runs
        },
    }
    (out_dir / "manifest.json").write_text(json.dumps(doc, indent=2) + "\n")


def _markdown(
    comp: Comparison,
    doc: dict[str, Any],
    stats: Any,
    runs: list[_Run],
    by_variant: dict[str, dict[int, Any]],
    ref: str,
) -> str:
    title = f"{comp.name}: {doc['scenario']}, {len(doc['seeds'])} seed(s) {doc['seeds']}"
    stopped = {r.variant for r in runs if r.spec.key in doc["interrupted"]}
    head, rest = table_markdown(stats, ref, title, stopped).split("\n", 1)
    parts = [head + "\n" + (f"\n{comp.description}\n" if comp.description else "") + rest]
    parts.append(
        f"\nTarget rule: the mean of the last {doc['target_window']} evaluations reaches the target.\n"
    )
    if doc["interrupted"]:
        parts.append(
            "\nInterrupted (Ctrl-C or SIGTERM; the next `felix compare` reruns them): "
            + ", ".join(doc["interrupted"])
            + "\n"
        )
    if doc["failed"]:
        parts.append(
            "\nFailed (after one retry): " + "; ".join(f"{k}: {v}" for k, v in doc["failed"].items()) + "\n"
        )
    for seed in doc["seeds"]:
        at_seed = {v: per[seed].summary for v, per in by_variant.items() if seed in per}
        if not at_seed:
            continue
        cfg = next(r.spec.config for r in runs if r.seed == seed)
        parts.append("\n" + markdown_table(at_seed, ref if ref in at_seed else next(iter(at_seed)), cfg))
    return "".join(parts)


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.1f}"


def markdown_table(summaries: dict[str, dict[str, Any]], ref: str, cfg: Config) -> str:
    """The details of one seed's runs: time and bytes to the stop target, bytes by kind, diagnostics."""
    r = summaries[ref]
    lines = [
        (
            f"## Seed {cfg.seed}: target accuracy {cfg.run.target_accuracy} (mean of last {cfg.run.target_window} "
            f"evaluations), {cfg.name}"
        ),
        "",
        f"Speed-up = time to target of the strategy / time to target of {ref} (how much faster {ref} is).",
        "",
        "| strategy | time to target (s) | speed-up of "
        + ref
        + " | MB to target | total MB | train MB down/up "
        "| eval MB down/up | control MB | aggregations | updates applied | discarded | dropped mid-task "
        "| agg. interval P50/P95 (s) | staleness mean | final acc | stop |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
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
        final = "-" if s["final_accuracy"] is None else f"{s['final_accuracy']:.4f}"
        lines.append(
            f"| {name} | {'not reached' if ttt is None else round(ttt)} | {speed} | {_mb(s['bytes_to_target'])} "
            f"| {_mb(s['bytes_down'] + s['bytes_up'])} | {_mb(b['down']['train'])}/{_mb(b['up']['train'])} "
            f"| {_mb(b['down']['eval'])}/{_mb(b['up']['eval'])} "
            f"| {_mb(b['down']['control'] + b['up']['control'])} | {s['aggregations']} | {s['updates_applied']} "
            f"| {s['updates_discarded']} | {d['dropped_share']:.1%} "
            f"| {interval} | {stale} | {final} | {s['stop_reason']} |"
        )
    return "\n".join(lines) + "\n"


def bytes_by_kind_plot(out_dir: Path, summaries: dict[str, list[dict[str, Any]]]) -> Path:
    """Total bytes of each variant's runs by kind and direction, mean over its seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summaries)
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(names)
    for kind, direction, color in (
        ("train", "down", "tab:blue"),
        ("train", "up", "tab:cyan"),
        ("eval", "down", "tab:orange"),
        ("eval", "up", "tab:red"),
        ("control", "down", "grey"),
        ("control", "up", "black"),
    ):
        vals = [
            sum(s["bytes_by_kind"][direction][kind] for s in summaries[n]) / len(summaries[n]) / 1e6
            for n in names
        ]
        ax.bar(names, vals, bottom=bottom, label=f"{kind} {direction}", color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("total MB of the run (mean over seeds)")
    ax.legend(fontsize=7)
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    path = out_dir / "comparison_bytes.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
