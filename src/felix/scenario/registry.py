"""Named scenario parts (models, datasets, partitioners, traces) that a config may also give as an
import path.

Each kind has one ``Registry`` that lives next to its built-in entries (``felix.scenario.models.MODELS``,
``datasets.DATASETS``, ``partition.PARTITIONERS``, ``traces.TRACES``). A config value is either a
registered name (``small_cnn``) or ``package.module:attribute`` naming a callable with the kind's
documented signature (``mypkg.nets:make_resnet``), so a user's own model or data needs no edit to
felix. Resolution imports the module on demand; an unknown name lists the registered ones, an import
path that fails says why and what was expected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from felix.config import ConfigError
from felix.core.registry import RegistryError, import_object

F = TypeVar("F", bound=Callable[..., Any])


class Registry(Generic[F]):
    """Name -> callable for one kind of scenario part.

    ``key`` is the config key the value comes from (for error messages), ``signature`` the
    callable's documented signature (said in every error about a wrong entry).
    """

    def __init__(self, kind: str, key: str, signature: str) -> None:
        self.kind = kind
        self.key = key
        self.signature = signature
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: ``@MODELS.register("my_net")`` above a factory with the kind's signature."""
        if not name or ":" in name:
            raise ValueError(f"{self.kind} name {name!r}: must be non-empty and without ':'")

        def add(fn: F) -> F:
            if name in self._entries and self._entries[name] is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = fn
            return fn

        return add

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def resolve(self, ref: str) -> F:
        """The callable a config value names; ``ConfigError`` with the reason when there is none."""
        if ":" not in ref:
            try:
                return self._entries[ref]
            except KeyError:
                raise ConfigError(
                    f"{self.key}: unknown {self.kind} {ref!r}; registered: {', '.join(self.names())}, "
                    f"or give an import path 'package.module:function' to a {self.signature}"
                ) from None
        expected = f"expected 'package.module:function' naming a {self.signature}"
        try:
            obj = import_object(ref)
        except RegistryError as exc:
            raise ConfigError(f"{self.key}: {exc}; {expected}") from None
        if not callable(obj):
            raise ConfigError(f"{self.key}: {ref!r} is a {type(obj).__name__}, not callable; {expected}")
        return obj  # type: ignore[no-any-return]

    def check(self, ref: str) -> str:
        """``ref`` unchanged when it resolves (used by the config's validators)."""
        self.resolve(ref)
        return ref

    def wrong(self, ref: str, what: str) -> ConfigError:
        """The error for an entry that ran but gave the wrong thing."""
        return ConfigError(f"{self.key}: {self.kind} {ref!r} {what}; expected a {self.signature}")
