"""A sweep of six small runs: one by one in this process against a local Ray instance with two
workers (issue 14's acceptance), side by side and repeated.

Run: ``PYTHONPATH=src python benchmarks/ray_sweep.py [--repeats 3] [--aggregations 150] [--clients 100] [--model small_cnn]``

Per repeat: the six runs one by one (``felix.runs.InlineBackend``: no process start, no imports to
pay, the kindest baseline for the sequential side), then a fresh local Ray instance with 2 CPUs
(start-up timed on its own) running the same six specs as Ray tasks (``RayTaskBackend``). Both use
``run.threads = 1``. It checks that every summary is identical apart from ``wall_time_s`` and prints
per repeat: sequential wall, Ray wall (without and with start-up), their ratio, Ray's per-run
overhead = (2 x Ray wall - sequential wall) / 6 (the worker-seconds a run costs beyond its own
compute: worker start, imports, data loading, scheduling, transfers), the round trip of a no-op task,
and the load average (other work on the machine slows both sides alike, not equally).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from felix.experiment import resolve_config
from felix.runs import InlineBackend, RunOutput, RunSpec, run_all


def noop(spec: RunSpec) -> RunOutput:
    return RunOutput({"strategy": spec.key, "time_to_target_s": None, "final_accuracy": None, "wall_time_s": 0.0}, [])


def specs(root: Path, aggregations: int, clients: int, model: str = "small_cnn") -> list[RunSpec]:
    out = []
    for strategy in ("fedbuff", "felix"):
        for seed in (0, 1, 2):
            cfg = resolve_config(None, strategy, {
                "seed": seed, "model": model, "partition": {"num_clients": clients},
                "run": {"max_aggregations": aggregations, "stop_at_target": False, "threads": 1}})
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
    import ray

    from felix.distributed.ray_runtime import start_local
    from felix.distributed.ray_tasks import RayTaskBackend

    quiet = lambda _line: None
    rows = []
    for rep in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            load0 = os.getloadavg()[0]
            seq_specs = specs(Path(tmp) / "seq", args.aggregations, args.clients, args.model)
            t = time.perf_counter()
            seq = run_all(seq_specs, InlineBackend(), log=quiet)
            seq_s = time.perf_counter() - t
            t = time.perf_counter()
            start_local(num_cpus=2)
            start_s = time.perf_counter() - t
            backend = RayTaskBackend(fn=noop)
            noop_specs = specs(Path(tmp) / "noop", 1, 12, "mlp")
            run_all(noop_specs[:2], backend, log=quiet)  # warm both workers
            t = time.perf_counter()
            for s in noop_specs:
                run_all([RunSpec(s.key + "/rt", s.config, s.out_dir.with_name(s.out_dir.name + "-rt"))], backend,
                        log=quiet)
            noop_ms = (time.perf_counter() - t) / len(noop_specs) * 1e3
            ray.shutdown()
            t = time.perf_counter()
            start_local(num_cpus=2)
            start2_s = time.perf_counter() - t
            ray_specs = specs(Path(tmp) / "ray", args.aggregations, args.clients, args.model)
            backend = RayTaskBackend()
            t = time.perf_counter()
            par = run_all(ray_specs, backend, log=quiet)
            ray_s = time.perf_counter() - t
            backend.close()
            ray.shutdown()
            load1 = os.getloadavg()[0]
        assert not seq.failed and not par.failed
        same = all(strip(seq.outputs[k].summary) == strip(par.outputs[k].summary) and
                   seq.outputs[k].rows == par.outputs[k].rows for k in seq.outputs)
        run_s = sum(o.summary["wall_time_s"] for o in seq.outputs.values())
        overhead = (2 * ray_s - seq_s) / len(ray_specs)
        rows.append((seq_s, ray_s, start2_s, ray_s / seq_s, (ray_s + start2_s) / seq_s, overhead, noop_ms))
        print(f"repeat {rep}: sequential {seq_s:.1f}s (simulation {run_s:.1f}s), ray {ray_s:.1f}s + start-up "
              f"{start2_s:.1f}s (first start {start_s:.1f}s), ratio {ray_s / seq_s:.2f} "
              f"(with start-up {(ray_s + start2_s) / seq_s:.2f}), per-run overhead {overhead:.2f} worker-s, "
              f"no-op task {noop_ms:.0f} ms, summaries identical: {same}, load {load0:.1f} -> {load1:.1f}",
              flush=True)
        assert same, "Ray and sequential summaries differ"
    names = ("sequential s", "ray s", "ray start-up s", "ratio", "ratio with start-up", "per-run overhead s",
             "no-op task ms")
    for i, name in enumerate(names):
        xs = [r[i] for r in rows]
        print(f"{name:>22}: min {min(xs):.2f}  median {statistics.median(xs):.2f}  max {max(xs):.2f}")


if __name__ == "__main__":
    main()
