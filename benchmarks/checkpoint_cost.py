"""Checkpoint cost against history: a server checkpoint (applied-update log fsync + snapshot of
``Orchestrator.state_dict()``) after ``--updates`` applied updates with ``--clients`` registered.

The orchestrator is driven directly (no broker): ``--clients`` register, 200 of them available,
and every open task is answered with a small update until ``--updates`` are applied (FedBuff,
50 per aggregation). Reported: min / median / max of ``--repeats`` checkpoints, and
``state_dict()`` alone. Run: ``python benchmarks/checkpoint_cost.py [--updates 100000 --clients 10000]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from felix.core.commands import NewModelVersion
from felix.core.events import ClientRegistered, TaskFinished
from felix.core.orchestrator import AvailabilityName, Orchestrator, OrchestratorConfig
from felix.core.types import ClientUpdate, Tier
from felix.deploy import checkpoint as ckpt
from felix.strategies.aggregation.fedavg import FedBuffAggregator
from felix.strategies.selection.random import RandomSelector


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--updates", type=int, default=100_000)
    p.add_argument("--clients", type=int, default=10_000)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    orch = Orchestrator(
        OrchestratorConfig(agg_goal=50, concurrency=100, knowledge=AvailabilityName.TIERTRACK),
        np.zeros(64, np.float32),
        RandomSelector(),
        FedBuffAggregator(),
        np.random.default_rng(0),
    )
    for c in range(args.clients):
        orch.handle(ClientRegistered(0.0, c, 30, Tier.AVL_TRAIN if c < 200 else Tier.UN_AVL, (15, 15)))
    with tempfile.TemporaryDirectory(prefix="felix-ckcost-") as tmp:
        path = Path(tmp) / "ck.safetensors"
        log = ckpt.AppliedLog(ckpt.applied_log_path(path))
        delta = np.full(64, 1e-3, np.float32)
        t = 0.0
        while orch.stats.updates_applied < args.updates:
            for task in orch.tasks():
                # A client's pace: each of the 200 answers every ~20 s, within the default task budget
                # (orchestrator.admission: 2 tasks a second), which would hold back clients paced at 1 ms.
                t += 0.1
                upd = ClientUpdate(30, 1.0, 0.5, 1.0, delta)
                for cmd in orch.handle(TaskFinished(t, task.client_id, task.task_id, upd)):
                    if isinstance(cmd, NewModelVersion):
                        r = cmd.report
                        for tid, cid, st, w in zip(
                            r.task_ids, r.client_ids, r.staleness, r.weights, strict=True
                        ):
                            log.append(ckpt.AppliedUpdate(cmd.version, tid, cid, st, w, t))
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            log.sync()
            size = ckpt.save_checkpoint(path, {"orchestrator": orch.state_dict(), "shell": log.position()})
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        orch.state_dict()
        t_state = time.perf_counter() - t0
        log.close()
    ms = np.array(sorted(times)) * 1000
    print(
        f"{orch.stats.updates_applied} applied updates, {len(orch.clients)} clients, snapshot {size / 1e6:.1f} MB: "
        f"checkpoint min {ms[0]:.1f} ms, median {np.median(ms):.1f} ms, max {ms[-1]:.1f} ms "
        f"(state_dict alone {t_state * 1000:.1f} ms)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
