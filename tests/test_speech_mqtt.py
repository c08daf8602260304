"""Speech over MQTT: the deployment's clients train the keyword-spotting CNN on log-mel features
of WAV clips (written here), split by speaker, and the server aggregates and evaluates on the
held-out speaker, as the simulator does."""

from __future__ import annotations

from pathlib import Path

import pytest
from mqtt_support import (
    load_config,
    needs_mosquitto,
    one_torch_thread,  # noqa: F401  (a fixture)
    run_deployed,
    write_config,
)
from test_speech import make_fsdd

pytestmark = needs_mosquitto
SCALE = 0.02


def test_mqtt_clients_train_a_speech_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FELIX_CACHE", str(tmp_path / "cache"))
    root = make_fsdd(tmp_path / "fsdd", per=2)
    cfg_path = write_config(
        tmp_path / "cfg.yaml",
        model="kws_cnn",
        model_params={"width": 8},
        dataset={
            "name": "fsdd",
            "root": str(root),
            "params": {"test_speakers": ["cy"], "n_mels": 16, "win_ms": 32.0, "hop_ms": 32.0},
        },
        partition={"kind": "speaker", "num_clients": 6},
        trace={"kind": "always"},
        client={"batch_size": 4},
        run={"max_aggregations": 3, "stop_at_target": False},
    )
    cfg = load_config(cfg_path, {"orchestrator": {"agg_goal": 2, "concurrency": 4}})
    _server, summ = run_deployed(cfg, tmp_path, SCALE, timeout=90)
    assert summ["aggregations"] == 3 and summ["diagnostics"]["rejected"] == 0, summ
    assert summ["bytes_by_kind"]["up"]["train"] > 0 and summ["final_accuracy"] is not None
