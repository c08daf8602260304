"""Run a shipped comparison file (``configs/comparisons/*.yaml``) through the one engine.

The file is read and each run's config made by ``felix.experiments.compare`` (the format is in
docs/configs.md); each run goes through ``felix.sim.run.run_config`` one after another, and
``felix federage-compare`` / ``felix dafl-experiment`` tabulate the per-client and per-class
measures of their papers from the summaries (``felix compare FILE`` runs the same files with
seeds in parallel, the skip rule and the time-to-target tables).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from felix.cli.seeds import add_seeds_argument, parse_seeds
from felix.config import ConfigError, parse_set
from felix.experiments.compare import Comparison, load_comparison, variant_config
from felix.experiments.runs import RunSpec, load
from felix.metrics.provenance import portable_command, portable_path
from felix.presets import CONFIG_DIR
from felix.sim.run import run_config

#: The shipped comparison files (package data; the repository's configs/ links there).
COMPARISONS = CONFIG_DIR / "comparisons"


def run_comparison(
    comp: Comparison,
    out: Path | None,
    seeds: list[int] | None = None,
    variants: list[str] | None = None,
    sets: dict[str, Any] | None = None,
    quiet: bool = False,
    force: bool = False,
) -> list[dict[str, Any]]:
    """Every (seed, variant) run, seed-major; each summary (and its run folder under ``out``). A run
    whose folder holds a finished run (``RunSpec.done``; of the same config, checked by ``load``) is
    read back instead of run again unless ``force``: an interrupted sweep resumes where it stopped,
    and variants added to a file run alone."""
    names = variants or list(comp.variants)
    configs = [
        (seed, v, variant_config(comp, v, sets or {}, seed))
        for seed in (seeds or comp.seeds or [int(comp.base.get("seed", 0))])
        for v in names
    ]
    results = []
    for _, v, cfg in configs:  # every config validated before the first run starts
        seed = cfg.seed
        folder = None if out is None else out / v / f"seed-{seed}"
        spec = None if folder is None else RunSpec(f"{v}/seed={seed}", cfg, folder)
        if spec is not None and spec.done and not force:
            summary, how = load(spec).summary, "finished before, read back"
        else:
            summary = run_config(cfg, folder, plots=False).summary
            how = f"{summary['wall_time_s']:.0f} s"
            if folder is not None:
                (folder / "config.json").write_text(cfg.model_dump_json(indent=2) + "\n")
        results.append({"variant": v, "seed": seed, "summary": summary})
        if not quiet:
            print(f"{comp.name}: {v} seed {seed} done ({how})", file=sys.stderr, flush=True)
    return results


def add_arguments(p: argparse.ArgumentParser, default_file: Path, default_out: str) -> None:
    """The flags of a command that runs one shipped comparison file."""
    p.add_argument("--file", type=Path, default=default_file, help="comparison file (default: %(default)s)")
    add_seeds_argument(p, "the file's")
    p.add_argument("--variants", default=None, help="comma list of the file's variants (default: all)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override applied to every run, e.g. --set trace.horizon_s=1200 (repeatable)",
    )
    p.add_argument("--out", default=default_out, help="output folder (default: %(default)s)")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-run progress lines")
    p.add_argument(
        "--force", action="store_true", help="rerun runs whose folder under --out holds a finished run"
    )


def run_from_args(args: argparse.Namespace) -> tuple[Comparison, list[dict[str, Any]], dict[str, Any]]:
    """Load ``--file``, run the selected variants and seeds; returns the comparison, the results
    and the settings to record (file, seeds, variants, overrides)."""
    comp = load_comparison(str(args.file))
    variants = None if args.variants is None else [v.strip() for v in args.variants.split(",") if v.strip()]
    if variants is not None:
        unknown = [v for v in variants if v not in comp.variants]
        if unknown or not variants:
            raise ConfigError(
                f"--variants: {unknown[0] if unknown else 'none given'!r} is not a variant of "
                f"{comp.source}; choose from {', '.join(comp.variants)}"
            )
    sets = parse_set(args.set)
    seeds = parse_seeds(args.seeds)
    results = run_comparison(comp, Path(args.out) / "runs", seeds, variants, sets, args.quiet, args.force)
    settings = {
        "file": portable_path(args.file),
        "seeds": seeds or comp.seeds or [],
        "variants": variants or list(comp.variants),
        "set": args.set,
        "command": " ".join(portable_command(sys.argv)),
    }
    return comp, results, settings


def error_exit(command: str, exc: Exception) -> int:
    """Bad input (file, override, dataset) as one line on stderr and exit status 2."""
    print(f"{command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
    return 2
