"""What secure aggregation costs a deployment: the same small run over a real broker with and
without ``secure_aggregation: {protocol: buffered}``.

A Mosquitto broker on loopback, ``felix serve`` and 24 clients in one host (digits with an MLP,
the FeLiX preset, slotted churn, 5 updates per aggregation, so each aggregation is one group of
5) run a fixed number of aggregations twice per seed. Measured: the run's wall seconds, the wall
seconds the server spent inside the aggregations' groups (the four stages and the unmasking,
which the loop waits for), the payload bytes the server received and sent by kind
(``wire_bytes_by_kind``), the bytes received per applied update, and the ``secure_aggregation``
section of ``summary.json``. One JSON line per run, then one with means, spreads and the
provenance.

Run: ``python benchmarks/secagg_deploy.py [--seeds 0 1 2] [--aggregations 10] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from felix.engine.setup import resolve_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test broker fixture
from broker import MosquittoBroker

from felix.deploy.client import ClientHost, ClientOptions, credentials_from_map
from felix.deploy.link import BrokerOptions
from felix.deploy.server import ServeOptions, Server
from felix.deploy.topics import SERVER_USER
from felix.metrics.provenance import provenance

CLIENTS = 24
SCALE = 0.04


def config(path: Path, seed: int, aggregations: int, secure: bool) -> Any:
    doc: dict[str, Any] = {
        "name": "secagg-deploy",
        "strategy": "felix",
        "seed": seed,
        "model": "mlp",
        "dataset": {"name": "digits"},
        "partition": {"kind": "dirichlet", "num_clients": CLIENTS, "alpha": 0.5},
        "trace": {"kind": "slotted", "unavailable_fraction": 0.2, "slot_s": 60.0, "horizon_s": 3600.0},
        "runtime": {"kind": "constant", "constant_s": 10.0},
        "client": {"lr": 0.1, "batch_size": 16},
        "run": {"target_accuracy": 1.0, "max_aggregations": aggregations, "max_time_s": 1e6},
    }
    if secure:
        doc["secure_aggregation"] = {"protocol": "buffered", "group_size": 5}
    path.write_text(yaml.safe_dump(doc))
    return resolve_config(str(path), None, {"orchestrator": {"agg_goal": 5, "concurrency": 10}})


def run_once(seed: int, aggregations: int, secure: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cfg = config(work / "c.yaml", seed, aggregations, secure)
        with MosquittoBroker(CLIENTS, workdir=work / "broker") as broker:
            users = json.loads(broker.credentials_file.read_text())
            opts = ServeOptions(
                BrokerOptions("127.0.0.1", broker.port, SERVER_USER, users[SERVER_USER], reconnect_max_s=1.0),
                run_id="b",
                out_dir=work / "out",
                time_scale=SCALE,
                status_every_s=1e9,
            )
            server = Server(cfg, opts)
            in_groups = [0.0]
            if server.secagg is not None:
                run_group = server.secagg.run_group

                def timed(*args: Any) -> Any:
                    t0 = time.perf_counter()
                    try:
                        return run_group(*args)
                    finally:
                        in_groups[0] += time.perf_counter() - t0

                server.secagg.run_group = timed  # type: ignore[method-assign]
            copts = ClientOptions(
                broker=BrokerOptions("127.0.0.1", broker.port, reconnect_max_s=1.0),
                run_id="b",
                time_scale=SCALE,
                max_wall_s=600.0,
            )
            host = ClientHost(cfg, list(range(CLIENTS)), copts, credentials_from_map(users))
            clients = threading.Thread(target=host.run, daemon=True)
            t0 = time.perf_counter()
            clients.start()
            try:
                summ = server.run()
            finally:
                host.stop_requested.set()
                clients.join(30)
            wall = time.perf_counter() - t0
    wire = summ["wire_bytes_by_kind"]
    up = sum(wire["up"].values())
    return {
        "seed": seed,
        "secure": secure,
        "aggregations": summ["aggregations"],
        "updates_applied": summ["updates_applied"],
        "wall_s": round(wall, 2),
        "in_groups_s_per_aggregation": round(in_groups[0] / max(1, summ["aggregations"]), 4),
        "bytes_up": up,
        "bytes_down": sum(wire["down"].values()),
        "bytes_up_per_update": round(up / max(1, summ["updates_applied"])),
        "wire_bytes_by_kind": wire,
        "secure_aggregation": summ.get("secure_aggregation"),
    }


def _stat(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    vals = [float(r[key]) for r in rows]
    return {
        "mean": round(statistics.mean(vals), 4),
        "sd": round(statistics.stdev(vals), 4) if len(vals) > 1 else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--aggregations", type=int, default=10)
    ap.add_argument("--json", type=Path, help="also write the rows and the summary here")
    args = ap.parse_args()
    import torch  # after felix (felix sets torch's thread waiting policy when it is imported first)

    torch.set_num_threads(1)
    run_once(args.seeds[0], 1, True)  # warm-up (dataset, model, broker start), not recorded
    rows = []
    for i, seed in enumerate(args.seeds):
        for secure in (False, True) if i % 2 == 0 else (True, False):  # alternate the order
            row = run_once(seed, args.aggregations, secure)
            print(json.dumps(row), flush=True)
            rows.append(row)
    keys = ("wall_s", "in_groups_s_per_aggregation", "bytes_up_per_update", "bytes_down")
    summary = {
        "plaintext": {k: _stat([r for r in rows if not r["secure"]], k) for k in keys},
        "secure": {k: _stat([r for r in rows if r["secure"]], k) for k in keys},
        "command": "python benchmarks/secagg_deploy.py " + " ".join(sys.argv[1:]),
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "provenance": provenance(),
    }
    print(json.dumps(summary), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
