"""The configuration's foundations: the error every bad setting raises, the strict base model of
every section, and the checks of a scenario part or a strategy component against its registry
(imported only when a config is validated, as they may import torch)."""

from __future__ import annotations

import importlib
from typing import Any

from felix.core.settings import ConfigError, Settings, unknown_key


class StrictModel(Settings):
    """The base of every config section: the core's settings base (``felix.core.settings``), so
    that a section and a component's own settings model are one kind of thing."""


def registered(module: str, registry: str, value: str) -> str:
    """A scenario part given as a registered name or an import path, checked against its registry
    (``felix.core.registry``). The registry's module is imported only here, when a config is
    validated: it may import torch, which merely importing this module must not."""
    reg = getattr(importlib.import_module(module), registry)
    try:
        return str(reg.check(value))
    except ConfigError as exc:
        raise ValueError(str(exc).removeprefix(f"{reg.key}: ")) from None


def check_part_params(module: str, registry: str, ref: str, params: Any) -> None:
    """A scenario part's keyword parameters checked against its model (the registry's
    ``check_params``); the registry's module is imported only here, as for :func:`registered`."""
    getattr(importlib.import_module(module), registry).check_params(ref, params)


def check_component(
    module: str, registry: str, name: str, params: Any = None, where: str | None = None, keep_key: bool = True
) -> None:
    """Check a strategy component against its registry (``felix.core.registry``): ``name`` is
    registered there or an import path, and ``params`` (when given) validate against the
    component's own typed parameters, so a config fails with one line naming the component and
    the key (``keep_key`` False: without the registry's own key, for a field validator whose
    error already names it). The registry's module is imported only here (it may import torch);
    the config keeps the mapping as written, so a run's written config is unchanged."""
    from felix.core.registry import RegistryError  # pydantic only

    reg = getattr(importlib.import_module(module), registry)
    try:
        reg.entry(name) if params is None else reg.parse(name, params, where)
    except RegistryError as exc:
        raise ValueError(str(exc) if keep_key else str(exc).removeprefix(f"{reg.key}: ")) from None


__all__ = ["ConfigError", "StrictModel", "check_component", "check_part_params", "registered", "unknown_key"]
