"""Bytes through the broker with the models inside the tasks and with model downloads over HTTP.

A small deployment on loopback (a Mosquitto broker, ``felix serve`` and 24 clients, each its own
host as a device is, so that each fetches the models it needs itself;
digits with an MLP, the FeLiX preset, slotted churn) runs a fixed number of aggregations twice
per seed: once with the models inside the TRAIN and EVAL messages (the default) and once with
``--model-http`` (tasks name the model's hash and URL, the built-in server serves each model once
per hash, the clients fetch it). The server counts every payload byte it publishes to and
receives from the broker (``wire_bytes_by_kind``), and the HTTP bytes it served. One JSON line per
run, then one with the means and spreads and the provenance.

Run: ``python benchmarks/model_downloads.py [--seeds 0 1 2] [--aggregations 30] [--objective scaffold]``.
"""

from __future__ import annotations

import argparse
import json
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
from felix.deploy.model_store import ModelHosting
from felix.deploy.server import ServeOptions, Server
from felix.deploy.topics import SERVER_USER
from felix.metrics.provenance import provenance

CLIENTS = 24
SCALE = 0.04


def config(path: Path, seed: int, aggregations: int, objective: str) -> Any:
    doc = {
        "name": "model-downloads",
        "strategy": "felix",
        "seed": seed,
        "model": "mlp",
        "dataset": {"name": "digits"},
        "partition": {"kind": "dirichlet", "num_clients": CLIENTS, "alpha": 0.5},
        "trace": {"kind": "slotted", "unavailable_fraction": 0.2, "slot_s": 60.0, "horizon_s": 3600.0},
        "runtime": {"kind": "constant", "constant_s": 10.0},
        "client": {"lr": 0.1, "batch_size": 16, "objective": objective},
        "orchestrator": {"agg_goal": 5, "concurrency": 10},
        "run": {"target_accuracy": 1.0, "max_aggregations": aggregations, "max_time_s": 1e6},
    }
    path.write_text(yaml.safe_dump(doc))
    return resolve_config(str(path), None, {})


def run_once(work: Path, seed: int, http: bool, aggregations: int, objective: str) -> dict[str, Any]:
    cfg = config(work / "cfg.yaml", seed, aggregations, objective)
    with MosquittoBroker(CLIENTS, workdir=work / "broker") as broker:
        users = json.loads(broker.credentials_file.read_text())
        opts = ServeOptions(
            BrokerOptions("127.0.0.1", broker.port, SERVER_USER, users[SERVER_USER], reconnect_max_s=1.0),
            run_id="dl",
            out_dir=work / "out",
            time_scale=SCALE,
            status_every_s=1e9,
            models=ModelHosting() if http else None,
        )
        server = Server(cfg, opts)
        copts = ClientOptions(
            broker=BrokerOptions("127.0.0.1", broker.port, reconnect_max_s=1.0),
            run_id="dl",
            time_scale=SCALE,
            max_wall_s=300.0,
        )
        hosts = [ClientHost(cfg, [c], copts, credentials_from_map(users)) for c in range(CLIENTS)]
        threads = [threading.Thread(target=h.run, daemon=True) for h in hosts]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        try:
            summ = server.run()
        finally:
            for h in hosts:
                h.stop_requested.set()
            for t in threads:
                t.join(30)
    wire = summ["wire_bytes_by_kind"]
    models = summ["deployment"].get("models", {})
    down, up = sum(wire["down"].values()), sum(wire["up"].values())
    return {
        "mode": "http" if http else "in-band",
        "seed": seed,
        "aggregations": summ["aggregations"],
        "messages_out": summ["transport"]["messages_out"],
        "broker_bytes_down": down,
        "broker_bytes_up": up,
        "broker_bytes_down_per_task_message": round(down / max(1, summ["transport"]["messages_out"]), 1),
        "broker_bytes_per_aggregation": round((down + up) / max(1, summ["aggregations"]), 1),
        "http_bytes_served": models.get("bytes_served", 0),
        "http_models_served": models.get("served", 0),
        "models_published": models.get("published", 0),
        "client_bytes_fetched": sum(h.models.bytes_fetched for h in hosts),
        "wall_s": round(time.monotonic() - t0, 1),
    }


def _mean_sd(values: list[float]) -> dict[str, float]:
    return {"mean": round(statistics.fmean(values), 1), "sd": round(statistics.pstdev(values), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--aggregations", type=int, default=30)
    p.add_argument("--objective", default="ce", help="client objective (scaffold: the task carries aux)")
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    rows = []
    for seed in args.seeds:
        for http in (False, True):
            with tempfile.TemporaryDirectory(prefix="felix-dl-") as tmp:
                row = run_once(Path(tmp), seed, http, args.aggregations, args.objective)
            print(json.dumps(row), flush=True)
            rows.append(row)
    out: dict[str, Any] = {"summary": True, "objective": args.objective, "clients": CLIENTS}
    for mode in ("in-band", "http"):
        rs = [r for r in rows if r["mode"] == mode]
        out[mode] = {
            k: _mean_sd([float(r[k]) for r in rs])
            for k in (
                "broker_bytes_down",
                "broker_bytes_up",
                "broker_bytes_per_aggregation",
                "http_bytes_served",
            )
        }
    ratios = [
        b["broker_bytes_down"] / a["broker_bytes_down"] for a, b in zip(rows[0::2], rows[1::2], strict=True)
    ]
    out["broker_bytes_down_ratio_http_over_in_band"] = {
        "mean": round(statistics.fmean(ratios), 4),
        "min": round(min(ratios), 4),
        "max": round(max(ratios), 4),
    }
    out["command"] = "python " + " ".join(["benchmarks/model_downloads.py", *sys.argv[1:]])
    out["provenance"] = provenance()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
