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
``--cohort`` sets ``run.cohort`` (auto, 1 or N); ``run.threads`` applies as in any run, and to the
bare loop unless ``--bare-threads`` says otherwise (a plain PyTorch loop over an MLP's clients runs
as fast on one thread as on two: ``--set run.threads=2 --bare-threads 1`` sets the run on two
threads against the loop on one).

On a shared machine one run and one loop can land in different load, so the bare loop is
interleaved with the run: after every ``--interleave`` aggregations (default 10) the run pauses and
the bare loop does the updates trained since the last pause (each chunk timed as the best of
``--bare-repeats``); the run's wall and CPU times leave those pauses out. Both then see the same
load, a second at a time, instead of one taking the run's half minute and the other the next.
``--interleave 0`` runs the whole bare loop after the run (as before 2 December). ``--rounds N``
repeats the pair N times in this process, checks that every round ran the same run, and reports
the median round (by ``ratio_to_bare``) with every round's wall time, bare time and ratio beside
it (``*_rounds``) and the smallest ratio (``ratio_to_bare_min``).

``--workers`` sets ``run.workers`` (a list runs each in turn): the run's clients trained side by side
on that many single-threaded workers, e.g. ``--workers 1,2 --bare-threads 1`` for one worker and two
against the bare loop on one thread. Every round records the machine's load averages before and
after it (``load_avg_before``, ``load_avg_after``): other processes' work on a shared machine.

``--bare-evaluate`` makes the bare loop also do the run's evaluations in the plainest PyTorch: a
forward pass over the test set (batches of 1,000) for every global evaluation and over the client's
data (batches of 256) for every eval task the run completed, timed apart (``bare_eval_s``) and
reported as a second ratio, ``ratio_to_bare_with_eval`` = simulator wall / (bare training + bare
evaluations), beside ``ratio_to_bare`` (training only), which stays as it is. A scenario that
evaluates at every aggregation (felix-cifar10-cpu) does about as much evaluating as training.

The bare loop's model is the run's architecture with torch's own ``nn.MaxPool2d`` in place of the
built-in CNNs' pool (``felix.client.pooling``, the same bits through torch's channels-last
kernel): the loop a user would write. ``--bare-fast-pool`` keeps felix's pool in the bare loop too,
which separates that kernel's gain from the engine's (``bare_pool`` in the JSON says which).

``--busy N`` starts N processes that each keep a core busy (a Python loop) for the whole
measurement and ends them after: the run under contention, as when a user runs other work beside
it (``busy`` in the JSON). On two cores, ``--set run.threads=2 --bare-threads 1 --busy 1`` is the
two-thread run with one of its cores taken.
"""

from __future__ import annotations

import felix  # noqa: F401  (before torch: felix sets torch's CPU kernels and thread waiting at import)

# isort: split
import argparse
import copy
import dataclasses
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from felix.client.pooling import MaxPool2d
from felix.client.trainer import ClientData
from felix.config import parse_set
from felix.core.types import TaskKind
from felix.engine.setup import resolve_config
from felix.metrics.provenance import provenance
from felix.sim.build import Built, build
from felix.sim.simulation import SimOutcome

Task = tuple[ClientData, int, np.ndarray]  # a training task: its client's data, its id, its weights
Probe = tuple[ClientData, np.ndarray]  # an eval task: its client's data, its weights


@dataclass
class Simulated:
    """A simulated run and what the benchmark measured around it."""

    built: Built
    out: SimOutcome
    tasks: list[Task]  # every training task: its data, id and weights
    eval_s: float  # wall seconds in the global evaluation
    cpu_s: float  # process CPU seconds of the run (without the bare loop's chunks)
    gc_s: float  # wall seconds in Python's cyclic garbage collector (within the parts above)
    gc_collections: int
    bare: BareLoop | None  # the bare loop (interleaved with the run, or after it), if asked for


class BareLoop:
    """:func:`bare_loop` in chunks, each timed as the best of ``repeats``; the times add up.
    ``threads``: torch threads for the chunks (``None``: the run's), the run's restored after.
    With ``evaluate``, each chunk also does the run's evaluations and eval tasks recorded since the
    last one (``evals``, ``probes``: the run appends to them) with :func:`bare_evaluate`, timed apart."""

    def __init__(
        self,
        built: Built,
        repeats: int,
        threads: int | None = None,
        evaluate: bool = False,
        fast_pool: bool = False,
    ) -> None:
        self.built, self.repeats, self.threads, self.evaluate = built, repeats, threads, evaluate
        self.fast_pool = fast_pool
        self.model = copy.deepcopy(built.sim.trainer.model)  # the run's own models stay untouched
        if not fast_pool:
            plain_pools(self.model)
        self.wall_s = self.cpu_s = 0.0  # the sums of the chunks' best times
        self.eval_wall_s = self.eval_cpu_s = 0.0  # the same for the evaluations (evaluate)
        self.evals: list[np.ndarray] = []
        self.probes: list[Probe] = []
        self._evaluated = [0, 0]  # evals and probes already done
        self.paused_s = self.paused_cpu_s = 0.0  # everything the chunks took, repeats included

    def chunk(self, tasks: list[Task]) -> None:
        if torch.device(self.built.cfg.run.device).type == "cuda":
            torch.cuda.synchronize()  # the run's queued work is the run's, not the pause's
        run_threads = torch.get_num_threads()
        torch.set_num_threads(self.threads or run_threads)
        t0, cpu0 = time.perf_counter(), time.process_time()
        try:
            runs = [bare_loop(self.built, tasks, self.model) for _ in range(self.repeats)]
            if self.evaluate:
                evals, probes = self.evals[self._evaluated[0] :], self.probes[self._evaluated[1] :]
                self._evaluated = [len(self.evals), len(self.probes)]
                evaluated = [
                    bare_evaluate(self.built, evals, probes, self.model) for _ in range(self.repeats)
                ]
                self.eval_wall_s += min(r[0] for r in evaluated)
                self.eval_cpu_s += min(r[1] for r in evaluated)
        finally:
            torch.set_num_threads(run_threads)
        self.wall_s += min(r[0] for r in runs)
        self.cpu_s += min(r[1] for r in runs)
        self.paused_s += time.perf_counter() - t0
        self.paused_cpu_s += time.process_time() - cpu0


def simulate(
    args: argparse.Namespace,
    aggregations: int,
    cohort: str | None = None,
    around: AbstractContextManager[Any] | None = None,
    interleave: int = 0,
    workers: int | None = None,
    bare_loop_too: bool = False,
) -> Simulated:
    """Build and run the config; ``around`` wraps the run alone (e.g. a profiler), not the build.
    ``interleave`` above 0: pause the run after every that many aggregations for a chunk of the
    bare loop (the training tasks completed since the last chunk; see the module docstring);
    ``bare_loop_too``: the bare loop after the run where it is not interleaved."""
    sets = parse_set(args.set)
    run = sets.setdefault("run", {})
    run.update({"max_aggregations": aggregations, "stop_at_target": False})
    if cohort is not None:
        run["cohort"] = cohort if cohort == "auto" else int(cohort)
    if workers is not None:
        run["workers"] = workers
    cfg = resolve_config(None, args.preset, sets, args.scenario)
    built = build(cfg)
    tasks: list[Task] = []
    bare = None
    if interleave > 0 or bare_loop_too:
        bare = BareLoop(built, args.bare_repeats, args.bare_threads, args.bare_evaluate, args.bare_fast_pool)
    if bare is not None and bare.evaluate:  # every eval task the run completes, for the bare loop to redo
        for dev in built.sim.devices:
            dev.complete = recording_probes(dev, bare.probes)  # type: ignore[method-assign]
    done = [0, interleave]  # tasks already in a chunk; the version that ends the current chunk

    def on_train(dev: Any, task: Any) -> None:
        # Called at a training task's completion, before the engine times its training.
        tasks.append((dev.data, task.task_id, task.weights))
        if bare is not None and interleave > 0 and built.orch.version >= done[1]:
            bare.chunk(tasks[done[0] :])
            done[0], done[1] = len(tasks), built.orch.version + interleave

    built.sim._on_train = on_train
    evaluate, eval_s = built.recorder.evaluate, [0.0]

    def timed_evaluate(weights: np.ndarray) -> tuple[float, float]:
        if bare is not None:
            bare.evals.append(np.array(weights, copy=True))
        t0 = time.perf_counter()
        try:
            return evaluate(weights)  # ends in a host copy of the result: GPU work is done
        finally:
            eval_s[0] += time.perf_counter() - t0

    built.recorder.evaluate = timed_evaluate
    collector = [0.0, 0.0, 0]  # start of the current collection, seconds, collections

    def timed_collection(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collector[0] = time.perf_counter()
        else:
            collector[1] += time.perf_counter() - collector[0]
            collector[2] += 1

    gc.callbacks.append(timed_collection)
    try:
        with around if around is not None else nullcontext():
            cpu0 = time.process_time()
            out = built.sim.run()
            cpu_s = time.process_time() - cpu0
    finally:
        gc.callbacks.remove(timed_collection)
    if bare is not None and interleave > 0:
        out = dataclasses.replace(out, wall_time_s=out.wall_time_s - bare.paused_s)
        cpu_s -= bare.paused_cpu_s
        bare.chunk(tasks[done[0] :])  # the updates since the last pause
    elif bare is not None:  # the whole bare loop now, as one chunk
        bare.chunk(tasks)
    return Simulated(built, out, tasks, eval_s[0], cpu_s, collector[1], int(collector[2]), bare)


def plain_pools(model: torch.nn.Module) -> None:
    """Put torch's own ``nn.MaxPool2d`` (same parameters) in place of felix's channels-last pool."""
    for name, m in list(model.named_modules()):
        if type(m) is MaxPool2d:
            parent, _, attr = name.rpartition(".")
            plain = torch.nn.MaxPool2d(m.kernel_size, m.stride, m.padding, m.dilation, ceil_mode=m.ceil_mode)
            setattr(model.get_submodule(parent), attr, plain)


def bare_loop(built: Built, tasks: list[Task], model: torch.nn.Module) -> tuple[float, float]:
    """The same updates, one after another, in the plainest PyTorch: load the weights, SGD over the
    client's batches in its seeded order, take the delta. Data already on the device. ``model``:
    one of the run's architecture, whose parameters the loop overwrites."""
    cfg = built.cfg
    c = cfg.client
    device = torch.device(cfg.run.device)
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


def recording_probes(dev: Any, probes: list[Probe]) -> Any:
    """``dev.complete`` that also appends each completed eval task's data and weights to ``probes``."""
    complete = dev.complete

    def recorded(token: int) -> Any:
        task = complete(token)
        if task is not None and task.kind is TaskKind.EVAL:
            probes.append((dev.data, task.weights))
        return task

    return recorded


@torch.no_grad()
def bare_evaluate(
    built: Built, evals: list[np.ndarray], probes: list[Probe], model: torch.nn.Module
) -> tuple[float, float]:
    """The run's evaluations in the plainest PyTorch: per evaluated version a forward pass over the
    test set in batches of 1,000 (accuracy and summed loss), per eval task one over its client's
    data in batches of 256 (the sums of squared and plain losses). ``model`` as in :func:`bare_loop`."""
    assert built.plan is not None and built.plan.test_pass is not None, "the run has no test set"
    test = built.plan.test_pass
    device = torch.device(built.cfg.run.device)
    params = list(model.parameters())
    model.eval()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0, cpu0 = time.perf_counter(), time.process_time()
    for weights in evals:
        vector_to_parameters(torch.from_numpy(np.array(weights)).to(device), params)
        correct, loss = 0, 0.0
        for s in range(0, len(test.y), 1000):
            logits, yb = model(test.x[s : s + 1000]), test.y[s : s + 1000]
            loss += float(F.cross_entropy(logits, yb, reduction="sum"))
            correct += int((logits.argmax(1) == yb).sum())
    for data, weights in probes:
        vector_to_parameters(torch.from_numpy(np.array(weights)).to(device), params)
        x, y = data.on(device)
        sq, ls = 0.0, 0.0
        for s in range(0, len(y), 256):
            per = F.cross_entropy(model(x[s : s + 256]), y[s : s + 256], reduction="none")
            sq += float((per * per).sum())
            ls += float(per.sum())
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, time.process_time() - cpu0


def engine(
    args: argparse.Namespace, aggregations: int, cohort: str | None, workers: int | None = None
) -> dict[str, Any]:
    # first-call costs of torch and the allocator are not the engine's
    simulate(args, args.warmup, cohort, workers=workers)
    rounds = [measure_round(args, aggregations, cohort, workers) for _ in range(args.rounds)]
    same = {(r["virtual_s"], r["final_accuracy"], r["updates"]) for r in rounds}
    if len(same) != 1:
        raise RuntimeError(
            f"engine_speed: the rounds ran different runs {sorted(same)}: the run is not reproducible"
        )
    ranked = sorted(rounds, key=lambda r: r["ratio_to_bare"])
    res = ranked[(len(ranked) - 1) // 2]  # the median round (the lower one of an even count)
    if len(rounds) > 1:
        res = {
            **res,
            "rounds": len(rounds),
            "ratio_to_bare_min": ranked[0]["ratio_to_bare"],
            "ratio_to_bare_rounds": [r["ratio_to_bare"] for r in rounds],
            "wall_s_rounds": [r["wall_s"] for r in rounds],
            "bare_sequential_s_rounds": [r["bare_sequential_s"] for r in rounds],
        }
    return {**res, "provenance": provenance()}


def measure_round(
    args: argparse.Namespace, aggregations: int, cohort: str | None, workers: int | None = None
) -> dict[str, Any]:
    """One simulated run and its bare loop (the best of ``--bare-repeats``, chunk by chunk when
    interleaved), side by side; the machine's load averages before and after (other work on it)."""
    load_before = os.getloadavg()
    run = simulate(
        args, aggregations, cohort, interleave=args.interleave, workers=workers, bare_loop_too=True
    )
    built, out, tasks, eval_s, sim_cpu = run.built, run.out, run.tasks, run.eval_s, run.cpu_s
    loop = run.bare
    assert loop is not None
    bare, bare_cpu = loop.wall_s, loop.cpu_s
    cfg, sim = built.cfg, built.sim
    aggs = built.orch.version
    wall = out.wall_time_s
    stats = getattr(sim.cohort, "stats", None)  # the local cohort trainer's (CohortStats)
    shape: dict[str, Any] = {}
    if stats is not None:
        shape = {
            "cohort_advances": stats.advances,
            "cohort_lockstep_steps": stats.lockstep_steps,
            "cohort_client_steps": stats.client_steps,
            "cohort_mean_rows": round(stats.mean_rows, 2),
            "cohort_probe_calls": stats.probe_calls,
            "cohort_probe_rows": stats.probe_rows,
        }
    return {
        "scenario": cfg.name,
        "strategy": cfg.strategy,
        "seed": cfg.seed,
        "device": cfg.run.device,
        "threads": torch.get_num_threads(),
        "workers": cfg.run.workers,
        "cohort_setting": cfg.run.cohort,
        "cohort_size": sim.cfg.cohort_size,
        "precision": cfg.run.precision,
        "model": cfg.model,
        "torch": torch.__version__,
        "aggregations": aggs,
        "updates": len(tasks),
        "wall_s": round(wall, 3),
        "train_s": round(out.train_seconds, 3),
        # Where the rest went: eval tasks (probes), the global evaluation, and everything else
        # (orchestrator, event loop, byte accounting).
        "probe_s": round(out.probe_seconds, 3),
        "eval_s": round(eval_s, 3),
        "other_s": round(wall - out.train_seconds - out.probe_seconds - eval_s, 3),
        # Pauses of Python's cyclic collector, wherever they fell (they are inside the parts above).
        "gc_s": round(run.gc_s, 3),
        "gc_collections": run.gc_collections,
        **shape,
        "trained_unused": out.trained_unused,
        "wall_per_aggregation_s": round(wall / max(aggs, 1), 5),
        "aggregations_per_s": round(aggs / wall, 3) if wall else None,
        "updates_per_s": round(len(tasks) / wall, 2) if wall else None,
        "virtual_s": round(out.virtual_time_s, 1),
        "virtual_h_per_wall_h": round(out.virtual_time_s / wall, 1) if wall else None,
        "final_accuracy": built.recorder.rows[-1].accuracy,
        "bare_sequential_s": round(bare, 3),
        "bare_threads": loop.threads or torch.get_num_threads(),
        "bare_pool": "felix" if loop.fast_pool else "torch",
        "interleave": args.interleave,
        "ratio_to_bare": round(wall / bare, 3) if bare else None,
        # Process CPU seconds: less sensitive than wall time to other load on a shared machine.
        "cpu_s": round(sim_cpu, 3),
        "bare_cpu_s": round(bare_cpu, 3),
        "cpu_ratio_to_bare": round(sim_cpu / bare_cpu, 3) if bare_cpu else None,
        **(with_evaluations(loop, wall, sim_cpu) if loop.evaluate else {}),
        # 1, 5 and 15 minute load averages when the round began and ended
        "load_avg_before": [round(v, 2) for v in load_before],
        "load_avg_after": [round(v, 2) for v in os.getloadavg()],
    }


def with_evaluations(loop: BareLoop, wall: float, cpu: float) -> dict[str, Any]:
    """The second ratio (``--bare-evaluate``): the run against the bare loop's training and evaluations."""
    bare, bare_cpu = loop.wall_s + loop.eval_wall_s, loop.cpu_s + loop.eval_cpu_s
    return {
        "bare_evaluations": len(loop.evals),
        "bare_probes": len(loop.probes),
        "bare_eval_s": round(loop.eval_wall_s, 3),
        "bare_eval_cpu_s": round(loop.eval_cpu_s, 3),
        "ratio_to_bare_with_eval": round(wall / bare, 3) if bare else None,
        "cpu_ratio_to_bare_with_eval": round(cpu / bare_cpu, 3) if bare_cpu else None,
    }


def profile(args: argparse.Namespace, aggregations: int, cohort: str | None, path: str) -> None:
    """One more run of ``aggregations`` under ``torch.profiler`` (CPU, and CUDA on a GPU): the
    operators by their own time, then split by input shapes, written to ``path`` with the command
    and provenance. Kept apart from the timed run, whose figures the profiler would inflate; on a
    GPU it shows whether a lockstep step waits on the host (many short kernels, CPU time per call)
    or on the device (CUDA time)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []  # no events from a CPU run
    prof = torch_profile(activities=[ProfilerActivity.CPU, *cuda], record_shapes=True)
    run = simulate(args, aggregations, cohort, prof)
    built, out = run.built, run.out
    on_cuda = torch.device(built.cfg.run.device).type == "cuda"
    key = "self_cuda_time_total" if on_cuda else "self_cpu_time_total"
    head = (
        f"# engine_speed --profile: {built.cfg.name} / {built.cfg.strategy}, cohort "
        f"{built.cfg.run.cohort}, {built.orch.version} aggregations, wall {out.wall_time_s:.2f} s "
        f"(train {out.train_seconds:.2f} s, probes {out.probe_seconds:.2f} s, evaluation "
        f"{run.eval_s:.2f} s), sorted by {key}\n# command: {' '.join(sys.argv)}\n"
        f"# provenance: {json.dumps(provenance())}\n"
    )
    table = prof.key_averages().table(sort_by=key, row_limit=40)
    # The same operators split by their input shapes: which product (a stack's first layer forward,
    # its weight gradient, the probe's or the evaluation's) takes the time.
    shapes = prof.key_averages(group_by_input_shape=True).table(sort_by=key, row_limit=25)
    Path(path).write_text(head + table + "\n\n# by input shapes\n" + shapes + "\n")


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
        "--workers",
        help="run.workers (default: the config's); a comma-separated list runs each in turn, after "
        "one another for every --cohort value, one JSON line each",
    )
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override, as felix run"
    )
    ap.add_argument(
        "--bare-repeats",
        type=int,
        default=2,
        help="the bare loop's time is the best of this many (per chunk when interleaved)",
    )
    ap.add_argument(
        "--bare-threads",
        type=int,
        metavar="N",
        help="torch threads for the bare loop (default: the run's run.threads); e.g. 1 to set a run "
        "on two threads against the bare loop on one",
    )
    ap.add_argument(
        "--bare-fast-pool",
        action="store_true",
        help="the bare loop keeps felix's channels-last max pool (default: torch's nn.MaxPool2d)",
    )
    ap.add_argument(
        "--bare-evaluate",
        action="store_true",
        help="the bare loop also does the run's global evaluations and eval tasks, reported as a "
        "second ratio (ratio_to_bare_with_eval) beside ratio_to_bare",
    )
    ap.add_argument(
        "--interleave",
        type=int,
        default=10,
        metavar="N",
        help="run a chunk of the bare loop after every N aggregations of the run (0: the whole "
        "bare loop after the run)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the run and its bare loop this many times and report the median round",
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
    ap.add_argument(
        "--profile",
        metavar="FILE",
        help="after the timed runs, profile one more run (of the first --cohort value) with "
        "torch.profiler and write its operator table to FILE",
    )
    ap.add_argument("--profile-aggregations", type=int, default=20, help="aggregations of the profiled run")
    ap.add_argument(
        "--busy", type=int, default=0, metavar="N", help="processes keeping a core busy meanwhile"
    )
    args = ap.parse_args(argv)
    if args.busy < 0:
        ap.error("--busy must be 0 or more")
    if args.rounds < 1 or args.bare_repeats < 1:
        ap.error("--rounds and --bare-repeats must be at least 1")
    if args.bare_threads is not None and args.bare_threads < 1:
        ap.error("--bare-threads must be at least 1")
    if args.interleave < 0:
        ap.error("--interleave must be 0 or more")
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
    workers: list[int | None] = [int(w) for w in args.workers.split(",")] if args.workers else [None]
    with busy_cores(args.busy):
        for cohort, n in zip(cohorts, aggs):
            for w in workers:
                report({**engine(args, n, cohort, w), "busy": args.busy}, args.json)
    if args.profile:
        profile(args, args.profile_aggregations, cohorts[0], args.profile)
    return 0


@contextmanager
def busy_cores(n: int) -> Iterator[None]:
    """``n`` processes spinning in a Python loop while the block runs (other work on the cores)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


def report(res: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(res), flush=True)
    else:
        for k, v in res.items():
            print(f"{k:>24}: {v}")
        print(flush=True)


if __name__ == "__main__":
    sys.exit(main())
