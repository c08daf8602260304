"""The base of every validated settings model: the orchestrator's, admission's and validation's
here in ``felix.core``, and every section of the run configuration (``felix.config``), which
reads these very models instead of keeping twins of them.

Strict: an unknown key is refused, a model is frozen once built, a number given where a string is
expected (``name: 2024``) is taken as its text, and numbers are finite (an infinite learning rate,
time limit or horizon is a mistyped setting, not a setting). Pydantic only: no torch.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration that cannot run; the message says which key and why. (Here, beside the
    settings base, so that the core's registries raise it too: ``felix.core.registry.RegistryError``
    is one.)"""


def unknown_key(key: str, known: Iterable[str]) -> str:
    """The problem of an unknown key, with the nearest of the ``known`` ones when one is close."""
    near = difflib.get_close_matches(key, list(known), n=1)
    return "unknown key" + (f" (did you mean `{near[0]}`?)" if near else "")


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, coerce_numbers_to_str=True, allow_inf_nan=False)


__all__ = ["ConfigError", "Settings", "unknown_key"]
