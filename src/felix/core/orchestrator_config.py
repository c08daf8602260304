"""The orchestrator's settings: which round and availability policy it runs, and the settings the
built-in policies share.

Apart from ``felix.core.orchestrator`` so that a shell or a test can make and check one without
the orchestrator, and so that the policies' registries (which validate the names) stay below it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from felix.core.admission import AdmissionConfig
from felix.core.availability import AVAILABILITY
from felix.core.rounds import ROUND_POLICIES


class AvailabilityName(str, Enum):
    """The built-in availability policies' names (``felix.core.availability`` has their behaviour);
    ``OrchestratorConfig.knowledge`` also takes the name of any other registered policy."""

    NONE = "none"
    ORACLE = "oracle"
    TIERTRACK = "tiertrack"


@dataclass(frozen=True, slots=True)
class OrchestratorConfig:
    """The round policy (``mode``) and availability policy (``knowledge``) are registered names
    (``felix.core.rounds.ROUND_POLICIES``, ``felix.core.availability.AVAILABILITY``), with their own
    parameters in ``mode_params`` / ``knowledge_params``; the fields between are the settings the
    built-in round policies share.

    The two fields keep the names of the config keys they come from (``orchestrator.mode``,
    ``orchestrator.knowledge``), which committed comparison files use; code reads them as
    ``round_policy`` and ``availability``, the names of what they choose."""

    mode: str = "async"  # "sync" rounds or "async" buffered, or another registered round policy
    agg_goal: int = 10
    concurrency: int = 30  # async: training tasks kept in flight
    overcommit: float = 1.3  # sync: clients selected per round = ceil(agg_goal * overcommit)
    deadline_s: float | None = None  # sync: end the round with what has arrived
    cancel_stragglers: bool = True  # sync: cancel a round's outstanding tasks when it ends
    task_timeout_s: float | None = 90.0
    accept_late: bool = True  # aggregate replies of timed-out / interrupted tasks (stale)
    max_staleness: int | None = None  # discard updates staler than this (versions)
    # Keep only each client's oldest task that lost its slot (newer ones are cancelled): open tasks
    # bounded by the population. The MQTT server always sets it; off by default in the simulator,
    # where every late reply may still come, as on the FeLiX authors' server.
    one_late_task_per_client: bool = False
    # An eval task's utility is a full forward pass on the received model; a training task's is
    # measured during SGD, so it is lower. This factor puts eval utilities on the training scale
    # (1.0: as measured, the paper), so Oort does not favour clients merely for having been probed.
    eval_utility_scale: float = 1.0
    # An eval task that times out while its client still owes the reply of an older task (one that
    # lost its slot, e.g. a training task paused when the client went AVL_EVAL) waits behind it:
    # the device runs its tasks in order. With this set, that timeout does not tell the
    # availability policy (TierTrack would mark the client UN_AVL): the client is busy, not gone.
    spare_queued_evals: bool = False
    # False: clients that still owe an older task's reply are not probed (their eval would wait
    # behind that task, its model download wasted on a stale measurement). True: the paper.
    probe_busy_clients: bool = True
    knowledge: AvailabilityName | str = AvailabilityName.NONE
    mode_params: Any = None  # the round policy's parameters (a mapping or its pydantic model)
    knowledge_params: Any = None  # the availability policy's parameters
    # Per-client flap damping and task budget (felix.core.admission); the defaults never bind on
    # the shipped scenarios' honest clients.
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)

    @property
    def round_policy(self) -> str:
        """The round policy's registered name or import path (the ``mode`` field)."""
        return self.mode

    @property
    def availability(self) -> str:
        """The availability policy's registered name or import path (the ``knowledge`` field)."""
        k = self.knowledge
        return k.value if isinstance(k, AvailabilityName) else str(k)

    def __post_init__(self) -> None:
        ROUND_POLICIES.entry(
            self.mode
        )  # a registered name or import path, else a RegistryError naming the key
        if self.knowledge in set(AvailabilityName):
            object.__setattr__(self, "knowledge", AvailabilityName(self.knowledge))
        else:
            AVAILABILITY.entry(str(self.knowledge))
        if self.agg_goal < 1:
            raise ValueError("agg_goal must be at least 1")
        if self.overcommit < 1.0:
            raise ValueError("overcommit must be >= 1.0")
        for name in ("deadline_s", "task_timeout_s"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be positive or null")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0 or null")
        if not self.eval_utility_scale > 0:
            raise ValueError("eval_utility_scale must be > 0")


__all__ = ["AvailabilityName", "OrchestratorConfig"]
