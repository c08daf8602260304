"""Run a shipped comparison file (``configs/comparisons/*.yaml``) through the one engine.

A comparison file is a base run config plus named variants, each a set of overrides (format in
docs and ``felix compare``). One run's config: defaults <- scenario <- base <- the variant's
strategy preset <- the variant's overrides <- ``--set``; each run goes through
``felix.engine.run.run_config``. This is the small glue behind ``felix federage-compare`` and
``felix dafl-experiment`` until those names point at the general comparison runner.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from felix.config import Config, ConfigError, deep_merge, parse_set, read_yaml, validate
from felix.engine.run import run_config
from felix.presets import scenario_preset, strategy_preset

#: The shipped comparison files (a source checkout: configs/ next to src/).
COMPARISONS = Path(__file__).resolve().parents[3] / "configs" / "comparisons"


@dataclass(frozen=True)
class Comparison:
    name: str
    base: dict[str, Any]
    variants: dict[str, dict[str, Any]]
    seeds: list[int]
    reference: str | None
    source: str


def _undot(over: dict[str, Any]) -> dict[str, Any]:
    """``{"client.objective": "ce"}`` -> ``{"client": {"objective": "ce"}}``, at every level
    (``params`` / ``objective_params`` values are taken as they are)."""
    out: dict[str, Any] = {}
    for key, value in over.items():
        *parents, leaf = str(key).split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key}: {p} is set both as a value and as a section")
        if isinstance(value, dict) and leaf not in ("params", "objective_params"):
            value = _undot(value)
        both = isinstance(value, dict) and isinstance(node.get(leaf), dict)
        node[leaf] = deep_merge(node[leaf], value) if both else value
    return out


def load_comparison(path: str | Path) -> Comparison:
    """Read and check a comparison file; errors name the file and the key."""
    doc = read_yaml(path)
    unknown = set(doc) - {"name", "description", "base", "variants", "seeds", "targets", "reference"}
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {sorted(unknown)}")
    variants = doc.get("variants")
    if not isinstance(variants, dict) or not variants:
        raise ConfigError(f"{path}: 'variants' must map variant names to overrides")
    bad = [k for k, v in variants.items() if v is not None and not isinstance(v, dict)]
    if bad:
        raise ConfigError(f"{path}: variant {bad[0]!r} must be a mapping of overrides")
    base = doc.get("base") or {}
    if not isinstance(base, dict):
        raise ConfigError(f"{path}: 'base' must be a run config mapping")
    seeds = doc.get("seeds", [base.get("seed", 0)])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise ConfigError(f"{path}: 'seeds' must be a non-empty list of integers")
    reference = doc.get("reference")
    if reference is not None and reference not in variants:
        raise ConfigError(f"{path}: reference {reference!r} is not a variant")
    return Comparison(str(doc.get("name", Path(path).stem)), base,
                      {str(k): v or {} for k, v in variants.items()}, seeds, reference, str(path))


def variant_config(comp: Comparison, variant: str, seed: int, sets: dict[str, Any] | None = None) -> Config:
    """The validated run config of one (variant, seed)."""
    if variant not in comp.variants:
        raise ConfigError(f"{comp.source}: no variant {variant!r}; choose from {', '.join(comp.variants)}")
    base = dict(comp.base)
    raw = scenario_preset(base.pop("scenario")) if "scenario" in base else {}
    raw = deep_merge(raw, _undot(base))
    over = _undot(comp.variants[variant])
    strategy = over.pop("strategy", None)
    if strategy is not None:
        raw = deep_merge(raw, strategy_preset(strategy))
        raw["strategy"] = strategy
    raw = deep_merge(deep_merge(raw, over), _undot(sets or {}))
    raw["seed"] = seed
    raw.setdefault("name", comp.name)
    return validate(raw, f"{comp.source} variant {variant}")


def run_comparison(comp: Comparison, out: Path | None, seeds: list[int] | None = None,
                   variants: list[str] | None = None, sets: dict[str, Any] | None = None,
                   quiet: bool = False) -> list[dict[str, Any]]:
    """Every (seed, variant) run, seed-major; each summary (and its run folder under ``out``)."""
    names = variants or list(comp.variants)
    configs = [(seed, v, variant_config(comp, v, seed, sets)) for seed in (seeds or comp.seeds) for v in names]
    results = []
    for seed, v, cfg in configs:  # every config validated before the first run starts
        res = run_config(cfg, None if out is None else out / v / f"seed-{seed}", plots=False)
        results.append({"variant": v, "seed": seed, "summary": res.summary})
        if not quiet:
            print(f"{comp.name}: {v} seed {seed} done ({res.summary['wall_time_s']:.0f} s)", file=sys.stderr,
                  flush=True)
    return results


def add_arguments(p: argparse.ArgumentParser, default_file: Path, default_out: str) -> None:
    """The flags of a command that runs one shipped comparison file."""
    p.add_argument("--file", type=Path, default=default_file, help="comparison file (default: %(default)s)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default: the file's)")
    p.add_argument("--variants", default=None, help="comma list of the file's variants (default: all)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override applied to every run, e.g. --set trace.horizon_s=1200 (repeatable)")
    p.add_argument("--out", default=default_out, help="output folder (default: %(default)s)")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-run progress lines")


def run_from_args(args: argparse.Namespace) -> tuple[Comparison, list[dict[str, Any]], dict[str, Any]]:
    """Load ``--file``, run the selected variants and seeds; returns the comparison, the results
    and the settings to record (file, seeds, variants, overrides)."""
    comp = load_comparison(args.file)
    variants = None if args.variants is None else [v.strip() for v in args.variants.split(",") if v.strip()]
    if variants is not None:
        unknown = [v for v in variants if v not in comp.variants]
        if unknown or not variants:
            raise ConfigError(f"--variants: {unknown[0] if unknown else 'none given'!r} is not a variant of "
                              f"{comp.source}; choose from {', '.join(comp.variants)}")
    sets = parse_set(args.set)
    results = run_comparison(comp, Path(args.out) / "runs", args.seeds, variants, sets, args.quiet)
    settings = {"file": str(args.file), "seeds": args.seeds or comp.seeds, "variants": variants or list(comp.variants),
                "set": args.set, "command": " ".join(sys.argv)}
    return comp, results, settings


def error_exit(command: str, exc: Exception) -> int:
    """Bad input (file, override, dataset) as one line on stderr and exit status 2."""
    print(f"{command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
    return 2
