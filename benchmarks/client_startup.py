"""Start-up time and peak memory of one deployed client process (``felix client --id N``) in a
large population: from the interpreter's start to a ``ClientHost`` ready to connect (config
resolved, its data shard, trace, trainer and runtime built), each repeat in a fresh process.

    python benchmarks/client_startup.py [--clients 10000] [--client-id 1234] [--repeats 5] [--threads 1]

The population is the capacity benchmark's large one (``benchmarks/mqtt_capacity.py`` above
1,000 clients): Fashion-MNIST split IID over ``--clients`` clients, a 6-unit MLP, the default
halfnormal runtimes, a 50%-slotted trace. Prints one JSON line: per repeat the wall seconds, the
CPU seconds (user + system: less sensitive than wall time to other work on the machine), the peak
RSS (``ru_maxrss``) and the RSS held once started (``VmRSS``), their medians and spreads, and the
provenance.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

T_START = time.perf_counter()  # the child's clock starts before any felix or torch import


def _config(clients: int) -> dict[str, Any]:
    return {
        "name": "client-startup",
        "strategy": "custom",
        "seed": 0,
        "model": "mlp",
        "model_params": {"hidden": 6},
        "dataset": {"name": "fashion_mnist"},
        "partition": {"kind": "iid", "num_clients": clients},
        "trace": {"kind": "slotted", "unavailable_fraction": 0.5},
        "run": {"eval_every": 0, "max_time_s": 3600.0},
    }


def _child(clients: int, cid: int, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    from felix.deploy.client import ClientHost, ClientOptions
    from felix.deploy.link import BrokerOptions
    from felix.engine.setup import resolve_config

    cfg = resolve_config(None, None, _config(clients))
    opts = ClientOptions(broker=BrokerOptions(), run_id="startup")
    host = ClientHost(cfg, [cid], opts, lambda c: (None, None))
    seconds = time.perf_counter() - T_START
    assert len(host.devices[cid].data) > 0
    usage = resource.getrusage(resource.RUSAGE_SELF)
    peak_mb, cpu_s = usage.ru_maxrss / 1024.0, usage.ru_utime + usage.ru_stime
    with open("/proc/self/status") as f:
        held_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    samples = len(host.devices[cid].data)
    print(
        json.dumps(
            {
                "seconds": seconds,
                "cpu_s": cpu_s,
                "peak_mb": peak_mb,
                "held_mb": held_kb / 1024.0,
                "samples": samples,
            }
        )
    )


def _figures(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    values = [r[key] for r in runs]
    return {
        key: [round(v, 2) for v in values],
        f"{key}_median": round(statistics.median(values), 2),
        f"{key}_spread": round(max(values) - min(values), 2),
    }


def _provenance(threads: int) -> dict[str, Any]:
    import torch

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "commit": commit,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu,
        "torch_threads": threads,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=10000)
    ap.add_argument("--client-id", type=int, default=1234)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.clients, args.client_id, args.threads)
        return
    if args.repeats < 1 or not 0 <= args.client_id < args.clients:
        raise SystemExit("client_startup: --repeats must be >= 1 and --client-id inside the population")
    runs = []
    for _ in range(args.repeats):
        out = subprocess.run(
            [sys.executable, __file__, "--child", "--clients", str(args.clients)]
            + ["--client-id", str(args.client_id), "--threads", str(args.threads)],
            capture_output=True,
            text=True,
            check=True,
        )
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(
        json.dumps(
            {
                "benchmark": "client_startup",
                "clients": args.clients,
                "client_id": args.client_id,
                "samples": runs[0]["samples"],
                **_figures(runs, "seconds"),
                **_figures(runs, "cpu_s"),
                **_figures(runs, "peak_mb"),
                **_figures(runs, "held_mb"),
                "provenance": _provenance(args.threads),
            }
        )
    )


if __name__ == "__main__":
    main()
