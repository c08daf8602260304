"""Name -> factory registries, one class for every component kind, each registry living next to
its kind's base class or built-ins: the strategy policies here and in ``felix.strategies``, the
scenario parts (models, datasets, partitioners, traces, runtime profiles) in ``felix.scenario``.

A policy module registers its factory with a decorator, next to the class it builds::

    @TRAIN_SELECTORS.register("oort", params=OortSelectorParams)
    def _oort(params: OortSelectorParams, ctx: Any) -> OortSelector: ...

or registers a class that builds itself: a class with ``from_params(params, ctx)`` and its typed
parameters as ``params()`` (or a ``Params`` model), e.g. a client objective::

    @OBJECTIVES.register("fedprox")
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

A scenario part is registered the same way (``@DATASETS.register("digits")``) but is a plain
callable with its kind's documented signature rather than ``factory(params, ctx)``: its registry
says so with a :class:`CallShape` (the signature, the config key of its keyword parameters, the
leading arguments and keywords felix passes itself), and the part's parameter model is the one
given at registration, else its ``Params`` model, else one derived from its signature (its
keyword parameters after those felix passes, with their defaults; ``**kwargs`` lets any key
through). Either way a misspelt key fails when the config is read, in one line naming it.

Every error is a :class:`RegistryError`, a ``ConfigError``: a config named something that does
not resolve or does not validate.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Generic, Literal, TypeVar, get_type_hints

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from felix.core.settings import ConfigError, unknown_key

T = TypeVar("T")


class RegistryError(ConfigError):
    """An unknown name, an import path that does not resolve, or parameters that do not validate."""


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
    """The object an import path ``package.module:attr`` (or ``attr.sub``) names: the one place a
    registry (a policy's or a scenario part's) resolves a user's own code. ``RegistryError`` says why it does not resolve."""
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
class CallShape:
    """How felix calls the plain callables of a scenario part's registry: ``signature``, the
    documented one (said in every error about a wrong entry); ``params_key``, the config key of
    their keyword parameters (None: the config gives none); ``passed``, how many leading
    positional arguments felix passes; ``injected``, the keywords felix passes itself (neither
    is a parameter of the config)."""

    signature: str
    params_key: str | None
    passed: int
    injected: tuple[str, ...] = ()


class _AnyParams(BaseModel):
    """The parameters of a callable whose signature cannot be read: any keys."""

    model_config = ConfigDict(extra="allow")


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
    """Components of one kind. ``kind`` names them in errors, ``key`` is the config key that
    holds the name (default ``<kind>.name``), ``modules`` the modules of built-ins imported on the
    first lookup, ``call`` how a scenario part's plain callables are called (None: factories
    ``factory(params, ctx)``)."""

    def __init__(
        self, kind: str, modules: Iterable[str] = (), key: str | None = None, call: CallShape | None = None
    ) -> None:
        self.kind = kind
        self.key = key or f"{kind}.name"
        self.call = call
        self._modules = tuple(modules)
        self._loaded = False
        self._entries: dict[str, Entry[T]] = {}

    def register(
        self, name: str, params: type[BaseModel] | None = None, **traits: Any
    ) -> Callable[[Any], Any]:
        """Decorator: register ``factory(params, ctx) -> policy`` (a function or a class), a class
        with ``from_params``, or a scenario part's plain callable, under ``name``; ``params``
        defaults to the one it owns (:meth:`own_params`). ``traits`` are what the component
        declares about itself for the constraints between axes, checked generically (e.g.
        ``reads_aux=("qffl_loss",)``: the client aux an aggregator reads; a trait may be a
        predicate of the validated parameters, read by :meth:`declares`)."""
        if not name or ":" in name:
            raise ValueError(f"{self.kind} name {name!r}: must be non-empty and without ':'")

        def deco(factory: Any) -> Any:
            old = self._entries.get(name)
            if old is not None and old.factory is not factory:
                raise RegistryError(f"{self.kind} {name!r} is already registered")
            model = params if params is not None else self.own_params(factory)
            self._entries[name] = Entry(name, factory, model, dict(traits))
            return factory

        return deco

    def own_params(self, obj: Any) -> type[BaseModel]:
        """The parameter model ``obj`` owns (:func:`params_of`); a scenario part without one has
        the model of its signature's keyword parameters."""
        if self.call is None:
            return params_of(obj)
        own = getattr(obj, "Params", None)
        if isinstance(own, type) and issubclass(own, BaseModel):
            return own
        return self._signature_params(obj, self.call)

    def names(self) -> list[str]:
        self._load()
        return sorted(self._entries)

    def declares(self, name: str, trait: str, raw: dict[str, Any] | BaseModel | None, default: Any) -> Any:
        """What component ``name`` with parameters ``raw`` declares as ``trait`` (``default`` when it
        declares nothing, e.g. an unregistered import path): the trait's value, or, for a trait
        that depends on the parameters, the value of its predicate on the validated ones."""
        value = self.entry(name).traits.get(trait, default)
        return value(self.parse(name, raw)) if callable(value) else value

    def declaring(self, trait: str, value: Any) -> list[str]:
        """The registered names whose ``trait`` is ``value`` itself (not a predicate)."""
        self._load()
        return [n for n, e in sorted(self._entries.items()) if e.traits.get(trait) is value]

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
        shape = self.call
        if ":" not in name:
            if shape is None:
                raise RegistryError(
                    f"{self.key}: unknown {self.kind} {name!r}; choose one of {self.names()} "
                    f"or give an import path 'package.module:factory'"
                )
            raise RegistryError(
                f"{self.key}: unknown {self.kind} {name!r}; registered: {', '.join(self.names())}, "
                f"or give an import path 'package.module:function' to a {shape.signature}"
            )
        expected = "" if shape is None else f"; expected 'package.module:function' naming a {shape.signature}"
        try:
            obj = import_object(name)
        except RegistryError as exc:
            raise RegistryError(f"{self.key}: {exc}{expected}") from None
        for e in self._entries.values():
            if e.factory is obj:
                return e
        if not callable(obj):
            what = "not callable" if shape is None else f"a {type(obj).__name__}, not callable"
            raise RegistryError(f"{self.key}: {name!r} is {what}{expected}")
        try:
            params = self.own_params(obj)
        except RegistryError:
            raise RegistryError(f"{self.key}: {name!r}'s parameters are not a pydantic model") from None
        return Entry(name, obj, params)

    def resolve(self, ref: str) -> Callable[..., Any]:
        """The callable (or class) a config value names."""
        return self.entry(ref).factory

    def check(self, ref: str) -> str:
        """``ref`` unchanged when it resolves (used by the config's validators)."""
        self.entry(ref)
        return ref

    def check_params(self, ref: str, raw: Mapping[str, Any]) -> None:
        """A scenario part's keyword parameters ``raw`` against its model: each key it does not
        take, or that fails the model, named under the registry's ``params_key``."""
        model = self.entry(ref).params
        try:
            model.model_validate(dict(raw))
        except ValidationError as exc:
            where_key = self.key if self.call is None else (self.call.params_key or self.key)
            problems = []
            for err in exc.errors():
                where = ".".join(str(x) for x in (where_key, *err["loc"]))
                if err["type"] == "extra_forbidden":
                    what = unknown_key(str(err["loc"][-1]), model.model_fields)
                elif err["type"] == "missing":
                    what = f"{self.kind} {ref!r} needs it"
                else:
                    what = str(err["msg"]).removeprefix("Value error, ")
                problems.append(f"{where}: {what}")
            raise RegistryError("; ".join(problems)) from None

    def wrong(self, ref: str, what: str) -> RegistryError:
        """The error for a scenario part that ran but gave the wrong thing."""
        expected = "" if self.call is None else f"; expected a {self.call.signature}"
        return RegistryError(f"{self.key}: {self.kind} {ref!r} {what}{expected}")

    @staticmethod
    def _signature_params(fn: Callable[..., Any], shape: CallShape) -> type[BaseModel]:
        """A model of ``fn``'s keyword parameters: those after the ``passed`` leading positional
        ones, less the ``injected``, typed loosely (the callable checks its values) with its
        defaults; a ``**kwargs`` (or no readable signature) lets any key through."""
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            return _AnyParams
        spec: dict[str, Any] = {}
        extra: Literal["allow", "forbid"] = "forbid"
        skipped = 0
        for p in sig.parameters.values():
            if p.kind is p.VAR_KEYWORD:
                extra = "allow"
            elif p.kind is p.VAR_POSITIONAL or p.name in shape.injected:
                continue
            elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and skipped < shape.passed:
                skipped += 1
            else:
                spec[p.name] = (Any, ... if p.default is p.empty else p.default)
        model: type[BaseModel] = create_model(  # type: ignore[call-overload]
            f"{getattr(fn, '__name__', 'part')}_params", __config__=ConfigDict(extra=extra), **spec
        )
        return model

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
