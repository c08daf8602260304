"""Start or join Ray, safe by default, and say what a run needs from it.

Unless told otherwise Ray binds its servers to every interface, reports usage statistics, and its
usage module probes cloud metadata servers (169.254.169.254, metadata.google.internal) to learn
where it runs, even with statistics disabled and without a dashboard. A local instance started here
does none of that, set in code rather than left to the user's environment (checked against Ray 2.60's
source):

- loopback only: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` makes Ray resolve the node address to
  127.0.0.1 instead of the machine's outward address, and a node whose address is 127.0.0.1 has its
  GCS, raylet, object manager and worker servers listen on 127.0.0.1 only;
- no usage statistics: ``RAY_USAGE_STATS_ENABLED=0`` (and no prompt about them, and the report
  URL pointed at loopback);
- no cloud-metadata probes: the usage module reads ``~/ray_bootstrap_config.yaml`` and probes the
  metadata servers only when that file is missing; Ray's processes here get a Ray home of their own
  (``HOME``) holding such a file. Ray's auth token also lands in that home, not the user's;
- no dashboard (``include_dashboard=False``), no log forwarding noise beyond warnings;
- workers at normal priority (Ray's default nice 15 starves them on a shared machine).

Joining an existing cluster (``address``) leaves its settings to whoever started it: docs/ray.md
says how to start one with the same defaults.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from felix.config import ConfigError

LOOPBACK = "127.0.0.1"
SAFE_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_USAGE_STATS_PROMPT_ENABLED": "0",
    # A cluster not started by ray.init posts a "stats disabled" notice to this URL even with
    # statistics off; should that ever apply here, it goes nowhere (discard port on loopback).
    "RAY_USAGE_STATS_REPORT_URL": "http://127.0.0.1:9/",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    # Ray starts workers at nice 15 by default: on a machine shared with other work they would get
    # a sliver of the CPU that the same runs get one by one (Ray's job manager also sets 0).
    "RAY_worker_niceness": "0",
}
BOOTSTRAP_CONFIG = "ray_bootstrap_config.yaml"
_BOOTSTRAP_TEXT = (
    "# Written by felix: Ray's usage module reads this file instead of probing cloud metadata servers.\n"
    "cluster_name: felix-local\n"
    "provider:\n"
    "  type: local\n"
)


def import_ray() -> ModuleType:
    """``ray``, or a clear error naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise ConfigError('the ray backend needs Ray: pip install "felix-fl[ray]"') from None
    return ray


def ray_home() -> Path:
    """The HOME Ray's local processes get: per user, holding the bootstrap config that stops the probes."""
    home = Path(tempfile.gettempdir()) / f"felix-ray-home-{os.getuid()}"
    home.mkdir(mode=0o700, exist_ok=True)
    cfg = home / BOOTSTRAP_CONFIG
    if not cfg.exists() or cfg.read_text() != _BOOTSTRAP_TEXT:
        cfg.write_text(_BOOTSTRAP_TEXT)
    return home


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_local(num_cpus: int | None = None, num_gpus: int | None = None) -> Any:
    """Start a Ray instance on this machine with the safe defaults above; returns Ray's context."""
    # The settings must be in the environment before Ray is imported (it reads some at import) and
    # while ray.init spawns its processes (they inherit them, and pass them on to the workers).
    os.environ.update(SAFE_ENV)
    ray = import_ray()
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # in case Ray was imported before the environment was set
    with _env({"HOME": str(ray_home())}):
        return ray.init(
            address="local",
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            include_dashboard=False,
            _node_ip_address=LOOPBACK,
            logging_level=logging.WARNING,
        )


def join(address: str) -> Any:
    """Connect this driver to the running cluster at ``address`` (``HOST:PORT`` of its head, or ``auto``)."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray = import_ray()
    try:
        return ray.init(address=address, logging_level=logging.WARNING)
    except ConnectionError as exc:
        raise ConfigError(f"cannot join the Ray cluster at {address}: {exc}") from None


@contextlib.contextmanager
def session(address: str | None = None, num_cpus: int | None = None) -> Iterator[Any]:
    """Ray for the length of a ``with`` block: an instance already connected in this process is
    reused (and left running); otherwise a local one is started, or the cluster at ``address``
    joined, and shut down / left at the end."""
    already = sys.modules.get("ray")
    if already is not None and already.is_initialized():
        yield already
        return
    if address is None:
        start_local(num_cpus=num_cpus)
    else:
        join(address)
    import ray as ray_mod

    try:
        yield ray_mod
    finally:
        ray_mod.shutdown()


@dataclass(frozen=True)
class Resources:
    """What one run asks the Ray scheduler for, from its config: ``run.threads`` CPUs, plus a GPU
    share when ``run.device`` is a CUDA device (``gpus_per_run`` below 1 packs small runs onto one GPU)."""

    num_cpus: float
    num_gpus: float

    @classmethod
    def for_run(cls, device: str, threads: int | None, gpus_per_run: float = 1.0) -> Resources:
        if not 0 < gpus_per_run <= 1 and not (gpus_per_run > 1 and float(gpus_per_run).is_integer()):
            raise ConfigError(f"--gpus-per-run must be in (0, 1] or a whole number, got {gpus_per_run}")
        gpu = device == "cuda" or device.startswith("cuda:")
        return cls(num_cpus=float(threads or 1), num_gpus=gpus_per_run if gpu else 0.0)
