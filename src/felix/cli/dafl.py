"""``felix plan-augmentation``: DAFL (or LB) augmentation plan for a client x class count table.

The server side of DAFL needs nothing but each client's class counts, so the
planner is usable on its own: give it the counts as CSV and it prints how far
the data is from balance (``I`` and ``J``), how many samples each client must
add, and optionally writes the plan as a CSV of the same shape.

Runs as ``python -m felix.cli.dafl COUNTS.csv ...`` too; :func:`add_parser`
and :func:`run` let the main ``felix`` command mount it.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from numpy.typing import NDArray
from pydantic import ValidationError

from felix.strategies.dataplans.dafl import (
    MAX_COUNT,
    MAX_STEPS,
    RULES,
    AugmentationPlan,
    DaflParams,
    PlanProgress,
    PlanTooLargeError,
    plan_dafl,
    plan_local_balancing,
    provably_tiny,
)

__all__ = ["CountsError", "CountsTable", "add_parser", "main", "read_counts", "run", "write_plan"]

COMMAND = "plan-augmentation"
_DESCRIPTION = (
    "Plan class-preserving augmentation for federated clients with DAFL (Algorithm 1 of the "
    "DAFL paper) or with local balancing (LB). COUNTS.csv holds one row per client and one "
    "column per class (header row of class names; a first column of client ids when its header is "
    "empty or 'client', 'client_id', 'id', or the column that --id-column names)."
)
_ID_HEADERS = frozenset({"", "client", "clients", "client_id", "clientid", "client id", "client-id", "id"})
_INTEGER = re.compile(r"[+-]?[0-9]+")
_ANY_DIGITS = re.compile(r"[+-]?\d+")  # Unicode digits too: only to name the error
#: Cell visits under which a plan is provably cheaper interpreted than loading the compiled kernel.
_TINY_VISITS = 1_000_000
#: Seconds before the first progress line on stderr, and between two lines.
PROGRESS_AFTER_S = 2.0
PROGRESS_EVERY_S = 5.0
#: The planner parameters the command takes as options (``--NAME``), with the types, defaults and
#: help of ``DaflParams``' fields.
PLANNER_OPTIONS = ("lambda1", "lambda2", "tau", "epsilon", "step", "rule")
#: Default ``--time-budget``: a plan is refused rather than left to run for minutes unasked.
DEFAULT_TIME_BUDGET_S = 60.0


class CountsError(ValueError):
    """A count table that cannot be planned for; the message names the place."""


@dataclass(frozen=True)
class CountsTable:
    """A parsed COUNTS.csv: the matrix plus the labels needed to write the plan back."""

    counts: NDArray[np.int64]
    classes: tuple[str, ...]
    clients: tuple[str, ...] | None
    """Client ids from the first column, or None when the file has none."""
    id_header: str
    """Header cell above the client ids ("" when there is no id column)."""
    id_index: int | None = None
    """Column of the client ids in the file, or None when the file has none."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``plan-augmentation`` on an ``add_subparsers()`` object; dispatch via ``args.func``."""
    parser = subparsers.add_parser(
        COMMAND, help="plan DAFL augmentation from class counts", description=_DESCRIPTION
    )
    _add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point (``python -m felix.cli.dafl``)."""
    parser = argparse.ArgumentParser(prog="python -m felix.cli.dafl", description=_DESCRIPTION)
    _add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Plan, report, and write ``--out``; user errors become one line on stderr and exit code 2."""
    try:
        table = read_counts(Path(args.counts), id_column=args.id_column, no_ids=args.no_ids)
        params = _params(args)
        if not (math.isfinite(args.time_budget) and args.time_budget > 0):
            raise ValueError(f"--time-budget must be a number of seconds > 0, got {args.time_budget!r}")
        if "numba" not in sys.modules and provably_tiny(
            table.counts, params, method=args.method, visits=_TINY_VISITS
        ):
            # Provably tiny: planning interpreted beats loading the compiled kernel (this process
            # plans once). Anything else runs compiled, as the library does.
            os.environ.setdefault("NUMBA_DISABLE_JIT", "1")
        if args.method == "lb":
            plan = plan_local_balancing(
                table.counts, args.tau, step=args.step, rule=args.rule, max_steps=args.max_steps
            )
        else:
            plan = plan_dafl(
                table.counts,
                params,
                max_steps=args.max_steps,
                time_budget_s=args.time_budget,
                progress=_Progress(sys.stderr),
            )
        if args.out is not None:
            write_plan(Path(args.out), table, plan)
    except PlanTooLargeError as exc:
        options = "--step" if args.method == "lb" else "--step, --time-budget"
        print(f"felix {COMMAND}: error: {_one_line(exc)} (options {options})", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"felix {COMMAND}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(_json_report(table, plan)))
    else:
        print(_text_report(table, plan, args))
    return 0


@dataclass
class _Progress:
    """A progress line on ``stream`` for plans that run long: the first after ``PROGRESS_AFTER_S``,
    then one every ``PROGRESS_EVERY_S``."""

    stream: TextIO
    next_at: float = PROGRESS_AFTER_S

    def __call__(self, where: PlanProgress) -> None:
        if where.elapsed_s < self.next_at:
            return
        self.next_at = where.elapsed_s + PROGRESS_EVERY_S
        if where.phase == 1:
            stage = f"Phase 1, {where.steps:,} of {where.phase1:,} steps"
        else:
            stage = f"Phase 2, {where.steps:,} steps (Phase 1 had {where.phase1:,})"
        print(f"felix {COMMAND}: planning: {stage}, {where.elapsed_s:.0f} s", file=self.stream, flush=True)


def read_counts(path: Path, *, id_column: str | None = None, no_ids: bool = False) -> CountsTable:
    """Parse COUNTS.csv, rejecting anything the planner could not use.

    Client ids come from the column whose header is ``id_column``, or else from the first column
    when its header declares ids (empty, or "client"/"client_id"/"id" and the like), never from
    the look of the cells: a first column of ``1e8`` or ``2.5`` under a class name is a class,
    and is refused as one. ``no_ids`` reads every column as a class. Counts are ASCII decimal
    integers; ids must be non-empty and distinct.
    """
    try:
        with path.open(newline="", encoding="utf-8-sig") as handle:
            rows = [(line, [cell.strip() for cell in row]) for line, row in enumerate(csv.reader(handle), 1)]
    except UnicodeDecodeError as exc:
        raise CountsError(f"{path}: not a UTF-8 text file ({exc.reason})") from None
    except OSError as exc:
        raise CountsError(f"cannot read {path}: {exc.strerror or exc}") from None
    except csv.Error as exc:
        raise CountsError(f"{path}: not valid CSV ({exc})") from None
    rows = [(line, row) for line, row in rows if any(row)]
    if not rows:
        raise CountsError(f"{path}: the table is empty")
    (_, header), body = rows[0], rows[1:]
    if not body:
        raise CountsError(f"{path}: the table has a header but no client rows")
    id_index = _id_index(path, header, id_column, no_ids)
    columns = [j for j in range(len(header)) if j != id_index]
    classes = tuple(header[j] for j in columns)
    if not classes:
        raise CountsError(f"{path}: the header names no class columns")
    counts = np.zeros((len(body), len(classes)), dtype=np.int64)
    for i, (line, row) in enumerate(body):
        if len(row) != len(header):
            raise CountsError(f"{path}: row {line} has {len(row)} cells, the header has {len(header)}")
        for j, col in enumerate(columns):
            where = f"{path}: row {line}, column {col + 1} ({classes[j] or 'unnamed'})"
            counts[i, j] = _count(row[col], where, hint=col == 0 and id_index is None)
    clients = None
    if id_index is not None:
        clients = tuple(row[id_index] for _, row in body)
        seen: dict[str, int] = {}
        for (line, _), client in zip(body, clients):
            if not client:
                raise CountsError(f"{path}: row {line} has an empty client id")
            if client in seen:
                raise CountsError(
                    f"{path}: rows {seen[client]} and {line} have the same client id {client!r}"
                )
            seen[client] = line
    for i in np.flatnonzero(counts.sum(axis=1) == 0).tolist():
        name = f"client {clients[i]!r}" if clients else f"client {i}"
        raise CountsError(f"{path}: row {body[i][0]} ({name}) has no samples")
    for j in np.flatnonzero(counts.sum(axis=0) == 0).tolist():
        raise CountsError(
            f"{path}: column {columns[j] + 1} ({classes[j] or 'unnamed'}) has no samples on any client, "
            f"so augmentation cannot balance it"
        )
    return CountsTable(counts, classes, clients, header[id_index] if id_index is not None else "", id_index)


def _id_index(path: Path, header: list[str], id_column: str | None, no_ids: bool) -> int | None:
    """The column of client ids: named by ``id_column``, declared by the first header cell, or none."""
    if id_column is not None:
        if no_ids:
            raise CountsError("--id-column and --no-ids exclude each other")
        found = [j for j, name in enumerate(header) if name == id_column]
        if len(found) != 1:
            raise CountsError(
                f"{path}: the header has {'no' if not found else len(found)} column(s) named {id_column!r} "
                f"(--id-column)"
            )
        return found[0]
    if not no_ids and header[0].lower() in _ID_HEADERS:
        return 0
    return None


def _count(cell: str, where: str, *, hint: bool) -> int:
    """One count cell: an ASCII decimal integer in ``[0, MAX_COUNT]``."""
    if not _INTEGER.fullmatch(cell):
        if _ANY_DIGITS.fullmatch(cell):
            raise CountsError(f"{where}: {cell!r} has digits outside ASCII 0-9")
        ids = " (a first column of client ids needs the header 'client' or --id-column)" if hint else ""
        raise CountsError(f"{where}: {cell!r} is not an integer count{ids}")
    value = int(cell)
    if value < 0:
        raise CountsError(f"{where}: negative count {value}")
    if value > MAX_COUNT:
        raise CountsError(f"{where}: count {value} is above the maximum {MAX_COUNT}")
    return value


def write_plan(path: Path, table: CountsTable, plan: AugmentationPlan) -> None:
    """Write ``A`` with the input's header and client ids (in their column), so rows line up with
    COUNTS.csv."""
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        if table.clients is None or table.id_index is None:
            writer.writerow(table.classes)
            writer.writerows(plan.A.tolist())
        else:
            at = table.id_index
            writer.writerow([*table.classes[:at], table.id_header, *table.classes[at:]])
            for client, row in zip(table.clients, plan.A.tolist()):
                writer.writerow([*row[:at], client, *row[at:]])


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("counts", metavar="COUNTS.csv", help="client x class table of sample counts")
    parser.add_argument("--method", choices=("dafl", "lb"), default="dafl", help="planner (default: dafl)")
    for name in PLANNER_OPTIONS:  # from the planner's own parameter model: one declaration
        info = DaflParams.model_fields[name]
        kind: dict[str, Any] = {"choices": RULES} if name == "rule" else {"type": info.annotation}
        parser.add_argument(
            f"--{name}", default=info.default, help=f"{info.description} (default: %(default)s)", **kind
        )
    parser.add_argument(
        "--max-steps",
        type=int,
        default=MAX_STEPS,
        help="refuse plans needing more greedy steps than this (default: %(default)s)",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=DEFAULT_TIME_BUDGET_S,
        metavar="SECONDS",
        help="refuse (with a step that fits) a DAFL plan projected or running past this many seconds "
        "(default: %(default)s)",
    )
    ids = parser.add_mutually_exclusive_group()
    ids.add_argument("--id-column", metavar="NAME", help="the column (by header) that holds client ids")
    ids.add_argument(
        "--no-ids", action="store_true", help="no id column, even if the first header reads like one"
    )
    parser.add_argument("--out", metavar="PLAN.csv", help="write the augmentation matrix here")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _json_report(table: CountsTable, plan: AugmentationPlan) -> dict[str, Any]:
    report = plan.to_dict()
    report["classes"] = list(table.classes)
    report["clients"] = list(table.clients) if table.clients is not None else None
    return report


def _text_report(table: CountsTable, plan: AugmentationPlan, args: argparse.Namespace) -> str:
    if plan.method == "lb":
        setting = f"LB (tau={args.tau:g}, step={args.step})"
    else:
        setting = (
            f"DAFL (lambda1={args.lambda1:g}, lambda2={args.lambda2:g}, tau={args.tau:g}, "
            f"epsilon={args.epsilon:g}, step={args.step}, rule={args.rule})"
        )
    names = table.clients or tuple(str(k) for k in range(len(plan.added_per_client)))
    width = max(len(name) for name in names)
    lines = [
        f"{setting}, {plan.A.shape[0]} clients x {plan.A.shape[1]} classes",
        "          I (label proportion)  J (class imbalance)",
        f"  before  {plan.I_before:20.6f}  {plan.J_before:19.6f}",
        f"  after   {plan.I_after:20.6f}  {plan.J_after:19.6f}",
        f"samples added: {plan.added} in all",
        *(f"  client {name:>{width}}: {added}" for name, added in zip(names, plan.added_per_client)),
        f"planning time: {plan.plan_seconds:.3f} s",
    ]
    return "\n".join(lines)


def _params(args: argparse.Namespace) -> DaflParams:
    """The planner's parameters from the options; a bad value is one line naming its option."""
    try:
        return DaflParams(**{name: getattr(args, name) for name in PLANNER_OPTIONS})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = f"--{err['loc'][0]}: " if err["loc"] else ""
        raise ValueError(where + str(err["msg"]).removeprefix("Value error, ")) from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


if __name__ == "__main__":
    raise SystemExit(main())
