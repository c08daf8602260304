"""Name -> factory registries for the strategy policies, each living next to its base class.

A policy module registers its factory with a decorator, next to the class it builds::

    @TRAIN_SELECTORS.register("oort", params=OortSelectorParams)
    def _oort(params: OortSelectorParams, ctx: Any) -> OortSelector: ...

or registers a class that builds itself: a class with ``from_params(params, ctx)`` and its typed
parameters as ``params()`` (or a ``Params`` model), e.g. a client objective::

    @register_objective
    class FedProx(Objective): ...

and a config picks it by name (``selector: {name: oort, params: {...}}``) or by import path
(``selector: {name: "mypkg.selectors:make_mine"}``). ``params`` is a pydantic model: the config's
untyped ``params`` mapping is validated against it, so a misspelt key fails with its dotted path
(``selector.params.foo: unknown key``). ``ctx`` is whatever the builder passes along (the run's
facts, ``felix.core.run_facts.RunFacts``, for selectors, aggregators, server optimisers and
objectives; the ``orchestrator`` settings for round and availability policies); the registry never
looks at it.

The built-in policies' modules are imported on the first lookup (``modules``), so importing the
core stays cheap and a registry never depends on import order.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Generic, TypeVar, get_type_hints

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

T = TypeVar("T")


class RegistryError(ValueError):
    """An unknown policy name, an import path that does not resolve, or parameters that do not validate."""


class NoParams(BaseModel):
    """The parameter model of a policy that takes none."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def params_from_dataclass(dc: type, name: str | None = None, **extra: Any) -> type[BaseModel]:
    """A strict pydantic model with the fields (types, defaults) of the parameter dataclass ``dc``,
    plus ``extra`` fields given as ``name=(type, default)``: one source of truth for the defaults."""
    if not is_dataclass(dc):
        raise TypeError(f"{dc!r} is not a dataclass")
    hints = get_type_hints(dc)
    spec: dict[str, Any] = {}
    for f in fields(dc):
        default = (
            f.default
            if f.default is not MISSING
            else (f.default_factory() if f.default_factory is not MISSING else ...)
        )
        spec[f.name] = (hints[f.name], default)
    spec.update(extra)
    model: type[BaseModel] = create_model(  # type: ignore[call-overload]
        name or f"{dc.__name__}Model", __config__=ConfigDict(extra="forbid", frozen=True), **spec
    )
    return model


def import_object(ref: str) -> Any:
    """The object an import path ``package.module:attr`` (or ``attr.sub``) names: the one place
    both kinds of registry (these policies, and ``felix.scenario.registry``'s scenario parts)
    resolve a user's own code. ``RegistryError`` says why it does not resolve."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise RegistryError(f"{ref!r} is not an import path 'package.module:attribute'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - whatever the user's module raises is reported as a config error
        raise RegistryError(
            f"cannot import module {module_name!r} for {ref!r} ({type(exc).__name__}: {exc})"
        ) from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise RegistryError(f"module {module_name!r} has no attribute {attr!r}") from None
    return obj


def params_of(obj: Any) -> type[BaseModel]:
    """The parameter model a factory or component class owns: its ``params()`` (a classmethod
    returning a pydantic model), else its ``Params`` attribute, else ``NoParams``."""
    owns = isinstance(obj, type) and isinstance(inspect.getattr_static(obj, "params", None), classmethod)
    model = obj.params() if owns else getattr(obj, "Params", NoParams)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise RegistryError(f"{obj!r}: its parameters are not a pydantic model")
    return model


@dataclass(frozen=True)
class Entry(Generic[T]):
    """A registered factory (a function, or a class that builds itself with ``from_params``)."""

    name: str
    factory: Callable[..., Any]
    params: type[BaseModel]
    traits: Mapping[str, Any] = field(default_factory=dict)

    def build(self, params: BaseModel, ctx: Any) -> T:
        make = getattr(self.factory, "from_params", None)
        if isinstance(self.factory, type) and make is not None:
            return make(params, ctx)  # type: ignore[no-any-return]
        return self.factory(params, ctx)  # type: ignore[no-any-return]


class Registry(Generic[T]):
    """Policies of one kind. ``kind`` names them in errors, ``key`` is the config key that holds
    the name (default ``<kind>.name``)."""

    def __init__(self, kind: str, modules: Iterable[str] = (), key: str | None = None) -> None:
        self.kind = kind
        self.key = key or f"{kind}.name"
        self._modules = tuple(modules)
        self._loaded = False
        self._entries: dict[str, Entry[T]] = {}

    def register(
        self, name: str, params: type[BaseModel] | None = None, **traits: Any
    ) -> Callable[[Any], Any]:
        """Decorator: register ``factory(params, ctx) -> policy`` (a function or a class), or a
        class with ``from_params``, under ``name``; ``params`` defaults to the one it owns
        (:func:`params_of`). ``traits`` are what the component declares about itself for the
        constraints between axes, checked generically (e.g. ``reads_aux=("qffl_loss",)``: the
        client aux an aggregator reads)."""

        def deco(factory: Any) -> Any:
            old = self._entries.get(name)
            if old is not None and old.factory is not factory:
                raise RegistryError(f"{self.kind} {name!r} is already registered")
            model = params if params is not None else params_of(factory)
            self._entries[name] = Entry(name, factory, model, dict(traits))
            return factory

        return deco

    def names(self) -> list[str]:
        self._load()
        return sorted(self._entries)

    def having(self, trait: str, value: Any) -> list[str]:
        """The registered names whose ``trait`` holds ``value`` (a member of a tuple trait)."""
        self._load()
        return [n for n, e in sorted(self._entries.items()) if value in e.traits.get(trait, ())]

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        try:
            self.entry(name)
        except RegistryError:
            return False
        return True

    def entry(self, name: str) -> Entry[T]:
        """The entry of a registered name, or of a ``pkg.module:attr`` import path (registered by
        importing its module, or a plain factory whose ``Params`` attribute, if any, is its model)."""
        self._load()
        if name in self._entries:
            return self._entries[name]
        if ":" not in name:
            raise RegistryError(
                f"{self.key}: unknown {self.kind} {name!r}; choose one of {self.names()} "
                f"or give an import path 'package.module:factory'"
            )
        try:
            obj = import_object(name)
        except RegistryError as exc:
            raise RegistryError(f"{self.key}: {exc}") from None
        for e in self._entries.values():
            if e.factory is obj:
                return e
        if not callable(obj):
            raise RegistryError(f"{self.key}: {name!r} is not callable")
        try:
            params = params_of(obj)
        except RegistryError:
            raise RegistryError(f"{self.key}: {name!r}'s parameters are not a pydantic model") from None
        return Entry(name, obj, params)

    def parse(self, name: str, raw: dict[str, Any] | BaseModel | None, where: str | None = None) -> BaseModel:
        """Validate ``raw`` against ``name``'s parameter model; errors name the key under ``where``
        (default ``<kind>.params``)."""
        entry = self.entry(name)
        if isinstance(raw, entry.params):
            return raw
        where = where or f"{self.kind}.params"
        try:
            return entry.params.model_validate(dict(raw or {}))
        except ValidationError as exc:
            lines = []
            for err in exc.errors():
                loc = ".".join(str(x) for x in (where, *err["loc"]))
                lines.append(f"{loc}: {'unknown key' if err['type'] == 'extra_forbidden' else err['msg']}")
            raise RegistryError(f"{self.kind} {name!r}: " + "; ".join(lines)) from None

    def create(
        self, name: str, raw: dict[str, Any] | BaseModel | None, ctx: Any = None, where: str | None = None
    ) -> T:
        """Build the policy ``name`` with validated parameters; its own ValueErrors name the policy."""
        params = self.parse(name, raw, where)
        try:
            return self.entry(name).build(params, ctx)
        except RegistryError:
            raise
        except (TypeError, ValueError) as exc:
            raise RegistryError(f"{self.kind} {name!r}: {exc}") from None

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True
            for m in self._modules:
                importlib.import_module(m)
