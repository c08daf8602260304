"""The byte counters of one small scenario in both shells, side by side.

Runs ``fedbuff`` and ``felix`` (6 digits clients, MLP, slotted churn: 30% of the clients away,
20 s slots, 6 aggregations) through the simulator and through the MQTT server with in-process
emulated clients on a local Mosquitto (time scale 0.02), and prints, per strategy and shell, the
run controller's modelled ``bytes_by_kind``, the server's ``wire_bytes_by_kind`` (the real encoded
sizes), the dispatched task counts and the tier messages the server received.

    PYTHONPATH=src python benchmarks/shell_bytes.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test broker fixture
from broker import MosquittoBroker
from mqtt_support import load_config, start_clients, start_server, write_config

from felix.sim.run import run_config

SCALE, CLIENTS = 0.02, 6


def main() -> None:
    torch.set_num_threads(1)
    for strategy in ("fedbuff", "felix"):
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            path = write_config(
                tmp / "cfg.yaml",
                partition={"num_clients": CLIENTS},
                trace={"kind": "slotted", "unavailable_fraction": 0.3, "slot_s": 20.0},
            )
            cfg = load_config(
                path,
                {
                    "strategy": strategy,
                    "orchestrator": {"agg_goal": 2, "concurrency": 3},
                    "run": {"max_aggregations": 6, "stop_at_target": False, "target_accuracy": 1.0},
                },
            )
            sim = run_config(cfg, None, plots=False).summary
            with MosquittoBroker(CLIENTS, workdir=tmp / "broker") as broker:
                server, thread = start_server(cfg, broker, tmp / "out", SCALE)
                host, clients = start_clients(cfg, broker, list(range(CLIENTS)), SCALE)
                try:
                    mqtt = thread.result(90)
                    clients.result(30)
                finally:
                    server.stop_requested.set()
                    host.stop_requested.set()
        for shell, s in (("sim", sim), ("mqtt", mqtt)):
            diag = s["diagnostics"]
            print(
                strategy,
                shell,
                json.dumps(
                    {
                        "bytes_by_kind": s["bytes_by_kind"],
                        "wire_bytes_by_kind": s.get("wire_bytes_by_kind"),
                        "train_dispatched": diag["train_dispatched"],
                        "eval_dispatched": diag["eval_dispatched"],
                        "tier_messages": s.get("transport", {}).get("tier_messages"),
                    }
                ),
            )


if __name__ == "__main__":
    main()
