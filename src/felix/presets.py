"""Named strategies (the papers' table rows), named scenarios and named comparisons, read from the
YAML files shipped in ``felix/configs/`` (the repository's top-level ``configs/`` links there).

A strategy preset sets only the strategy axes (orchestrator round and availability policy, selectors,
aggregator); a scenario sets the data, population, traces and targets; a comparison runs named
variants of a base scenario (``felix.experiments.compare``). Merge order:
defaults <- scenario/config file <- strategy preset <- --set.

File names: a scenario or comparison is named after its file (``scenarios/felix-cpu-90.yaml`` is
``felix-cpu-90``). A strategy preset is named by its ``preset:`` key, because the papers' names hold
characters that are awkward in file names (``*`` is a shell wildcard and not allowed on Windows):
its file is the name with ``*`` -> ``-oracle`` and ``+`` -> ``-`` (``oort-async*`` lives in
``strategies/oort-async-oracle.yaml``), the same mapping as run folders; either name selects it.
The ``description:`` key of every file is documentation, not a setting.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any

from felix.config import ConfigError, read_yaml

#: The shipped configs (package data, so an installed wheel has them too).
CONFIG_DIR = Path(__file__).resolve().parent / "configs"

#: The seven strategies of the FeLiX paper's main comparison (the default of ``felix compare``).
MAIN_STRATEGIES = ("fedbuff", "oort", "oort*", "oort-async", "oort-async*", "refl*", "felix")

_META_KEYS = ("description", "preset")


def slug(name: str) -> str:
    """A strategy name as a file or folder name: ``oort-async*`` -> ``oort-async-oracle``."""
    return name.replace("*", "-oracle").replace("+", "-")


def _files(kind: str) -> list[Path]:
    folder = CONFIG_DIR / kind
    if not folder.is_dir():
        raise ConfigError(
            f"shipped configs not found at {folder}: a broken installation (reinstall felix-fl)"
        )
    return sorted(folder.glob("*.yaml"))


@cache
def _strategies() -> dict[str, tuple[dict[str, Any], str]]:
    """preset name -> (the config tree it sets, its description)."""
    out: dict[str, tuple[dict[str, Any], str]] = {}
    for f in _files("strategies"):
        doc = read_yaml(f)
        name = str(doc.get("preset", f.stem))
        if slug(name) != f.stem:
            raise ConfigError(f"{f}: strategy preset {name!r} must live in {slug(name)}.yaml")
        out[name] = ({k: v for k, v in doc.items() if k not in _META_KEYS}, str(doc.get("description", "")))
    return out


@cache
def _scenarios() -> dict[str, tuple[dict[str, Any], str]]:
    out: dict[str, tuple[dict[str, Any], str]] = {}
    for f in _files("scenarios"):
        doc = read_yaml(f)
        out[f.stem] = ({k: v for k, v in doc.items() if k not in _META_KEYS}, str(doc.get("description", "")))
    return out


def strategy_names() -> list[str]:
    return sorted(_strategies())


def scenario_names() -> list[str]:
    return sorted(_scenarios())


def comparison_names() -> list[str]:
    return [f.stem for f in _files("comparisons")]


def strategy_preset(name: str) -> dict[str, Any]:
    """The config tree of strategy preset ``name`` (its paper name, or its file stem)."""
    table = _strategies()
    found = table.get(name) or next((v for k, v in table.items() if slug(k) == name), None)
    if found is None:
        raise ConfigError(f"unknown strategy preset {name!r}; choose one of {sorted(table)}")
    return copy.deepcopy(found[0])


def scenario_preset(name: str) -> dict[str, Any]:
    try:
        return copy.deepcopy(_scenarios()[name][0])
    except KeyError:
        raise ConfigError(f"unknown scenario {name!r}; choose one of {scenario_names()}") from None


def comparison_file(name: str) -> Path:
    """The shipped comparison file ``name`` (its file stem)."""
    f = CONFIG_DIR / "comparisons" / f"{name}.yaml"
    if not f.is_file():
        raise ConfigError(
            f"unknown comparison {name!r}; give a comparison file or one of {comparison_names()}"
        )
    return f


def __getattr__(attr: str) -> Any:
    """``STRATEGIES`` / ``SCENARIOS``: name -> config tree, read from the files on first use."""
    if attr == "STRATEGIES":
        return {k: v[0] for k, v in _strategies().items()}
    if attr == "SCENARIOS":
        return {k: v[0] for k, v in _scenarios().items()}
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
