"""Where a result came from: package version, git commit, torch build, CPU, device and threads.

Every summary carries this so that a figure in the docs can be traced to the code and machine
that produced it, and a rerun on another core count, torch build or CPU is recognisable as such.
The CPU matters as much as the torch build: torch picks its vectorised kernels (and its BLAS its
code path) by the instruction set, so the same seed rounds differently on an AVX2 and an AVX-512
machine and a run's trajectory drifts apart (docs/felix.md, "Why the committed runs did not
reproduce").
"""

from __future__ import annotations

import platform
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

import felix


@lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


@lru_cache(maxsize=1)
def git_commit() -> dict[str, Any] | None:
    """The commit of the source tree felix is imported from, and whether it had local changes;
    None when it is not a git checkout (an installed wheel) or git is missing."""
    src = Path(felix.__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "-C", str(src), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head, "dirty": bool(dirty)}


def provenance(run_settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """Versions, commit and the torch threads in force now; ``run_settings`` (the config's ``run``
    section: device, threads, cohort) is recorded as given."""
    import torch

    out: dict[str, Any] = {
        "felix_version": felix.__version__,
        "git": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    if torch.cuda.is_available():
        out["cuda_device"] = torch.cuda.get_device_name(0)
    if run_settings is not None:
        out["run"] = run_settings
    return out


def portable_path(path: str | Path) -> str:
    """``path`` as a result file records it: as given when relative, under ``felix/`` for a file
    shipped in the package (a comparison file under ``felix/configs``), relative to the working
    directory when below it, else its name alone. A machine's absolute paths say nothing to a reader
    of the result elsewhere; the commit in the provenance says which files were used."""
    p = Path(path)
    if not p.is_absolute():
        return str(p)
    resolved = p.resolve()
    for base, prefix in ((Path(felix.__file__).resolve().parent, "felix"), (Path.cwd().resolve(), "")):
        try:
            rel = resolved.relative_to(base)
        except ValueError:
            continue
        return str(Path(prefix) / rel) if prefix else str(rel)
    return p.name


def portable_command(argv: list[str]) -> list[str]:
    """A command line as a result file records it: the program as ``felix`` when it is felix's entry
    point (``felix`` or ``python -m felix``'s ``__main__.py``) and every absolute path argument made
    portable (:func:`portable_path`), so the line can be rerun from a checkout anywhere."""
    out = [portable_path(a) if Path(a).is_absolute() else a for a in argv]
    if out and Path(argv[0]).name in ("felix", "__main__.py"):
        out[0] = "felix"
    return out
