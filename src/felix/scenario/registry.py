"""Named scenario parts (models, datasets, partitioners, traces) that a config may also give as an
import path.

Each kind has one ``Registry`` that lives next to its built-in entries (``felix.scenario.models.MODELS``,
``datasets.DATASETS``, ``partition.PARTITIONERS``, ``traces.TRACES``). A config value is either a
registered name (``small_cnn``) or ``package.module:attribute`` naming a callable with the kind's
documented signature (``mypkg.nets:make_resnet``), so a user's own model or data needs no edit to
felix. Resolution imports the module on demand; an unknown name lists the registered ones, an import
path that fails says why and what was expected.

A part's keyword parameters (``trace.params``, ``dataset.params``, ``partition.params``,
``model_params``) have a typed model, checked when the config is read: the one given at
registration (``params=``), else a ``Params`` pydantic model on an imported callable, else one
derived from the callable's signature (its keyword parameters after those felix passes itself,
with their defaults; ``**kwargs`` lets any key through). A misspelt key fails in one line naming
it, with the nearest known key.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from felix.config.base import ConfigError, unknown_key
from felix.core.registry import Registry as CoreRegistry
from felix.core.registry import RegistryError, import_object

F = TypeVar("F", bound=Callable[..., Any])


class Registry(CoreRegistry[F]):
    """Name -> callable for one kind of scenario part: the core registry
    (:class:`felix.core.registry.Registry`, one for every component kind) holding plain callables
    with the kind's documented signature rather than ``factory(params, ctx)``; their parameters
    are the config's keyword mapping for the kind (``dataset.params``, ``model_params``).

    ``key`` is the config key the value comes from (for error messages), ``signature`` the
    callable's documented signature (said in every error about a wrong entry), ``params_key`` the
    config key of its keyword parameters (None: the config gives none), ``passed`` how many leading positional arguments felix
    passes and ``injected`` the keywords it passes itself (neither is a parameter of the config);
    ``modules`` are the modules of built-ins that build on the registry's own module, imported on
    the first lookup as for the core's registries.
    """

    def __init__(
        self,
        kind: str,
        key: str,
        signature: str,
        params_key: str | None,
        passed: int,
        injected: tuple[str, ...] = (),
        modules: tuple[str, ...] = (),
    ) -> None:
        super().__init__(kind, modules, key=key)
        self.signature = signature
        self.params_key = params_key
        self.passed = passed
        self.injected = injected

    def register(self, name: str, params: type[BaseModel] | None = None, **traits: Any) -> Callable[[F], F]:
        """Decorator: ``@MODELS.register("my_net")`` above a factory with the kind's signature;
        its parameter model is ``params``, else derived from its signature."""
        if not name or ":" in name:
            raise ValueError(f"{self.kind} name {name!r}: must be non-empty and without ':'")

        def add(fn: F) -> F:
            super(Registry, self).register(name, params or self._signature_params(fn), **traits)(fn)
            return fn

        return add

    def params_model(self, ref: str) -> type[BaseModel]:
        """The parameter model of the part a config value names."""
        fn = self.resolve(ref)
        if ":" not in ref:
            return self._entries[ref].params
        own = getattr(fn, "Params", None)
        if isinstance(own, type) and issubclass(own, BaseModel):
            return own
        return self._signature_params(fn)

    def check_params(self, ref: str, raw: Mapping[str, Any]) -> None:
        """``ConfigError`` naming each key of ``raw`` that the part ``ref`` does not take or
        that fails its parameter model."""
        model = self.params_model(ref)
        try:
            model.model_validate(dict(raw))
        except ValidationError as exc:
            problems = []
            for err in exc.errors():
                where = ".".join(str(x) for x in (self.params_key or self.key, *err["loc"]))
                if err["type"] == "extra_forbidden":
                    what = unknown_key(str(err["loc"][-1]), model.model_fields)
                elif err["type"] == "missing":
                    what = f"{self.kind} {ref!r} needs it"
                else:
                    what = str(err["msg"]).removeprefix("Value error, ")
                problems.append(f"{where}: {what}")
            raise ConfigError("; ".join(problems)) from None

    def _signature_params(self, fn: Callable[..., Any]) -> type[BaseModel]:
        """A model of ``fn``'s keyword parameters: those after the ``passed`` leading positional
        ones, less the ``injected``, typed loosely (the callable checks its values) with its
        defaults; a ``**kwargs`` (or no readable signature) lets any key through."""
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            return _ANY_PARAMS
        spec: dict[str, Any] = {}
        extra: Literal["allow", "forbid"] = "forbid"
        skipped = 0
        for p in sig.parameters.values():
            if p.kind is p.VAR_KEYWORD:
                extra = "allow"
            elif p.kind is p.VAR_POSITIONAL or p.name in self.injected:
                continue
            elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and skipped < self.passed:
                skipped += 1
            else:
                spec[p.name] = (Any, ... if p.default is p.empty else p.default)
        model: type[BaseModel] = create_model(  # type: ignore[call-overload]
            f"{getattr(fn, '__name__', self.kind)}_params", __config__=ConfigDict(extra=extra), **spec
        )
        return model

    def resolve(self, ref: str) -> F:
        """The callable a config value names; ``ConfigError`` with the reason when there is none."""
        if ":" not in ref:
            self._load()
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


class _AnyParams(BaseModel):
    """The parameters of a callable whose signature cannot be read: any keys."""

    model_config = ConfigDict(extra="allow")


_ANY_PARAMS: type[BaseModel] = _AnyParams
