"""The orchestrator's settings: which round and availability policy it runs, and the settings the
built-in policies share. One validated model, which the run configuration holds as its
``orchestrator`` section and the orchestrator reads directly.

Apart from ``felix.core.orchestrator`` so that a shell or a test can make and check one without
the orchestrator, and so that the policies' registries (which validate the names) stay below it.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import Field, field_validator, model_validator

from felix.core.admission import AdmissionConfig
from felix.core.availability import AVAILABILITY
from felix.core.key_aliases import renamed
from felix.core.registry import Registry, RegistryError
from felix.core.rounds import ROUND_POLICIES, ROUND_SETTINGS
from felix.core.settings import Settings


class AvailabilityName(str, Enum):
    """The built-in availability policies' names (``felix.core.availability`` has their behaviour);
    ``OrchestratorConfig.availability`` also takes the name of any other registered policy."""

    NONE = "none"
    ORACLE = "oracle"
    TIERTRACK = "tiertrack"


class OrchestratorConfig(Settings):
    """The config's ``orchestrator`` section, read by the orchestrator as it is. The round policy
    (``round_policy``) and availability policy (``availability``) are registered names
    (``felix.core.rounds.ROUND_POLICIES``, ``felix.core.availability.AVAILABILITY``), with their own
    parameters in ``round_policy_params`` / ``availability_params``; the fields between are the
    settings the built-in round policies share.

    A config may still give them under their old keys (``mode``, ``knowledge``, ``mode_params``,
    ``knowledge_params``), in a file or as keywords: ``felix.core.key_aliases`` renames them."""

    round_policy: str = Field(
        "async",
        description="round policy: sync | async, or a registered name or import path "
        "(felix.core.rounds.ROUND_POLICIES); its parameters in round_policy_params (old key: mode)",
    )
    agg_goal: int = Field(10, ge=1)
    concurrency: int = Field(30, ge=1, description="async: training tasks kept in flight")
    overcommit: float = Field(
        1.3, ge=1, description="sync: clients selected per round = ceil(agg_goal x overcommit)"
    )
    deadline_s: float | None = Field(None, gt=0, description="sync: end the round with what has arrived")
    cancel_stragglers: bool = Field(True, description="sync: cancel a round's outstanding tasks when it ends")
    task_timeout_s: float | None = Field(90.0, gt=0)
    accept_late: bool = Field(True, description="aggregate replies of timed-out or interrupted tasks (stale)")
    max_staleness: int | None = Field(None, ge=0, description="discard updates staler than this (versions)")
    # Off by default in the simulator, where every late reply may still come, as on the FeLiX
    # authors' server; the MQTT server always sets it.
    one_late_task_per_client: bool = Field(
        False,
        description="keep only each client's oldest task that "
        "timed out (newer ones cancelled): open tasks bounded by the population; "
        "felix serve always sets it",
    )
    # An eval task's utility is a full forward pass on the received model; a training task's is
    # measured during SGD, so it is lower. This factor puts eval utilities on the training scale
    # (1.0: as measured, the paper), so Oort does not favour clients merely for having been probed.
    eval_utility_scale: float = Field(
        1.0,
        gt=0,
        description="multiplies the statistical utility an eval task "
        "reports, to put it on the training utilities' scale (1: as measured)",
    )
    # The device runs its tasks in order, so an eval task queued behind an older one waits; with
    # this set its timeout does not tell the availability policy (TierTrack would mark the client
    # UN_AVL): the client is busy, not gone.
    spare_queued_evals: bool = Field(
        False,
        description="an eval task that times out while its client still owes an "
        "older task's reply (it waits behind it) does not mark the client unavailable",
    )
    # False: such clients are not probed (their eval would wait behind that task, its model
    # download wasted on a stale measurement). True: the paper.
    probe_busy_clients: bool = Field(
        True,
        description="eval probes may go to clients that still owe an older task's "
        "reply (false: they are skipped, as their eval would wait behind it)",
    )
    availability: str = Field(
        AvailabilityName.NONE.value,
        description="availability policy: none | oracle | tiertrack, or a registered name or import "
        "path (felix.core.availability.AVAILABILITY); parameters in availability_params (old key: knowledge)",
    )
    round_policy_params: dict[str, Any] = Field(
        default_factory=dict, description="the round policy's typed parameters (old key: mode_params)"
    )
    availability_params: dict[str, Any] = Field(
        default_factory=dict,
        description="the availability policy's typed parameters (old key: knowledge_params)",
    )
    admission: AdmissionConfig = AdmissionConfig()

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        return renamed(data, ("orchestrator",)) if isinstance(data, dict) else data

    @field_validator("round_policy")
    @classmethod
    def _round_policy(cls, v: str) -> str:
        return _registered(ROUND_POLICIES, v)

    @field_validator("availability")
    @classmethod
    def _availability(cls, v: str) -> str:
        return _registered(AVAILABILITY, v)

    def unread_settings(self) -> list[str]:
        """The round settings (``felix.core.rounds.ROUND_SETTINGS``) set to other than their
        default that the chosen round policy does not read (its ``reads`` trait), so do nothing:
        ``concurrency`` under ``sync``, say. A policy that declares no ``reads`` has none. At its
        default a setting changes nothing either way, so a preset's round policy can be switched."""
        reads = ROUND_POLICIES.entry(self.round_policy).traits.get("reads")
        if reads is None:
            return []
        fields = type(self).model_fields
        return [k for k in ROUND_SETTINGS if k not in reads and getattr(self, k) != fields[k].get_default()]


def _registered(registry: Registry[Any], name: str) -> str:
    """``name`` if ``registry`` holds it (or it is an import path that resolves); else the
    registry's error, without its key (the validation error names the field)."""
    try:
        registry.entry(name)
    except RegistryError as exc:
        raise ValueError(str(exc).removeprefix(f"{registry.key}: ")) from None
    return name


__all__ = ["AvailabilityName", "OrchestratorConfig"]
