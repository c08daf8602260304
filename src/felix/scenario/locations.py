"""Where datasets and trace files live: two settings, each an environment variable with a default.

- ``FELIX_DATA``: the folder that relative ``dataset.root`` values resolve against (e.g. the
  shipped ``felix-cifar10`` scenario's ``root: cifar10-jpeg.tar.gz``). Default
  ``$XDG_DATA_HOME/felix-fl/data``, i.e. ``~/.local/share/felix-fl/data``.
- ``FELIX_TRACES``: the folder that relative ``trace.path`` values resolve against (the shipped
  MobiPerf scenarios say ``path: mobiperf-300.json``). Default ``$FELIX_DATA/traces``.

A relative path that exists from the working directory is used as it is, so configs that name
files next to them (or ``../somewhere/x.json``) keep working; otherwise it is looked up under the
setting's folder. An absolute path is used as it is. README.md ("Data and traces") says where each
dataset and the MobiPerf trace come from.
"""

from __future__ import annotations

import os
from pathlib import Path

from felix.scenario.errors import DatasetError, TraceError

DATA_ENV = "FELIX_DATA"
TRACES_ENV = "FELIX_TRACES"


def data_dir() -> Path:
    """The dataset folder: ``$FELIX_DATA``, else ``$XDG_DATA_HOME/felix-fl/data`` (``~/.local/share``)."""
    env = os.environ.get(DATA_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(xdg) / "felix-fl" / "data"


def traces_dir() -> Path:
    """The trace folder: ``$FELIX_TRACES``, else ``data_dir() / "traces"``."""
    env = os.environ.get(TRACES_ENV)
    return Path(env).expanduser() if env else data_dir() / "traces"


def _resolve(path: str, folder: Path, env: str, what: str, error: type[Exception]) -> Path:
    p = Path(path).expanduser()
    if p.is_absolute():
        if not p.exists():
            raise error(f"{what} {p} not found")
        return p
    if p.exists():
        return p
    under = folder / p
    if under.exists():
        return under
    setting = (
        f"${env}={os.environ[env]}" if os.environ.get(env) else f"{folder} (the default; ${env} is not set)"
    )
    raise error(
        f"{what} {path!r} not found: neither {Path.cwd() / p} nor under {setting}; "
        f"set {env} to the folder that holds it (README.md, 'Data and traces')"
    )


def trace_file(path: str) -> Path:
    """A config's ``trace.path`` as a file that exists (see the module docstring for the rule); a
    ``TraceError`` naming ``FELIX_TRACES`` when there is none."""
    return _resolve(path, traces_dir(), TRACES_ENV, "trace file", TraceError)


def dataset_root(root: str) -> Path:
    """A config's ``dataset.root`` (a folder or archive) as a path that exists; a ``DatasetError``
    naming ``FELIX_DATA`` when there is none."""
    return _resolve(root, data_dir(), DATA_ENV, "dataset root", DatasetError)
