"""Renamed config keys (felix.core.key_aliases): an old key reads as its new one wherever a config
enters (a file, a merge of a preset and overrides, a finished run's config.json, a section's
keywords), a key given under both names is one line, and docs/configs.md lists the whole table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from felix.config import KEY_ALIASES, Config, ConfigError, deep_merge, parse_set, validate
from felix.core.orchestrator_config import OrchestratorConfig
from felix.engine.setup import resolve_config

DOCS = Path(__file__).resolve().parents[1] / "docs" / "configs.md"


def test_the_old_orchestrator_keys_read_as_the_new_ones() -> None:
    old = {"mode": "sync", "knowledge": "oracle", "mode_params": {}, "knowledge_params": {}}
    cfg = validate({"orchestrator": old})
    assert (cfg.orchestrator.round_policy, cfg.orchestrator.availability) == ("sync", "oracle")
    assert OrchestratorConfig(**old) == cfg.orchestrator  # a caller's keywords, too
    dumped = cfg.model_dump()["orchestrator"]
    assert "round_policy" in dumped and not {"mode", "knowledge"} & set(dumped)


def test_an_old_key_in_an_override_replaces_the_presets_new_one() -> None:
    """The fedbuff preset says ``round_policy: async``; ``--set orchestrator.mode=sync`` wins, as
    it would over a preset that still said ``mode``."""
    cfg = resolve_config(
        None, "fedbuff", parse_set(["orchestrator.mode=sync", "orchestrator.knowledge=oracle"])
    )
    assert (cfg.orchestrator.round_policy, cfg.orchestrator.availability) == ("sync", "oracle")
    merged = deep_merge({"orchestrator": {"mode": "sync"}}, {"orchestrator": {"round_policy": "async"}})
    assert merged == {"orchestrator": {"round_policy": "async"}}


def test_a_finished_runs_config_json_with_old_keys_reads_back(tmp_path: Path) -> None:
    raw = validate({}).model_dump(mode="json")
    orch = raw["orchestrator"]
    orch["mode"], orch["knowledge"] = orch.pop("round_policy"), orch.pop("availability")
    orch["mode_params"], orch["knowledge_params"] = (
        orch.pop("round_policy_params"),
        orch.pop("availability_params"),
    )
    stored = Config.model_validate_json(json.dumps(raw))
    assert stored == validate({})


@pytest.mark.parametrize(("old", "new"), list(KEY_ALIASES.items()))
def test_a_key_under_both_names_is_one_line(old: str, new: str) -> None:
    section, old_key = old.split(".")
    new_key = new.split(".")[1]
    value = {} if old_key.endswith("_params") else "async"
    with pytest.raises(ConfigError, match=rf"^config: {new}: also given under its old name {old}; give one$"):
        validate({section: {old_key: value, new_key: value}})


def test_docs_list_every_renamed_key() -> None:
    text = DOCS.read_text()
    for old, new in KEY_ALIASES.items():
        assert f"| `{old}` | `{new}` |" in text, old
