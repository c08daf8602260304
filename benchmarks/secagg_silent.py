"""What one silent member costs a deployed secure aggregation: wall seconds inside the groups per
aggregation when a member stops answering at the masked-vector stage, under the stage grace
(``secure_aggregation.stage_grace_s``, the default) and under the deadline alone (the grace set
to ``stage_timeout_s``: the server waits the whole deadline for the silent member).

``felix serve`` and 8 clients over the in-memory transport in one process (digits, MLP, fedavg's
synchronous rounds over all 8, so each round is one group of 8 with threshold 5); client 3 never
sends its masked vector, so each round's group recovers its mask key and goes on without it.
One JSON line per run, then one with means, spreads and the provenance.

Run: ``python benchmarks/secagg_silent.py [--seeds 0 1 2] [--aggregations 3] [--json PATH]``.
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

from felix.deploy import secagg_wire
from felix.deploy.client import ClientHost, ClientOptions, Device
from felix.deploy.memory_transport import MemoryOptions
from felix.deploy.server import ServeOptions, Server
from felix.engine.setup import resolve_config
from felix.metrics.provenance import provenance
from felix.secagg import messages as sa
from felix.secagg.config import SecureAggregationCfg

CLIENTS = 8
SCALE = 0.05
SILENT = 3
STAGE_S = 10.0


class SilentAtMasking(ClientHost):
    """Client ``SILENT`` answers setup and keys, then never sends its masked vector."""

    def _secagg_reply(self, dev: Device, env: secagg_wire.SecAggEnvelope) -> sa.Message | None:
        if dev.cid == SILENT and isinstance(env.msg, (sa.SharesForward, sa.UnmaskRequest)):
            return None
        return super()._secagg_reply(dev, env)


def config(path: Path, seed: int, aggregations: int, grace_s: float) -> Any:
    doc: dict[str, Any] = {
        "name": "secagg-silent",
        "strategy": "fedavg",
        "seed": seed,
        "model": "mlp",
        "dataset": {"name": "digits"},
        "partition": {"kind": "dirichlet", "num_clients": CLIENTS, "alpha": 0.5},
        "trace": {"kind": "slotted", "unavailable_fraction": 0.0, "slot_s": 60.0, "horizon_s": 3600.0},
        "runtime": {"kind": "constant", "constant_s": 10.0},
        "client": {"lr": 0.1, "batch_size": 16},
        "run": {"target_accuracy": 1.0, "max_aggregations": aggregations, "max_time_s": 1e6},
        "secure_aggregation": {
            "protocol": "secagg_plus",
            "group_size": CLIENTS,
            "stage_timeout_s": STAGE_S,
            "stage_grace_s": grace_s,
        },
    }
    path.write_text(yaml.safe_dump(doc))
    return resolve_config(str(path), None, {"orchestrator": {"agg_goal": CLIENTS, "overcommit": 1.0}})


def run_once(seed: int, aggregations: int, grace_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cfg = config(work / "c.yaml", seed, aggregations, grace_s)
        opts = ServeOptions(
            MemoryOptions(),
            run_id=f"silent-{seed}-{grace_s}",
            out_dir=work / "out",
            time_scale=SCALE,
            status_every_s=1e9,
            transport="memory",
        )
        server = Server(cfg, opts)
        assert server.secagg is not None
        run_group = server.secagg.run_group
        in_groups = [0.0]

        def timed(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return run_group(*args)
            finally:
                in_groups[0] += time.perf_counter() - t0

        server.secagg.run_group = timed  # type: ignore[method-assign]
        copts = ClientOptions(
            broker=MemoryOptions(), run_id=opts.run_id, time_scale=SCALE, max_wall_s=600.0, transport="memory"
        )
        host = SilentAtMasking(cfg, list(range(CLIENTS)), copts, lambda cid: (None, None))
        clients = threading.Thread(target=host.run, daemon=True)
        t0 = time.perf_counter()
        clients.start()
        try:
            summ = server.run()
        finally:
            host.stop_requested.set()
            clients.join(30)
        wall = time.perf_counter() - t0
    return {
        "seed": seed,
        "grace_s": grace_s,
        "aggregations": summ["aggregations"],
        "wall_s": round(wall, 2),
        "in_groups_s_per_aggregation": round(in_groups[0] / max(1, summ["aggregations"]), 3),
        "secure_aggregation": summ["secure_aggregation"],
    }


def _stat(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    vals = [float(r[key]) for r in rows]
    return {
        "mean": round(statistics.mean(vals), 3),
        "sd": round(statistics.stdev(vals), 3) if len(vals) > 1 else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--aggregations", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the rows and the summary here")
    args = ap.parse_args()
    import torch  # after felix (felix sets torch's thread waiting policy when it is imported first)

    torch.set_num_threads(1)
    default = SecureAggregationCfg().stage_grace_s
    rows = []
    for i, seed in enumerate(args.seeds):
        for grace in (default, STAGE_S) if i % 2 == 0 else (STAGE_S, default):  # alternate the order
            row = run_once(seed, args.aggregations, grace)
            print(json.dumps(row), flush=True)
            rows.append(row)
    keys = ("wall_s", "in_groups_s_per_aggregation")
    summary = {
        "grace": {k: _stat([r for r in rows if r["grace_s"] == default], k) for k in keys},
        "deadline": {k: _stat([r for r in rows if r["grace_s"] == STAGE_S], k) for k in keys},
        "command": "python benchmarks/secagg_silent.py " + " ".join(sys.argv[1:]),
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "provenance": provenance(),
    }
    print(json.dumps(summary), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
