"""Whole runs as Ray tasks: the ``ray`` backend of ``felix compare`` and ``felix sweep``.

Each run is one task that calls the same run function as the local backends (``felix.experiments.runs.execute``)
and returns its small output (summary and evaluation rows) to the driver, which stores it; nothing
is written on the node that ran it. Ray's own retries are off (``max_retries=0``): ``felix.experiments.runs``
retries a failed run once, whether its code raised or its worker or node died, and reports it after.
A Ctrl-C or SIGTERM of the driver cancels every task it sent (``ray.cancel``): a queued one never
starts, a running one is interrupted in its worker (and its worker killed if it has not stopped
``FORCE_AFTER_S`` later), and each is reported as cancelled.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from felix.config import ConfigError
from felix.distributed.ray_runtime import Resources, session
from felix.experiments.runs import RunCancelled, RunFunction, RunOutput, RunSpec, execute, warm_process

#: Longest a ``wait`` blocks: how soon the driver's loop sees a Ctrl-C and cancels.
WAIT_S = 1.0
#: How long after the first (polite) cancel a task still running has its worker killed: Ray can
#: lose a polite cancel that reaches a task as it starts, and re-sending it does not help.
FORCE_AFTER_S = 10.0


class RayTaskBackend:
    """Runs specs as Ray tasks with declared resources, on a local safe instance (``num_cpus`` CPUs,
    default all) or on the cluster at ``address``. ``close`` stops a local instance it started.

    On a local instance every worker is warmed first (``felix.experiments.runs.warm_process``: one task per CPU,
    all at once, so each lands on its own worker), so runs do not each pay a fresh process's imports;
    that cost belongs to start-up."""

    def __init__(
        self,
        address: str | None = None,
        num_cpus: int | None = None,
        gpus_per_run: float = 1.0,
        fn: RunFunction = execute,
    ) -> None:
        self.gpus_per_run = gpus_per_run
        self._stack = contextlib.ExitStack()
        self.ray = self._stack.enter_context(session(address, num_cpus))
        self._task = self.ray.remote(fn)
        self._capacity = self.ray.cluster_resources()
        self._live: set[Any] = set()  # tasks sent and not yet returned by ``wait``
        self._cancel = False  # the driver was interrupted: ``wait`` cancels what is live
        self._cancelled_at: float | None = None  # when ``wait`` first cancelled (monotonic)
        if address is None:
            warm = self.ray.remote(warm_process).options(num_cpus=1, max_retries=0, name="felix-warm-up")
            self.ray.get([warm.remote() for _ in range(min(64, int(self._capacity.get("CPU", 1))))])

    def submit(self, spec: RunSpec) -> object:
        run = spec.config.run
        res = Resources.for_run(run.device, run.threads, self.gpus_per_run)
        for name, need in (("CPU", res.num_cpus), ("GPU", res.num_gpus)):
            if need > self._capacity.get(name, 0.0):
                raise ConfigError(
                    f"run {spec.key} needs {need:g} {name} (run.device {run.device!r}, run.threads "
                    f"{run.threads}) but the Ray cluster has {self._capacity.get(name, 0.0):g}"
                )
        if res.num_gpus:
            # Ray hands the task its GPU share as the only visible device: 'cuda:N' would point past it.
            spec = replace(
                spec, config=spec.config.model_copy(update={"run": run.model_copy(update={"device": "cuda"})})
            )
        ref = self._task.options(
            num_cpus=res.num_cpus, num_gpus=res.num_gpus, max_retries=0, name=f"felix-run:{spec.key}"
        ).remote(spec)
        self._live.add(ref)
        return ref

    def interrupt(self) -> None:
        """The driver was interrupted: cancel every task sent and not yet collected. This runs inside
        the driver's signal handler, which Python may call from within ``ray.wait``'s own signal
        checks, so it makes no Ray call there: it only asks ``wait`` (the driver's loop) to cancel."""
        self._cancel = True

    def wait(self, handles: list[Any]) -> Iterator[tuple[object, RunOutput | BaseException]]:
        """The next finished task, or nothing after ``WAIT_S`` so that the driver's loop comes back
        to an interrupt in time. Once interrupted, every live task is cancelled on each call: first
        politely (``ray.cancel`` not forced drops a queued task and raises ``KeyboardInterrupt`` in a
        running one, whose run ends ``interrupted`` and whose worker stays usable), and from
        ``FORCE_AFTER_S`` on by killing its worker. A task that ends in an error once the driver
        was interrupted (cancelled, or its worker killed) is reported as :class:`RunCancelled`."""
        if self._cancel:
            now = time.monotonic()
            if self._cancelled_at is None:
                self._cancelled_at = now
            force = now - self._cancelled_at >= FORCE_AFTER_S
            for ref in list(self._live):
                self.ray.cancel(ref, force=force)
        ready, _ = self.ray.wait(handles, num_returns=1, timeout=WAIT_S)
        for ref in ready:
            self._live.discard(ref)
            try:
                yield ref, self.ray.get(ref)
            except self.ray.exceptions.RayError as exc:  # task raised, cancelled, worker crashed, node died
                cancelled = self._cancel or isinstance(exc, self.ray.exceptions.TaskCancelledError)
                yield ref, RunCancelled("cancelled by the interrupted driver") if cancelled else exc

    def close(self) -> None:
        self._stack.close()
