"""A model with BatchNorm buffers over MQTT: with ``client.buffers: aggregate`` the weight vector
carries the running statistics, so the wire format, the byte accounting and the update validator
all see the longer vector; the server's statistics move with the clients' updates."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from mqtt_support import (
    load_config,
    needs_mosquitto,
    one_torch_thread,  # noqa: F401  (a fixture)
    run_deployed,
    write_config,
)

from felix.client.weights import ModelWeights
from felix.scenario.build import build_population

sys.path.insert(0, str(Path(__file__).parent))  # the config names test_byo:... by import path

pytestmark = needs_mosquitto
SCALE = 0.02


@pytest.mark.parametrize("mode", ["aggregate", "local"])
def test_batchnorm_model_over_mqtt(tmp_path: Path, mode: str) -> None:
    cfg_path = write_config(
        tmp_path / "cfg.yaml",
        model="test_byo:bn_net",
        dataset={"name": "test_byo:blobs"},
        partition={"kind": "iid", "num_clients": 6},
        trace={"kind": "always"},
        client={"buffers": mode, "batch_size": 8},
        run={"max_aggregations": 3, "stop_at_target": False},
    )
    cfg = load_config(cfg_path, {"orchestrator": {"agg_goal": 2, "concurrency": 4}})
    server, summ = run_deployed(cfg, tmp_path, SCALE, timeout=60)
    w = ModelWeights(build_population(cfg).model, mode)
    assert summ["aggregations"] == 3 and summ["diagnostics"]["rejected"] == 0, summ
    assert summ["num_params"] == w.size == (w.num_params + 16 if mode == "aggregate" else w.num_params)
    theta = server.orch.weights
    if mode == "aggregate":
        assert np.abs(theta[w.num_params : w.num_params + 8]).max() > 0.1  # the averaged running means
    assert 0.0 < summ["final_accuracy"] <= 1.0
