"""Where ``felix run`` writes, so that no run ever replaces an earlier one's results.

The default folder is ``runs/<name>-<strategy>-s<seed>`` (``name``: the config's, ``digits-churn90``
for the default scenario); ``--set`` overrides (and ``--flower-app``) add a short hash of the
resolved config, ``-<6 hex digits>``, so that a run with other values lands beside the plain one
and the same command lands in the same place. A default folder that already holds files gets the
next free number instead (``...-s0-2``, ``-3``, ...), and the command says so. An explicit
``--out`` that holds files is refused unless ``--force``. A run that fails before it writes
anything leaves no folder behind.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from felix.config import Config, ConfigError


def config_digest(cfg: Config) -> str:
    """Six hex digits of the resolved config: the same values, the same digest."""
    return hashlib.sha256(cfg.model_dump_json().encode()).hexdigest()[:6]


def default_folder(cfg: Config, sets: dict[str, Any]) -> Path:
    """``runs/<name>-<strategy>-s<seed>``, with ``-<digest>`` when ``--set`` changed the config."""
    base = f"runs/{cfg.name}-{cfg.strategy}-s{cfg.seed}"
    return Path(f"{base}-{config_digest(cfg)}" if sets else base)


def _holds_files(folder: Path) -> bool:
    return folder.is_dir() and any(folder.iterdir())


def choose_folder(cfg: Config, sets: dict[str, Any], out: str | None, force: bool) -> tuple[Path, str | None]:
    """The folder this run writes to, and a line to print when it is not the one asked for."""
    if out is not None:
        folder = Path(out)
        if _holds_files(folder) and not force:
            raise ConfigError(
                f"--out {folder} already holds a run's files; pass --force to write over them "
                "or choose another --out"
            )
        return folder, None
    folder = default_folder(cfg, sets)
    if force or not _holds_files(folder):
        return folder, None
    n = 2
    while _holds_files(Path(f"{folder}-{n}")):
        n += 1
    chosen = Path(f"{folder}-{n}")
    return chosen, f"{folder} holds an earlier run (kept); this one goes to {chosen}"


def missing_parents(folder: Path) -> list[Path]:
    """``folder`` and those of its parents that do not exist yet, innermost first."""
    out = []
    for p in [folder, *folder.parents]:
        if p.exists():
            break
        out.append(p)
    return out


def remove_empty(created: list[Path]) -> None:
    """Remove the folders a failed run created, innermost first, as long as they are empty."""
    for p in created:
        if not p.is_dir() or any(p.iterdir()):
            return
        p.rmdir()
