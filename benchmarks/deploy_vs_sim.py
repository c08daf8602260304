"""Config time over MQTT against the simulator's: time to target of one scenario through both.

Run: ``PYTHONPATH=src nice -n 10 python benchmarks/deploy_vs_sim.py [--clients 50] [--seeds 0 1 2]
[--scales 0.03 0.1 0.3] [--processes 2] [--out FILE.json]`` (needs Mosquitto: tests/broker.py).

The scenario is the default one (digits, Dirichlet 0.3, 90% slotted churn, half-normal runtimes)
with the ``felix`` preset and ``--clients`` clients. Per seed the simulator runs it once (virtual
time); per seed and time scale the deployment runs it over a local Mosquitto: the server in this
process (built before its clock starts, as ``felix serve`` is), the clients as ``felix emulate``
with ``--processes`` workers. The clients start ``--warmup-s`` before the server's clock and are
given that moment as their trace's start (``--t0``), so the deployment's config time and trace
time both start when the server does. On a loaded machine a client may still be loading then, and
nothing happens before the first registers: the time to target is counted from the first
registration (``first_registered_at_s``; ``all_registered_at_s`` says when the last one came, and
``ratio_from_server_start`` keeps the uncorrected ratio).

The deployment's config time is wall time divided by the scale, so anything that takes wall time
and no config time in the simulator (the clients' own training, the server's evaluation and
aggregation, MQTT hops) adds ``wall / scale`` config seconds: the ratio of the two times to target
falls towards the simulator's as the scale grows. Reports per scale the ratio (deployment over
simulator) of each seed, and their mean and spread.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from broker import MosquittoBroker

from felix.config import Config, parse_set
from felix.deploy.link import BrokerOptions
from felix.deploy.server import ServeOptions, Server
from felix.deploy.topics import SERVER_USER
from felix.engine.setup import resolve_config
from felix.metrics.provenance import provenance
from felix.sim.run import run_config

RUN_ID = "bench"


def scenario(clients: int, seed: int, preset: str, max_time_s: float) -> tuple[Config, list[str]]:
    """The config and the ``--set`` arguments that give it to ``felix emulate``."""
    sets = [f"partition.num_clients={clients}", f"seed={seed}", f"run.max_time_s={max_time_s}"]
    return resolve_config(None, preset, parse_set(sets)), sets


def simulate(cfg: Config) -> dict[str, Any]:
    start = time.perf_counter()
    result = run_config(cfg, plots=False)
    s = result.summary
    return {
        "time_to_target_s": s["time_to_target_s"],
        "aggregations": s["aggregations"],
        "wall_s": round(time.perf_counter() - start, 2),
    }


def deploy(
    cfg: Config, sets: list[str], preset: str, scale: float, processes: int, warmup_s: float, folder: Path
) -> dict[str, Any]:
    clients = cfg.partition.num_clients
    with MosquittoBroker(clients, run_id=RUN_ID, workdir=folder / "broker") as broker:
        users = json.loads(broker.credentials_file.read_text())
        server = Server(
            cfg,
            ServeOptions(
                BrokerOptions("127.0.0.1", broker.port, SERVER_USER, users[SERVER_USER]),
                run_id=RUN_ID,
                out_dir=folder / "serve",
                time_scale=scale,
                status_every_s=1e9,
            ),
        )
        t0 = time.time() + warmup_s
        cmd = [sys.executable, "-m", "felix", "emulate", "--preset", preset, "--run-id", RUN_ID]
        cmd += ["--broker", broker.address, "--credentials", str(broker.credentials_file)]
        cmd += ["--clients", str(clients), "--processes", str(processes), "--time-scale", str(scale)]
        cmd += ["--t0", repr(t0), "--max-wall-s", str(warmup_s + cfg.run.max_time_s * scale + 120)]
        for item in sets:
            cmd += ["--set", item]
        with open(folder / "emulate.log", "wb") as log:
            emulate = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        registered: dict[str, float] = {}  # config seconds at which the first / the last client registered
        done = threading.Event()

        def watch() -> None:
            while not done.is_set() and "all" not in registered:
                count = len(server.orch.clients)
                if count and "first" not in registered:
                    registered["first"] = server.now()
                if count >= clients:
                    registered["all"] = server.now()
                time.sleep(0.02)

        try:
            time.sleep(max(0.0, t0 - time.time()))
            started = time.perf_counter()
            threading.Thread(target=watch, daemon=True).start()
            summary = server.run()
        finally:
            done.set()
            emulate.send_signal(signal.SIGTERM)  # it stops its workers
            try:
                emulate.wait(30)
            except subprocess.TimeoutExpired:
                emulate.kill()
                emulate.wait(10)
    ttt, first = summary["time_to_target_s"], registered.get("first")
    return {
        "time_to_target_s": ttt,
        "aggregations": summary["aggregations"],
        "stop_reason": summary["stop_reason"],
        "first_registered_at_s": None if first is None else round(first, 1),
        "all_registered_at_s": round(registered["all"], 1) if "all" in registered else None,
        # Nothing can happen before a client registers: the time from there is the comparable one.
        "time_to_target_from_first_registration_s": None if ttt is None or first is None else ttt - first,
        "wall_s": round(time.perf_counter() - started, 2),
    }


def _stats(values: list[float]) -> dict[str, Any]:
    return {
        "values": values,
        "mean": round(statistics.mean(values), 3) if values else None,
        "stdev": round(statistics.stdev(values), 3) if len(values) > 1 else None,
    }


def summarize(
    runs: list[dict[str, Any]], sims: dict[Any, dict[str, Any]], scales: list[float]
) -> list[dict[str, Any]]:
    """Per scale, over the seeds: the ratio of times to target (deployment over simulator), and the
    ratio of config seconds per aggregation, which leaves out that the two runs may need different
    numbers of aggregations (the deployment's arrival order is not the simulator's) and so isolates
    the clock. Agreement within 10% is judged on the mean time-to-target ratio."""
    out = []
    for scale in scales:
        rows = [r for r in runs if r["scale"] == scale and r["ratio"] is not None]
        ratios = [r["ratio"] for r in rows]
        per_agg = [
            round(
                (r["time_to_target_from_first_registration_s"] / r["aggregations"])
                / (sims[str(r["seed"])]["time_to_target_s"] / sims[str(r["seed"])]["aggregations"]),
                3,
            )
            for r in rows
        ]
        out.append(
            {
                "scale": scale,
                "time_to_target_ratio": _stats(ratios),
                "seconds_per_aggregation_ratio": _stats(per_agg),
                "within_10_percent": bool(ratios) and abs(statistics.mean(ratios) - 1) <= 0.1,
            }
        )
    return out


def resummarize(path: Path) -> None:
    """Recompute ``by_scale`` of a result file with :func:`summarize` (rewrites the file)."""
    doc = json.loads(path.read_text())
    doc["by_scale"] = summarize(
        doc["deployment"], doc["simulator"], sorted({r["scale"] for r in doc["deployment"]})
    )
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    for row in doc["by_scale"]:
        print(json.dumps(row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--preset", default="felix")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--scales", type=float, nargs="+", default=[0.03, 0.1, 0.3])
    parser.add_argument("--processes", type=int, default=2, help="felix emulate workers")
    parser.add_argument("--warmup-s", type=float, default=40.0, help="clients' start before the server's")
    parser.add_argument("--max-time-s", type=float, default=3000.0, help="run.max_time_s of both")
    parser.add_argument("--out", help="write the result here as one JSON object")
    parser.add_argument("--summarize", metavar="FILE", help="only recompute the summary of a result file")
    args = parser.parse_args()
    if args.summarize:
        resummarize(Path(args.summarize))
        return
    import torch

    torch.set_num_threads(1)
    prov = provenance()  # the code that runs, read before it runs
    sims, runs = {}, []
    with tempfile.TemporaryDirectory(prefix="felix-deploy-vs-sim-") as tmp:
        for seed in args.seeds:
            cfg, _ = scenario(args.clients, seed, args.preset, args.max_time_s)
            sims[str(seed)] = simulate(cfg)
            print(json.dumps({"simulator": seed, **sims[str(seed)]}), flush=True)
        for scale in args.scales:
            for seed in args.seeds:
                cfg, sets = scenario(args.clients, seed, args.preset, args.max_time_s)
                folder = Path(tmp) / f"s{seed}-x{scale}"
                row = deploy(cfg, sets, args.preset, scale, args.processes, args.warmup_s, folder)
                sim = sims[str(seed)]["time_to_target_s"]
                row = {"scale": scale, "seed": seed, **row, "simulator_time_to_target_s": sim}
                dep, raw = row["time_to_target_from_first_registration_s"], row["time_to_target_s"]
                row["ratio"] = round(dep / sim, 3) if dep is not None and sim else None
                row["ratio_from_server_start"] = round(raw / sim, 3) if raw is not None and sim else None
                runs.append(row)
                print(json.dumps(row), flush=True)
    by_scale = summarize(runs, sims, args.scales)
    for row in by_scale:
        print(json.dumps(row), flush=True)
    if args.out:
        out = {
            "benchmark": "deploy_vs_sim",
            "command": "PYTHONPATH=src nice -n 10 python benchmarks/deploy_vs_sim.py --clients "
            f"{args.clients} --seeds {' '.join(map(str, args.seeds))} --scales "
            f"{' '.join(map(str, args.scales))} --processes {args.processes} --warmup-s {args.warmup_s}",
            "scenario": f"default, preset {args.preset}, {args.clients} clients",
            "simulator": sims,
            "deployment": runs,
            "by_scale": by_scale,
            "cpus": os.cpu_count(),
            "load_average_at_end": os.getloadavg(),
            "provenance": prov,
        }
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
