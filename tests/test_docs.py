"""The docs describe the software as it is: every fenced shell command in README.md and docs/*.md
is run by a test (its text appears in a test file) or marked as not run, with the reason, by the
line ``<!-- not run by the tests: REASON -->`` right above its block; every repository file they
name exists; and they carry no wording tied to one machine or day (provenance lives in result
files)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: docs/flower.md is being reworked beside this check; the lead drops it from here after merging.
NOT_YET_CHECKED = {"docs/flower.md"}
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CHECKED = [p for p in DOCS if p.relative_to(ROOT).as_posix() not in NOT_YET_CHECKED]
SHELL = {"bash", "sh", "shell", "console"}
MARKER = re.compile(r"^\s*<!-- not run by the tests: \S.*-->\s*$")
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")


def _name(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def blocks(text: str) -> list[tuple[int, str, bool, list[str]]]:
    """Every fenced block: (line number, language, marked as not run, lines)."""
    lines = text.split("\n")
    out = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(2)
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith("```"):
            j += 1
        above = next((ln for ln in reversed(lines[:start]) if ln.strip()), "")
        out.append((start + 1, lang, bool(MARKER.match(above)), lines[start + 1 : j]))
        i = j + 1
    return out


def commands(lines: list[str]) -> list[str]:
    """The shell commands of a block: continuations joined, comments and prompts dropped, spaces
    collapsed."""
    out: list[str] = []
    pending = ""
    for raw in lines:
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        line = line.removeprefix("$ ")
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        full = re.sub(r"\s+#\s.*$", "", full)  # a trailing comment
        out.append(" ".join(full.split()))
    return out


def _test_sources() -> str:
    return "\n".join(
        " ".join(p.read_text().split())
        for p in sorted((ROOT / "tests").glob("*.py"))
        if p.name != "test_docs.py"
    )


@pytest.mark.parametrize("doc", CHECKED, ids=_name)
def test_every_shell_command_is_run_by_a_test_or_marked(doc: Path) -> None:
    tested = _test_sources()
    problems = []
    for line, lang, marked, body in blocks(doc.read_text()):
        if not lang:
            problems.append(f"{_name(doc)}:{line}: a fenced block without a language (```bash, ```text, ...)")
            continue
        if lang not in SHELL or marked:
            continue
        for cmd in commands(body):
            if cmd not in tested:
                problems.append(
                    f"{_name(doc)}:{line}: `{cmd}` is run by no test: run it in one, or mark the block "
                    "with <!-- not run by the tests: REASON --> on the line above it"
                )
    assert not problems, "\n".join(problems)


#: Repository paths as the docs write them, in backticks or as link targets.
PATH = re.compile(r"(?:`|\]\()((?:\.ci|benchmarks|configs|docs|src|tests)/[^`)\s]*|[A-Z][A-Z_]+\.md)[`)]")


@pytest.mark.parametrize("doc", CHECKED, ids=_name)
def test_every_repository_file_the_docs_name_exists(doc: Path) -> None:
    missing = []
    for m in PATH.finditer(doc.read_text()):
        path = m.group(1).split("#")[0].split("::")[0].rstrip(".,:;")
        if any(c in path for c in "<>{}*$") or "..." in path:
            continue  # a pattern or a placeholder, not one file
        path = re.sub(r":\d+(-\d+)?$", "", path)  # file:line
        if not (ROOT / path).exists():
            missing.append(path)
    assert not missing, f"{_name(doc)} names files that are not in the repository: {missing}"


MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
#: Wording tied to one machine, one day or one working copy.
SPECIFIC = [
    r"\bthis (?:\d+-core |shared |development |loaded |busy )*machine\b",
    r"\b(?:the|our) (?:shared|busy|loaded|heavily loaded|project's|development) (?:\d+-core )?machine\b",
    r"\bload average\b",
    r"\b(?:this|that) session\b",
    r"\b(?:today|yesterday|tonight)\b",
    rf"\b\d{{1,2}} (?:{MONTHS})\b",
    rf"\b(?:{MONTHS}) \d{{1,2}}\b",
    r"\.\./shared",
    r"(?<![\w.~$])/(?:work|home|root)/",
    r"\bDESIGN\.md\b",
]


@pytest.mark.parametrize("doc", CHECKED, ids=_name)
def test_the_docs_speak_of_the_software_not_of_one_machine_or_day(doc: Path) -> None:
    text = doc.read_text()
    hits = [
        f"{_name(doc)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
        for pattern in SPECIFIC
        for m in re.finditer(pattern, text, flags=re.IGNORECASE)
    ]
    assert not hits, "machine- or date-specific wording:\n" + "\n".join(hits)


def test_the_check_finds_what_it_looks_for() -> None:
    """The parsing above on a sample: a marked block, an unmarked one, continuations, comments."""
    sample = "x\n<!-- not run by the tests: needs a GPU -->\n```bash\nfelix a\n```\n\n```sh\n# c\nfelix b \\\n  --x 1  # why\n```\n"
    (b1, b2) = blocks(sample)
    assert b1[1:3] == ("bash", True) and b2[1:3] == ("sh", False)
    assert commands(b2[3]) == ["felix b --x 1"]
    assert re.search(SPECIFIC[0], "on this 2-core machine") and re.search(SPECIFIC[5], "rerun on 1 December")
    assert PATH.search("see `DESIGN.md`") and PATH.search("[x](docs/nope.md)")


DEFAULT_RUNS = ROOT / "docs" / "results" / "default-run"


def _default_row_figures(summary: dict[str, object], strategy: str) -> str:
    mb = (int(summary["bytes_down"]) + int(summary["bytes_up"])) / 1e6  # type: ignore[call-overload]
    unit = "virtual s" if strategy == "fedbuff" else "s"  # the row names the unit once, at fedbuff
    return (
        f"{summary['time_to_target_s']:.0f} {unit} (final {summary['final_accuracy']:.3f}, "
        f"{summary['aggregations']} aggregations, {mb:.1f} MB)"
    )


def test_the_default_scenarios_figures_in_configs_md_are_the_committed_runs() -> None:
    """docs/configs.md quotes `felix run` on the default scenario from the summaries committed
    under docs/results/default-run/ (the slow test below reruns one of them)."""
    row = next(
        ln for ln in (ROOT / "docs" / "configs.md").read_text().splitlines() if ln.startswith("| `default` |")
    )
    for strategy in ("fedbuff", "felix"):
        summary = json.loads((DEFAULT_RUNS / strategy / "summary.json").read_text())
        assert summary["strategy"] == strategy and summary["stop_reason"] == "target_reached"
        assert f"`{strategy}` seed 0" in row and _default_row_figures(summary, strategy) in row, row


@pytest.mark.slow
def test_felix_run_on_the_default_scenario_gives_the_committed_figures(tmp_path: Path) -> None:
    """The README's ``felix run`` (the default scenario, fedbuff, seed 0) once more: the same time to
    target, aggregations and bytes as the committed summary that docs/configs.md quotes."""
    from felix.cli import main

    assert main(["run", "-q", "--out", str(tmp_path / "run")]) == 0
    got = json.loads((tmp_path / "run" / "summary.json").read_text())
    want = json.loads((DEFAULT_RUNS / "fedbuff" / "summary.json").read_text())
    keys = ("time_to_target_s", "aggregations", "bytes_down", "bytes_up", "final_accuracy")
    assert {k: got[k] for k in keys} == {k: want[k] for k in keys}
