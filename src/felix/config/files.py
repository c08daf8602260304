"""Config files and overrides: YAML 1.2 core-schema scalars, ``--set key=value`` pairs and the
merge of a preset, a file and overrides into one raw tree (validated by ``felix.config.validate``)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

from felix.config.base import ConfigError
from felix.core.key_aliases import renamed


class _Yaml12Loader(yaml.SafeLoader):
    """YAML 1.2 core-schema scalars: PyYAML follows YAML 1.1, where ``3_75`` is the integer 375,
    ``1:30`` a sexagesimal number and ``on`` / ``no`` booleans, which silently mistypes settings
    such as ``trace.series=3_75``. Here only plain decimal, 0o / 0x integers, decimal floats and
    true / false are typed; anything else stays a string."""


_Yaml12Loader.yaml_implicit_resolvers = {
    k: [
        (tag, rx)
        for tag, rx in v
        if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:bool")
    ]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node))
    return int(text, 0) if text.startswith(("0o", "0x")) else int(text)


_Yaml12Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def load_yaml(text: str) -> Any:
    """Parse YAML with the core-schema scalars of ``_Yaml12Loader``."""
    return yaml.load(text, Loader=_Yaml12Loader)  # a SafeLoader subclass


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Nested dicts merge key by key; anything else in ``over`` replaces. ``params`` dicts replace
    whole, so a strategy preset never inherits another selector's parameters. Renamed keys
    (``felix.config.aliases``) are read under their new names on both sides first, so an old key
    and its new name are one key."""
    try:
        return _merge(renamed(base), renamed(over))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


_WHOLE = ("params", "objective_params", "model_params", "round_policy_params", "availability_params")


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k not in _WHOLE:
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def parse_set(items: list[str]) -> dict[str, Any]:
    """``a.b=value`` pairs into a nested dict; values are parsed as YAML 1.2 (numbers, null, lists)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects key=value, got {item!r}")
        try:
            value = load_yaml(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {key}: cannot parse value {raw!r} ({exc})") from None
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {p} is set both as a value and as a section")
        node[parts[-1]] = value
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        doc = load_yaml(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {p} not found") from None
    except OSError as exc:  # a folder, no permission
        raise ConfigError(f"config file {p}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not a UTF-8 text file ({exc})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML ({exc})") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections")
    return doc
