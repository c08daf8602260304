"""Engine speed: a simulated run's wall time against a bare sequential PyTorch loop doing the same
client updates (same model, data, seeds and SGD steps), measured side by side in one process.

    python benchmarks/engine_speed.py --scenario felix-cpu-100 --preset felix --aggregations 300 --json
    python benchmarks/engine_speed.py --scenario felix-cifar10 --preset felix --aggregations 500 \\
        --set run.device=cuda --json
    python benchmarks/engine_speed.py --selection 1000000 10000 --json

Prints wall time per aggregation, client updates per second, virtual hours per wall hour and
``ratio_to_bare`` = simulator wall / bare loop (below 1: the engine is faster than training the
same updates one by one). The simulated run includes the global evaluation (``run.eval_every``
of the scenario); the bare loop is training only. Evaluations are not part of the bare loop. Process CPU times and their ratio
(``cpu_ratio_to_bare``) come too: on a machine shared with other work they are steadier than wall time.
``--cohort`` sets ``run.cohort`` (auto, 1 or N); ``run.threads`` applies as in any run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from felix.client.trainer import ClientData
from felix.config import parse_set
from felix.engine.run import resolve_config
from felix.metrics.provenance import provenance
from felix.sim.build import Built, build


def simulate(
    args: argparse.Namespace, aggregations: int, cohort: str | None = None
) -> tuple[Built, Any, list[tuple[ClientData, int, np.ndarray]]]:
    sets = parse_set(args.set)
    run = sets.setdefault("run", {})
    run.update({"max_aggregations": aggregations, "stop_at_target": False})
    if cohort is not None:
        run["cohort"] = cohort if cohort == "auto" else int(cohort)
    cfg = resolve_config(None, args.preset, sets, args.scenario)
    built = build(cfg)
    tasks: list[tuple[ClientData, int, np.ndarray]] = []
    built.sim._on_train = lambda dev, task: tasks.append((dev.data, task.task_id, task.weights))
    cpu0 = time.process_time()
    out = built.sim.run()
    built.sim_cpu_s = time.process_time() - cpu0  # type: ignore[attr-defined]
    return built, out, tasks


def bare_loop(built: Built, tasks: list[tuple[ClientData, int, np.ndarray]]) -> tuple[float, float]:
    """The same updates, one after another, in the plainest PyTorch: load the weights, SGD over the
    client's batches in its seeded order, take the delta. Data already on the device."""
    cfg = built.cfg
    c = cfg.client
    device = torch.device(cfg.run.device)
    model = built.sim.trainer.model
    params = list(model.parameters())
    model.train()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0, cpu0 = time.perf_counter(), time.process_time()
    for data, task_id, weights in tasks:
        flat = torch.from_numpy(np.array(weights)).to(device)
        vector_to_parameters(flat.clone(), params)
        opt = torch.optim.SGD(params, lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay)
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + task_id)
        x, y = data.on(device)
        n, steps = len(y), 0
        for _ in range(c.epochs):
            order = torch.randperm(n, generator=gen).to(device)
            stop = n - n % c.batch_size if c.drop_last else n
            for s in range(0, stop, c.batch_size):
                if c.max_steps is not None and steps >= c.max_steps:
                    break
                idx = order[s : s + c.batch_size]
                loss = F.cross_entropy(model(x[idx]), y[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                steps += 1
        _ = (parameters_to_vector(params) - flat).detach().cpu().numpy()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, time.process_time() - cpu0


def engine(args: argparse.Namespace, aggregations: int, cohort: str | None) -> dict[str, Any]:
    simulate(args, args.warmup, cohort)  # first-call costs of torch and the allocator are not the engine's
    built, out, tasks = simulate(args, aggregations, cohort)
    runs = [bare_loop(built, tasks) for _ in range(args.bare_repeats)]
    bare, bare_cpu = min(r[0] for r in runs), min(r[1] for r in runs)
    sim_cpu = built.sim_cpu_s  # type: ignore[attr-defined]
    cfg, sim = built.cfg, built.sim
    aggs = built.orch.version
    wall = out.wall_time_s
    return {
        "scenario": cfg.name,
        "strategy": cfg.strategy,
        "seed": cfg.seed,
        "device": cfg.run.device,
        "threads": torch.get_num_threads(),
        "cohort_setting": cfg.run.cohort,
        "cohort_size": sim.cfg.cohort_size,
        "precision": cfg.run.precision,
        "model": cfg.model,
        "torch": torch.__version__,
        "aggregations": aggs,
        "updates": len(tasks),
        "wall_s": round(wall, 3),
        "train_s": round(out.train_seconds, 3),
        "trained_unused": out.trained_unused,
        "wall_per_aggregation_s": round(wall / max(aggs, 1), 5),
        "aggregations_per_s": round(aggs / wall, 3) if wall else None,
        "updates_per_s": round(len(tasks) / wall, 2) if wall else None,
        "virtual_s": round(out.virtual_time_s, 1),
        "virtual_h_per_wall_h": round(out.virtual_time_s / wall, 1) if wall else None,
        "final_accuracy": built.recorder.rows[-1].accuracy,
        "bare_sequential_s": round(bare, 3),
        "ratio_to_bare": round(wall / bare, 3) if bare else None,
        # Process CPU seconds: less sensitive than wall time to other load on a shared machine.
        "cpu_s": round(sim_cpu, 3),
        "bare_cpu_s": round(bare_cpu, 3),
        "cpu_ratio_to_bare": round(sim_cpu / bare_cpu, 3) if bare_cpu else None,
        "provenance": provenance(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default="felix-cpu-100")
    ap.add_argument("--preset", default="felix")
    ap.add_argument(
        "--aggregations",
        default="300",
        help="aggregations per run; a comma-separated list pairs with --cohort's list",
    )
    ap.add_argument("--warmup", type=int, default=5, help="aggregations of an untimed first run")
    ap.add_argument(
        "--cohort",
        help="run.cohort: auto, 1 (sequential) or N (default: the config's); a "
        "comma-separated list runs each in turn in this process, one JSON line each",
    )
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override, as felix run"
    )
    ap.add_argument(
        "--bare-repeats", type=int, default=2, help="the bare loop's time is the best of this many"
    )
    ap.add_argument(
        "--selection",
        nargs=2,
        type=int,
        metavar=("REGISTERED", "AVAILABLE"),
        help="time one selection decision at this population size instead",
    )
    ap.add_argument("--repeats", type=int, default=20, help="selection decisions timed (--selection)")
    ap.add_argument("--json", action="store_true", help="one JSON line instead of text")
    args = ap.parse_args(argv)
    if args.selection is not None:
        try:
            from selection_speed import measure_selection  # benchmarks/selection_speed.py
        except ImportError:
            print(
                "engine_speed: selection benchmark not available in this build "
                "(benchmarks/selection_speed.py with measure_selection is missing)",
                file=sys.stderr,
            )
            return 2
        report(
            measure_selection(
                registered=args.selection[0], available=args.selection[1], repeats=args.repeats
            ),
            args.json,
        )
        return 0
    cohorts: list[str | None] = list(args.cohort.split(",")) if args.cohort else [None]
    aggs = [int(a) for a in str(args.aggregations).split(",")]
    if len(aggs) == 1:
        aggs *= len(cohorts)
    if len(aggs) != len(cohorts):
        ap.error("--aggregations needs one value, or one per --cohort value")
    for cohort, n in zip(cohorts, aggs):
        report(engine(args, n, cohort), args.json)
    return 0


def report(res: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(res), flush=True)
    else:
        for k, v in res.items():
            print(f"{k:>24}: {v}")
        print(flush=True)


if __name__ == "__main__":
    sys.exit(main())
