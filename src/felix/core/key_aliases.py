"""Renamed config keys: the one table of old key -> new key, so that a config, a preset, a
comparison, a finished run's ``config.json`` or a caller's keyword written with an old key keeps
working.

Keys are renamed when a name says less than it should (``orchestrator.mode`` picks the round
policy, ``orchestrator.knowledge`` the availability policy). The table is applied wherever a raw
tree enters: to both sides of every merge (``felix.config.files.deep_merge``, so a preset's old
key and an override's new one are one key), to the tree ``felix.config.validate`` reads, and to a
section model's own keywords (``OrchestratorConfig(mode="sync")``). A tree that gives a key under
both names is refused in one line. docs/configs.md lists the table.

Here in the core, beside the settings models it renames the keys of, so that both the run
configuration (``felix.config``) and the core's own models read the one table. Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Old dotted key -> new dotted key (same section: only the last part changes).
KEY_ALIASES: dict[str, str] = {
    "orchestrator.mode": "orchestrator.round_policy",
    "orchestrator.mode_params": "orchestrator.round_policy_params",
    "orchestrator.knowledge": "orchestrator.availability",
    "orchestrator.knowledge_params": "orchestrator.availability_params",
}

# section path -> {old key: new key}
_BY_SECTION: dict[tuple[str, ...], dict[str, str]] = {}
for _old, _new in KEY_ALIASES.items():
    *_section, _key = _old.split(".")
    _BY_SECTION.setdefault(tuple(_section), {})[_key] = _new.rsplit(".", 1)[1]


def renamed(tree: Mapping[str, Any], path: tuple[str, ...] = ()) -> dict[str, Any]:
    """``tree`` (a raw config, or the section at ``path``) with every old key under its new name;
    the values are not copied. ``ValueError`` if a key is given under both names."""
    table = _BY_SECTION.get(path, {})
    out: dict[str, Any] = {}
    for key, value in tree.items():
        new = table.get(key, key) if isinstance(key, str) else key
        if new in out or (new != key and new in tree):
            dotted = ".".join((*path, new))
            raise ValueError(f"{dotted}: also given under its old name {'.'.join((*path, key))}; give one")
        sub = (*path, key) if isinstance(key, str) else ()
        nested = isinstance(value, Mapping) and any(
            s[: len(sub)] == sub for s in _BY_SECTION if len(s) > len(path)
        )
        out[new] = renamed(value, sub) if nested else value
    return out


__all__ = ["KEY_ALIASES", "renamed"]
