"""The ``felix`` command."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from felix.cli.seeds import add_seeds_argument, parse_seeds

#: Where the user errors (config, dataset, trace) are defined: one line on stderr and exit 2. Looked
#: up only in modules already imported, so that a command that needs none of them stays light.
USER_ERROR_TYPES = (
    ("felix.config", "ConfigError"),
    ("felix.scenario.datasets", "DatasetError"),
    ("felix.scenario.traces", "TraceError"),
)

#: Subcommands mounted from their modules only when named on the command line, so that
#: ``felix --help`` and ``felix plan-augmentation`` start without importing torch:
#: command -> (module, function that mounts it on the subparsers, help line).
LAZY_COMMANDS = {
    "plan-augmentation": ("felix.cli.dafl", "add_parser", "plan DAFL augmentation from class counts"),
    "federage-compare": (
        "felix.experiments.federage",
        "add_parser",
        "FedeRage vs FedAvg/FedProx/SCAFFOLD/q-FFL under the RAM (configs/comparisons)",
    ),
    "dafl-experiment": (
        "felix.experiments.dafl",
        "add_parser",
        "the DAFL paper's Table IV (configs/comparisons/dafl-table4.yaml)",
    ),
    "report": (
        "felix.experiments.html_report",
        "add_parser",
        "comparison folders as one offline HTML page, ours beside the paper's",
    ),
    "serve": ("felix.deploy.cli", "add_parsers", "run the federated server over MQTT (deployment)"),
    "client": ("felix.deploy.cli", "add_parsers", "run one (or a range of) federated client(s) over MQTT"),
    "emulate": (
        "felix.deploy.cli",
        "add_parsers",
        "run many clients on this machine, driven by the config's trace",
    ),
    "mqtt-credentials": (
        "felix.deploy.cli",
        "add_parsers",
        "write a Mosquitto password file, ACL, client logins and mosquitto.conf",
    ),
}


def _user_errors() -> tuple[type[BaseException], ...]:
    return tuple(getattr(sys.modules[m], name) for m, name in USER_ERROR_TYPES if m in sys.modules)


def _run(args: argparse.Namespace) -> int:
    from felix.cli.run_folder import choose_folder, missing_parents, remove_empty
    from felix.config import ConfigError
    from felix.engine.setup import resolve_config
    from felix.sim.run import run_config

    sets = _sets(args)
    cfg = resolve_config(args.config, args.preset, sets, args.scenario)
    if cfg.strategy == "custom" and args.config is None and args.preset is None and "strategy" not in sets:
        # A shipped scenario without a strategy would run the bare defaults, which reach no target.
        raise ConfigError(
            f"scenario {args.scenario} names no strategy: add --preset NAME (e.g. felix or fedbuff; "
            "docs/configs.md lists them), or --set strategy=custom to run its settings as they are"
        )
    out, moved = choose_folder(cfg, sets, args.out, args.force)
    if moved:
        print(f"felix run: {moved}", file=sys.stderr)
    print(f"felix run: {cfg.name} / {cfg.strategy} (seed {cfg.seed}) -> {out}", file=sys.stderr)
    created = missing_parents(out)
    try:
        res = run_config(cfg, out, progress=not args.quiet, interruptible=True)  # Ctrl-C: "interrupted"
    except BaseException:
        remove_empty(created)  # a run that failed before writing anything leaves no folder
        raise
    s = res.summary
    ttt = "not reached" if s["time_to_target_s"] is None else f"{s['time_to_target_s']:.0f} s"
    final = "-" if s["final_accuracy"] is None else f"{s['final_accuracy']:.4f}"  # None: run.eval_every 0
    print(
        f"target {s['target_accuracy']:.2f}: {ttt}; final accuracy {final} after "
        f"{s['aggregations']} aggregations, {s['virtual_time_s']:.0f} virtual s, {s['wall_time_s']:.1f} wall s, "
        f"{(s['bytes_down'] + s['bytes_up']) / 1e6:.1f} MB ({s['stop_reason']})"
    )
    rejected = s.get("rejected_by_reason") or {}
    if rejected:  # a run can refuse every update and still run to its time limit: say why
        top = sorted(rejected.items(), key=lambda kv: -kv[1])[:3]
        print(
            f"felix run: {sum(rejected.values())} client results rejected, most for: "
            + "; ".join(f"{reason} ({n})" for reason, n in top)
            + f" (all reasons in {out / 'summary.json'}; -v logs each)",
            file=sys.stderr,
        )
    return 130 if s["stop_reason"] == "interrupted" else 0


def _compare(args: argparse.Namespace) -> int:
    from felix.config import ConfigError
    from felix.experiments.compare import compare, is_comparison_file, load_comparison, run_comparison
    from felix.presets import MAIN_STRATEGIES

    listed = _names(args.strategies)
    seeds, targets = parse_seeds(args.seeds), _numbers(args.targets, float, "--targets")
    if args.config is not None and is_comparison_file(args.config):
        comp = load_comparison(args.config)
        if args.scenario is not None:
            comp = replace(comp, base={**comp.base, "scenario": args.scenario})
        if args.reference is not None:
            if args.reference not in comp.variants:
                raise ConfigError(
                    f"--reference {args.reference!r} is not one of the variants {list(comp.variants)}"
                )
            comp = replace(comp, reference=args.reference)
        out = Path(args.out or f"runs/{comp.name}")
        print(
            f"felix compare: {comp.name} ({comp.source}): {', '.join(listed or comp.variants)} -> {out}",
            file=sys.stderr,
        )
        doc = run_comparison(
            comp,
            _sets(args),
            out,
            seeds,
            targets,
            listed or None,
            args.jobs,
            backend=args.backend,
            address=args.address,
            force=args.force,
            gpus_per_run=args.gpus_per_run,
            argv=args.argv,
        )
    else:
        strategies = listed or list(MAIN_STRATEGIES)
        out = Path(args.out or "runs/compare")
        print(f"felix compare: {', '.join(strategies)} -> {out}", file=sys.stderr)
        doc = compare(
            args.config,
            strategies,
            _sets(args),
            out,
            args.scenario,
            args.jobs,
            args.reference,
            backend=args.backend,
            address=args.address,
            force=args.force,
            gpus_per_run=args.gpus_per_run,
            seeds=seeds,
            targets=targets,
            argv=args.argv,
        )
    if doc["strategies"]:
        print((out / "comparison.md").read_text())
    if doc["interrupted"]:
        return 130  # Ctrl-C / SIGTERM: the interrupted run is rerun next time (the finished ones are kept)
    return 0 if doc["strategies"] and not doc["failed"] else 1


def _sets(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--set`` overrides, with ``--flower-app`` as ``client.flower_app``."""
    from felix.config import deep_merge, parse_set

    sets = parse_set(args.set)
    if args.flower_app is not None:
        sets = deep_merge(sets, {"client": {"flower_app": args.flower_app}})
    return sets


def _numbers(items: list[str] | None, kind: type, flag: str) -> list[Any] | None:
    """``--targets 0.8 0.9`` or ``--targets 0.8,0.9`` as numbers; None if not given."""
    from felix.config import ConfigError

    if items is None:
        return None
    try:
        return [kind(x) for item in items for x in item.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} expects {kind.__name__} values, got {' '.join(items)!r}") from None


def _names(value: str | None) -> list[str]:
    """``--strategies a,b`` as names; [] if not given. Given but naming none (``,``, ``""``) is an
    error, not a silent "all of them"."""
    from felix.config import ConfigError

    if value is None:
        return []
    names = [s.strip() for s in value.split(",") if s.strip()]
    if not names:
        raise ConfigError(f"--strategies {value!r} names no strategy: give comma-separated names")
    return names


def _sweep(args: argparse.Namespace) -> int:
    from felix.experiments.sweep import parse_grid, sweep

    strategies: list[str | None] = [*_names(args.strategies)] or [None]
    seeds: list[int | None] = [*(parse_seeds(args.seeds) or [])] or [None]
    out = Path(args.out or "runs/sweep")
    doc = sweep(
        args.config,
        args.scenario,
        _sets(args),
        strategies,
        parse_grid(args.grid),
        seeds,
        out,
        backend=args.backend,
        jobs=args.jobs,
        address=args.address,
        force=args.force,
        gpus_per_run=args.gpus_per_run,
    )
    print((out / "sweep.md").read_text())
    print(
        f"felix sweep: wrote {out / 'sweep.md'} and {out / 'sweep.json'} (a folder per run)", file=sys.stderr
    )
    if doc["interrupted"]:
        return 130  # Ctrl-C / SIGTERM: the interrupted runs are rerun next time
    return 0 if not doc["failed"] else 1


def _add_flower_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--flower-app",
        metavar="MODULE:APP",
        help="train every task with this Flower ClientApp (client.flower_app; docs/flower.md)",
    )


def _add_backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend",
        choices=("local", "ray"),
        default="local",
        help="local: this process or --jobs processes; ray: one Ray task per run (docs/ray.md)",
    )
    p.add_argument(
        "--address",
        help="ray: join the cluster at HOST:PORT (default: start a local, loopback-only instance)",
    )
    p.add_argument(
        "--gpus-per-run",
        type=float,
        default=1.0,
        help="ray: GPU share of a run whose run.device is cuda; below 1 packs small runs on one GPU",
    )
    p.add_argument("--force", action="store_true", help="rerun runs whose summary.json already exists")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``felix`` parser. Of the ``LAZY_COMMANDS`` only ``command`` (or all when None) is mounted
    from its module; the others are listed by name and help line."""
    p = argparse.ArgumentParser(prog="felix", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="log rejected messages and details")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="simulate one strategy on one scenario")
    r.add_argument("config", nargs="?", help="YAML config (default: the embedded offline scenario)")
    r.add_argument("--preset", help="strategy preset, e.g. fedavg, fedbuff")
    r.add_argument("--scenario", help="named scenario to start from (default: 'default' when no config)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    r.add_argument(
        "--out",
        help="output folder (default runs/<name>-<strategy>-s<seed>, plus -<hash> with --set, "
        "plus -2, -3, ... when that folder holds an earlier run)",
    )
    r.add_argument(
        "--force", action="store_true", help="write over the files of an earlier run in the folder"
    )
    _add_flower_arg(r)
    r.add_argument("-q", "--quiet", action="store_true", help="no live progress line")
    r.set_defaults(func=_run)
    c = sub.add_parser(
        "compare",
        help="run the variants of a comparison (or several strategies) over seeds "
        "on the same scenario and tabulate them",
    )
    c.add_argument(
        "config",
        nargs="?",
        help="a comparison file or the name of a shipped one (configs/comparisons/; "
        "docs/configs.md), or a YAML scenario to compare --strategies on (default: the embedded "
        "offline scenario)",
    )
    c.add_argument(
        "--strategies",
        help="comma-separated presets (default: the seven main ones); with a "
        "comparison file, the variants to run (default: all)",
    )
    c.add_argument(
        "--scenario", help="named scenario preset to start from (replaces a comparison's base scenario)"
    )
    add_seeds_argument(c, "the comparison file's, else the config's seed")
    c.add_argument(
        "--targets",
        nargs="+",
        metavar="ACC",
        help="accuracy targets of the tables, e.g. --targets "
        "0.78 0.80 0.82; runs stop at the highest (default: the file's, else run.target_accuracy)",
    )
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    c.add_argument("--out", help="output folder (default runs/compare)")
    _add_flower_arg(c)
    c.add_argument(
        "--jobs",
        type=int,
        help="local: strategies in parallel processes (default 1); "
        "ray without --address: CPUs of the local instance (default all)",
    )
    c.add_argument(
        "--reference",
        help="strategy (variant) the speed-ups are relative to (default: the file's, else felix)",
    )
    _add_backend_args(c)
    c.set_defaults(func=_compare)
    w = sub.add_parser("sweep", help="one scenario over a grid of --set values, strategies and seeds")
    w.add_argument("config", nargs="?", help="YAML scenario (default: the embedded offline scenario)")
    w.add_argument("--scenario", help="named scenario preset to start from")
    w.add_argument("--strategies", help="comma-separated presets (default: the config's own strategy)")
    w.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="a swept config key and its values (repeat for a product grid)",
    )
    add_seeds_argument(w, "the config's seed")
    w.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="fixed override for every run"
    )
    w.add_argument("--out", help="output folder (default runs/sweep)")
    _add_flower_arg(w)
    w.add_argument(
        "--jobs",
        type=int,
        help="local: runs in parallel processes (default 1); "
        "ray without --address: CPUs of the local instance (default all)",
    )
    _add_backend_args(w)
    w.set_defaults(func=_sweep)
    for name, (module, mount, text) in LAZY_COMMANDS.items():
        if name not in sub.choices and command in (None, name):
            getattr(importlib.import_module(module), mount)(sub)
    for name, (_, _, text) in LAZY_COMMANDS.items():
        if name not in sub.choices:
            sub.add_parser(name, help=text, add_help=False)
    return p


def _command(argv: list[str]) -> str:
    """The subcommand named in ``argv`` ("" when none): its first word that is not an option."""
    return next((a for a in argv if not a.startswith("-")), "")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command(argv))
    args = parser.parse_args(argv)
    args.argv = ["felix", *argv]  # recorded by commands that write a manifest
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.ERROR, format="%(levelname)s %(name)s: %(message)s"
    )
    # A config's warnings (a setting the chosen policy would ignore) show without --verbose.
    logging.getLogger("felix.config").setLevel(logging.INFO if args.verbose else logging.WARNING)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if not isinstance(exc, _user_errors()):
            raise
        print(f"felix: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
