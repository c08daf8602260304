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
from typing import Any, TypeVar

from pydantic import BaseModel

from felix.config import ConfigError
from felix.core.registry import NoParams, RegistryError, import_object
from felix.core.registry import Registry as CoreRegistry

F = TypeVar("F", bound=Callable[..., Any])


class Registry(CoreRegistry[F]):
    """Name -> callable for one kind of scenario part: the core registry
    (:class:`felix.core.registry.Registry`, one for every component kind) holding plain callables
    with the kind's documented signature rather than ``factory(params, ctx)``; their parameters
    are the config's keyword mapping for the kind (``dataset.params``, ``model_params``).

    ``key`` is the config key the value comes from (for error messages), ``signature`` the
    callable's documented signature (said in every error about a wrong entry).
    """

    def __init__(self, kind: str, key: str, signature: str) -> None:
        super().__init__(kind, key=key)
        self.signature = signature

    def register(self, name: str, params: type[BaseModel] | None = None, **traits: Any) -> Callable[[F], F]:
        """Decorator: ``@MODELS.register("my_net")`` above a factory with the kind's signature."""
        if not name or ":" in name:
            raise ValueError(f"{self.kind} name {name!r}: must be non-empty and without ':'")
        add: Callable[[F], F] = super().register(name, params or NoParams, **traits)
        return add

    def resolve(self, ref: str) -> F:
        """The callable a config value names; ``ConfigError`` with the reason when there is none."""
        if ":" not in ref:
            try:
                return self._entries[ref].factory  # type: ignore[return-value]
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
