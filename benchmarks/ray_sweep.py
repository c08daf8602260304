"""A sweep of six small runs: one by one in this process against a local Ray instance with two
workers (issue 14's acceptance), side by side and repeated.

Run: ``PYTHONPATH=src python benchmarks/ray_sweep.py [--repeats 3] [--aggregations 150] [--clients 100] [--model small_cnn]``

Per repeat, in alternating order (so a trend in the machine's load favours neither side): the
six runs one by one in this process (``felix.experiments.runs.InlineBackend``; this process is warmed up first,
so no imports or first-run costs: the kindest baseline for the sequential side), and a fresh local
Ray instance with 2 CPUs (start-up timed on its own) running the same six specs as Ray tasks
(``RayTaskBackend``), each in a fresh worker process. Both use ``run.threads = 1``. It checks that
every summary is identical apart from ``wall_time_s`` and prints: both walls and their ratio (also
counting Ray's start-up); Ray's per-run overhead, as wall (2 x Ray wall - sequential wall) / 6 and as
CPU (all Ray processes' CPU seconds - the sequential CPU seconds) / 6, i.e. what a run costs beyond
its own compute: worker start, imports, first-run warm-up, scheduling, transfers; the busiest
worker's CPU seconds over the sequential CPU seconds (the ratio an otherwise idle 2-core machine
would see, start-up aside); a no-op run's round trip on warm workers; and the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

from felix.engine.setup import resolve_config
from felix.experiments.runs import InlineBackend, Outcome, RunOutput, RunSpec, run_all


def noop(spec: RunSpec) -> RunOutput:
    return RunOutput(
        {"strategy": spec.key, "time_to_target_s": None, "final_accuracy": None, "wall_time_s": 0.0}, []
    )


def specs(root: Path, aggregations: int, clients: int, model: str = "small_cnn") -> list[RunSpec]:
    out = []
    for strategy in ("fedbuff", "felix"):
        for seed in (0, 1, 2):
            cfg = resolve_config(
                None,
                strategy,
                {
                    "seed": seed,
                    "model": model,
                    "partition": {"num_clients": clients},
                    "run": {"max_aggregations": aggregations, "stop_at_target": False, "threads": 1},
                },
            )
            out.append(RunSpec(f"{strategy}/seed={seed}", cfg, root / f"{strategy}-s{seed}"))
    return out


def strip(s: dict) -> dict:
    return {k: v for k, v in s.items() if k != "wall_time_s"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--aggregations", type=int, default=150)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--model", default="small_cnn", choices=("small_cnn", "mlp", "felix_cnn"))
    args = ap.parse_args()
    import psutil
    import ray

    from felix.distributed.ray_runtime import start_local
    from felix.experiments.ray_backend import RayTaskBackend

    quiet = lambda _line: None

    def sequential(root: Path) -> tuple[Outcome, float, float]:
        t, c = time.perf_counter(), time.process_time()
        out = run_all(specs(root, args.aggregations, args.clients, args.model), InlineBackend(), log=quiet)
        return out, time.perf_counter() - t, time.process_time() - c

    def on_ray(root: Path) -> tuple[Outcome, float, float, list[float], float, float]:
        t = time.perf_counter()
        start_local(num_cpus=2)
        backend = (
            RayTaskBackend()
        )  # warms each worker (felix.experiments.runs.warm_process): part of start-up
        start_s = time.perf_counter() - t
        t = time.perf_counter()
        out = run_all(specs(root, args.aggregations, args.clients, args.model), backend, log=quiet)
        wall = time.perf_counter() - t
        workers, other = [], 0.0  # CPU seconds of the Ray workers that ran runs, and of Ray's own processes
        for p in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                cpu = sum(p.cpu_times()[:2])
                if p.name().startswith("ray::") and "Agent" not in p.name():
                    workers.append(cpu)
                else:
                    other += cpu
        backend = RayTaskBackend(fn=noop)  # the same (warm) instance: a no-op run's round trip
        noop_specs = specs(root / "noop", 1, 12, "mlp")
        t = time.perf_counter()
        for s in noop_specs:
            run_all([s], backend, log=quiet)
        noop_ms = (time.perf_counter() - t) / len(noop_specs) * 1e3
        ray.shutdown()
        return out, wall, start_s, sorted(workers, reverse=True)[:2], other, noop_ms

    with tempfile.TemporaryDirectory() as tmp:  # warm this process: imports and first-run costs
        run_all(specs(Path(tmp), 2, 12, args.model)[:1], InlineBackend(), log=quiet)
    rows = []
    for rep in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            load0 = os.getloadavg()[0]
            if rep % 2 == 0:  # alternate the order so a load trend does not favour one side
                seq, seq_s, seq_cpu = sequential(Path(tmp) / "seq")
                par, ray_s, start_s, workers, other, noop_ms = on_ray(Path(tmp) / "ray")
            else:
                par, ray_s, start_s, workers, other, noop_ms = on_ray(Path(tmp) / "ray")
                seq, seq_s, seq_cpu = sequential(Path(tmp) / "seq")
            load1 = os.getloadavg()[0]
        assert not seq.failed and not par.failed
        same = all(
            strip(seq.outputs[k].summary) == strip(par.outputs[k].summary)
            and seq.outputs[k].rows == par.outputs[k].rows
            for k in seq.outputs
        )
        overhead = (2 * ray_s - seq_s) / 6
        cpu_overhead = (sum(workers) + other - seq_cpu) / 6
        rows.append(
            (
                seq_s,
                ray_s,
                start_s,
                ray_s / seq_s,
                (ray_s + start_s) / seq_s,
                overhead,
                cpu_overhead,
                max(workers) / seq_cpu,
                noop_ms,
            )
        )
        print(
            f"repeat {rep}: sequential {seq_s:.1f}s ({seq_cpu:.1f} CPU s), ray {ray_s:.1f}s + start-up "
            f"{start_s:.1f}s, ratio {ray_s / seq_s:.2f} (with start-up {(ray_s + start_s) / seq_s:.2f}); "
            f"ray CPU s: workers {' + '.join(f'{w:.1f}' for w in workers)}, ray's own processes {other:.1f}; "
            f"per-run overhead {overhead:.2f} worker-s wall, {cpu_overhead:.2f} CPU-s; busiest worker's CPU / "
            f"sequential CPU {max(workers) / seq_cpu:.2f}; no-op run {noop_ms:.0f} ms; "
            f"summaries identical: {same}; load {load0:.1f} -> {load1:.1f}",
            flush=True,
        )
        if not same:
            diff = {
                k: [
                    x
                    for x in seq.outputs[k].summary
                    if x != "wall_time_s" and seq.outputs[k].summary[x] != par.outputs[k].summary.get(x)
                ]
                for k in seq.outputs
            }
            raise SystemExit(
                f"Ray and sequential summaries differ (do not commit while this runs: provenance "
                f"records the commit): {diff}"
            )
    names = (
        "sequential s",
        "ray s",
        "ray start-up s",
        "ratio",
        "ratio with start-up",
        "overhead wall s/run",
        "overhead CPU s/run",
        "busiest worker CPU/seq",
        "no-op run ms",
    )
    for i, name in enumerate(names):
        xs = [r[i] for r in rows]
        print(f"{name:>22}: min {min(xs):.2f}  median {statistics.median(xs):.2f}  max {max(xs):.2f}")


if __name__ == "__main__":
    main()
