"""Choosing and closing the backend that runs a batch of runs (``felix compare``, ``felix sweep``).

Apart from ``felix.experiments.runs`` (the run function and the local backends) because the Ray
backend (``felix.experiments.ray_backend``) is built on that module: choosing among them here keeps
the import one way, runs <- ray_backend <- backends.
"""

from __future__ import annotations

from felix.config import ConfigError
from felix.experiments.runs import Backend, InlineBackend, ProcessBackend, RunFunction, execute


def make_backend(
    kind: str,
    jobs: int | None,
    address: str | None = None,
    gpus_per_run: float = 1.0,
    fn: RunFunction = execute,
) -> Backend:
    """``local``: in this process (``jobs`` None or 1) or ``jobs`` spawned processes; ``ray``: Ray
    tasks on a local instance with ``jobs`` CPUs (None: all of this machine's), or on the cluster at
    ``address`` (its own resources; ``jobs`` must be None)."""
    if jobs is not None and jobs < 1:
        raise ConfigError(f"--jobs must be at least 1, got {jobs}")
    if kind == "local":
        return InlineBackend(fn) if (jobs or 1) == 1 else ProcessBackend(jobs or 1, fn)
    if kind == "ray":
        from felix.experiments.ray_backend import RayTaskBackend

        if address is not None and jobs is not None:
            raise ConfigError(
                "--jobs sizes a local Ray instance; with --address the cluster's resources decide"
            )
        return RayTaskBackend(address=address, num_cpus=jobs, gpus_per_run=gpus_per_run, fn=fn)
    raise ConfigError(f"unknown backend {kind!r}; choose local or ray")


def close_backend(backend: Backend) -> None:
    close = getattr(backend, "close", None)
    if close is not None:
        close()


__all__ = ["close_backend", "make_backend"]
