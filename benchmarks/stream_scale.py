"""Streaming data at scale: 10,000 clients and about 10^6 arrivals over a simulated week.

    python benchmarks/stream_scale.py --mode stream --json     # the stream model alone, 604,800 task starts
    python benchmarks/stream_scale.py --mode engine --json     # the whole simulator, training included

``stream``: every client's stream (Poisson arrivals at 10^6 / (clients x 168 h) per client-hour,
lognormal label delays, a store capped at ``--cap``) read at task starts drawn uniformly over the
clients, ``--task-rate`` per virtual second, in time order, as the simulator reads them (each read
builds the task's training tensors from the pool). ``engine``: a simulated run of the digits MLP
over the same population and stream (always available, constant ``--runtime`` s tasks, FedBuff,
concurrency ``--concurrency``, no evaluation), its completion events timed.

Reported per simulated day: the wall and CPU microseconds per event (a task start or a
completion; the CPU time is the steadier figure on a shared machine), the arrivals so far, the bytes of sample records held by all stores (and generated blocks not yet
arrived), and the process's peak RSS. Memory is bounded when the held bytes stop growing once the
stores are full (cap x clients x 36 bytes); the per-event cost is flat when it does not grow with
the days (the arrivals so far). One thread; timings on a shared machine are noisy: compare days
within one run.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from typing import Any

import numpy as np
import torch

from felix.config import validate
from felix.metrics.provenance import provenance
from felix.stream.model import StreamModel

WEEK_S = 7 * 86400.0
DAY_S = 86400.0


def stream_cfg(clients: int, arrivals: float, cap: int) -> dict[str, Any]:
    return {
        "enabled": True,
        # A day of history before the run, so that the slow clients hold samples from the start.
        "arrivals": {"rate_per_hour": arrivals / (clients * (WEEK_S + DAY_S) / 3600.0), "warmup_s": DAY_S},
        "labels": {"delay": "lognormal", "median_s": 1800.0, "sigma": 1.0},
        "store": {"cap": cap},
        "drift": {
            "imbalance": 5.0,
            "shifts": [{"kind": "surge", "at_s": 3 * DAY_S, "classes": [1, 2], "factor": 5}],
        },
    }


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_stream(args: argparse.Namespace) -> dict[str, Any]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    pool_x = torch.as_tensor(x, dtype=torch.float32)
    cfg = validate({"stream": stream_cfg(args.clients, args.arrivals, args.cap)}).stream
    model = StreamModel(cfg, y, 10, args.clients, args.seed)
    rng = np.random.default_rng(args.seed)
    days = []
    for day in range(7):
        n = rng.poisson(args.task_rate * DAY_S)
        times = np.sort(rng.uniform(day * DAY_S, (day + 1) * DAY_S, n))
        clients = rng.integers(0, args.clients, n)
        t0, c0 = time.perf_counter(), time.process_time()
        samples = 0
        for t, c in zip(times.tolist(), clients.tolist()):
            snap = model.client(c).snapshot(t)
            pool_x.index_select(0, torch.from_numpy(snap.index))
            samples += len(snap)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        for c in range(args.clients):  # every store at the day's end, for the memory figure
            model.client(c).advance((day + 1) * DAY_S)
        st = model.stats()
        days.append(
            {
                "day": day + 1,
                "events": int(n),
                "us_per_event": round(1e6 * wall / max(n, 1), 2),
                "cpu_us_per_event": round(1e6 * cpu / max(n, 1), 2),
                "samples_per_task": round(samples / max(n, 1), 2),
                "arrivals_so_far": st.arrivals,
                "dropped_by_cap": st.dropped,
                "held_mb": round(model.held_bytes() / 1e6, 3),
                "peak_rss_mb": round(rss_mb(), 1),
            }
        )
        print(json.dumps(days[-1]), file=sys.stderr)
    return {"days": days, "store_bound_mb": round(args.clients * args.cap * 36 / 1e6, 3)}


def run_engine(args: argparse.Namespace) -> dict[str, Any]:
    from felix.engine.setup import resolve_config
    from felix.sim.build import Built
    from felix.sim.run import run_config

    sets = {
        "model": "mlp",
        "dataset": {"name": "digits"},
        "partition": {"kind": "iid", "num_clients": args.clients},
        "trace": {"kind": "always"},
        "runtime": {"kind": "constant", "constant_s": args.runtime},
        "orchestrator": {"concurrency": args.concurrency, "agg_goal": 10, "task_timeout_s": None},
        "client": {"batch_size": 32, "max_steps": 1},
        "run": {"max_time_s": WEEK_S, "eval_every": 0, "stop_at_target": False},
        "seed": args.seed,
        "stream": stream_cfg(args.clients, args.arrivals, args.cap),
    }
    cfg = resolve_config(None, "fedbuff", sets)
    marks: list[
        tuple[float, float, float, int]
    ] = []  # (virtual time, wall, CPU, arrivals) at each day's first event
    counts = [0] * 8
    built_ref: list[Built] = []

    def prepare(built: Built) -> None:
        built_ref.append(built)
        sim = built.sim
        inner = sim._on_done

        def on_done(dev, token):  # type: ignore[no-untyped-def]
            day = int(sim.now // DAY_S)
            counts[min(day, 7)] += 1
            if len(marks) <= day:
                assert built.stream is not None
                marks.append(
                    (sim.now, time.perf_counter(), time.process_time(), built.stream.stats().arrivals)
                )
                print(
                    f"day {day}: rss {rss_mb():.0f} MB, held {built.stream.held_bytes() / 1e6:.2f} MB",
                    file=sys.stderr,
                )
            inner(dev, token)

        sim._on_done = on_done  # type: ignore[method-assign]

    t0 = time.perf_counter()
    result = run_config(cfg, None, plots=False, prepare=prepare)
    end = time.perf_counter()
    stream = built_ref[0].stream
    assert stream is not None
    marks.append((WEEK_S, end, time.process_time(), stream.stats().arrivals))
    days = [
        {
            "day": d + 1,
            "events": counts[d],
            "us_per_event": round(1e6 * (marks[d + 1][1] - marks[d][1]) / max(counts[d], 1), 1),
            "cpu_us_per_event": round(1e6 * (marks[d + 1][2] - marks[d][2]) / max(counts[d], 1), 1),
            "arrivals_so_far": marks[d + 1][3],
        }
        for d in range(len(marks) - 1)
    ]
    st = stream.stats()
    return {
        "days": days,
        "wall_s": round(end - t0, 1),
        "aggregations": result.summary["aggregations"],
        "arrivals": st.arrivals,
        "dropped_by_cap": st.dropped,
        "held_mb_end": round(stream.held_bytes() / 1e6, 3),
        "store_bound_mb": round(args.clients * args.cap * 36 / 1e6, 3),
        "peak_rss_mb": round(rss_mb(), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["stream", "engine"], default="stream")
    ap.add_argument("--clients", type=int, default=10_000)
    ap.add_argument("--arrivals", type=float, default=1e6, help="expected arrivals over the week")
    ap.add_argument("--cap", type=int, default=32)
    ap.add_argument(
        "--task-rate", type=float, default=1.0, help="stream mode: task starts per virtual second"
    )
    ap.add_argument("--runtime", type=float, default=30.0, help="engine mode: seconds per task")
    ap.add_argument("--concurrency", type=int, default=30, help="engine mode: tasks in flight")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = {
        "mode": args.mode,
        "clients": args.clients,
        "expected_arrivals": args.arrivals,
        "cap": args.cap,
        **(run_stream(args) if args.mode == "stream" else run_engine(args)),
        "provenance": provenance({"threads": 1}),
    }
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
