"""Streams over MQTT, end to end on a real Mosquitto at 127.0.0.1: the clients' stores fill in
wall-clock time under the simulator's stream model, their results carry the arrival span of
their data, and the server judges the model on the current class mix."""

from __future__ import annotations

from pathlib import Path

from broker import MosquittoBroker
from mqtt_support import (
    load_config,
    needs_mosquitto,
    one_torch_thread,  # noqa: F401  (a fixture)
    start_clients,
    start_server,
    write_config,
)

pytestmark = needs_mosquitto
SCALE = 0.04  # 1 config second = 40 ms


def test_clients_stores_grow_in_wall_clock_time(tmp_path: Path) -> None:
    cfg_path = write_config(
        tmp_path / "cfg.yaml",
        partition={"num_clients": 8},
        trace={"kind": "always"},
        run={"max_aggregations": 12, "stop_at_target": False},
        orchestrator={"agg_goal": 2, "concurrency": 4},
        stream={
            "enabled": True,
            "arrivals": {"rate_per_hour": 3600, "warmup_s": 20.0, "rate_spread": 0.0},
            "labels": {"delay": "constant", "median_s": 5.0},
            "store": {"cap": 400},
            "drift": {"shifts": [{"kind": "surge", "at_s": 30.0, "classes": [1, 2], "factor": 6}]},
        },
    )
    cfg = load_config(cfg_path, {"orchestrator": {"agg_goal": 2, "concurrency": 4}})
    with MosquittoBroker(cfg.partition.num_clients, workdir=tmp_path / "broker") as broker:
        _server, sthread = start_server(cfg, broker, tmp_path / "out", SCALE)
        host, cthread = start_clients(cfg, broker, list(range(8)), SCALE)
        summ = sthread.result(90)
        cthread.result(30)
    assert summ["stop_reason"] == "max_aggregations"
    st = summ["stream"]
    # The newest sample behind the applied updates arrived during the run (at one per client-second),
    # not in the warm-up: the stores grew while the clients ran.
    newest = summ["virtual_time_s"] - st["data_age_final_s"]
    assert newest > 10.0
    assert st["time_avg_accuracy"] is not None
    # Each client's store holds what arrived by the time it last read it (its last task's start),
    # under the cap; and the stores were read at growing wall-clock times.
    streams = [dev.feed.stream for dev in host.devices.values() if dev.feed is not None]  # type: ignore[attr-defined]
    assert len(streams) == 8
    assert all(0 < s.store.size <= 400 for s in streams if s.now > 0)
    assert max(s.now for s in streams) > 10.0
    read = [s for s in streams if s.now > 0]
    assert all(s.store.size == min(400, s.arrivals) for s in read)
    assert (tmp_path / "out" / "freshness.csv").exists()
