"""The Flower path's cost and learning curve against felix's own trainer (docs/flower.md).

    python benchmarks/flower_speed.py [--repeats 3] [--aggregations 60] [--busy-core] [--workload steps1-2]
        [--seeds 0 1 2] [--json FILE]
    python benchmarks/flower_speed.py --overhead 2000 [--repeats 5]
    python benchmarks/flower_speed.py --breakdown [--repeats 5] [--aggregations 20]

Speed, on the same updates: the default scenario (digits, 90% slotted churn; 100 clients of one
or two SGD steps per task, and 20 clients x 5 local epochs, about 25 steps) with the fedbuff
preset, one client at a time on every side (``run.cohort: 1``; the Flower path trains one message
at a time), run with felix's ``LocalTrainer`` and with two Flower ``ClientApp`` s whose train
handler computes felix's updates: ``felix_loop`` in the quickstart's pattern (a new network per
message, ``load_state_dict``, the loop written out in the handler (``local_loop``), Flower's
``ArrayRecord(model.state_dict())`` as the reply: the user's own code) and ``felix_loop_lean``
(felix's helpers: one network per process, the message's model copied into it and felix's own
local loop run on it by ``felix.flower.helpers.local_train``, whose content is the reply).
All runs give the same evaluations (checked), so the difference is the Flower path's cost: felix's
part (the model as an ``ArrayRecord`` and back, the messages, the reply's checks; reported as the
time outside the handler) and the handler's own fixed cost per message. The sides alternate in
one process, ``--repeats`` times each; reported: min and median of the time inside the trainer,
inside the handler, of the whole run's wall time and of its CPU time, and the ratios (Flower /
felix), with the load average before and after (the timings are of a shared machine);
``--busy-core`` keeps a second process looping meanwhile.

``--overhead TASKS``: the Flower path's own cost per task alone (``overhead``: no training, an app
that echoes the received arrays), CPU time per task.

``--breakdown``: where a task's CPU time goes (``breakdown``), felix's trainer against the Flower
path with each handler, on the same recorded tasks of the default scenario.

Learning curve: the Flower quickstart app of docs/flower_example.py (its own DataLoader order, so
other updates) against felix's trainer over ``--seeds``: final accuracy and virtual time to the
``--targets`` (felix's rule: the mean of the last 5 evaluations and the last one), mean
and spread.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from felix import api
from felix.flower import client_data
from felix.metrics.provenance import provenance
from felix.metrics.recorder import reached_target

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "docs")]  # flower_speed:felix_loop, flower_example:app
from flower_example import Net

#: Seconds spent inside the handlers below, by app (the benchmark reads and resets it per run).
HANDLER_S: dict[str, float] = {}


def _timed(
    name: str,
) -> Callable[[Callable[[Message, Context], Message]], Callable[[Message, Context], Message]]:
    """The handler, its wall time added to ``HANDLER_S[name]``: the Flower path's time outside
    it is felix's (the message, the dispatch, the reply's checks)."""

    def wrap(handler: Callable[[Message, Context], Message]) -> Callable[[Message, Context], Message]:
        @functools.wraps(handler)
        def timed(msg: Message, context: Context) -> Message:
            t0 = time.perf_counter()
            try:
                return handler(msg, context)
            finally:
                HANDLER_S[name] = HANDLER_S.get(name, 0.0) + time.perf_counter() - t0

        return timed

    return wrap


def local_loop(model: torch.nn.Module, msg: Message, context: Context) -> MetricRecord:
    """felix's local loop (SGD, batch order from the task's seed, Oort's utility) on ``model``,
    as loaded with the received weights: what both handlers below run."""
    config = msg.content["config"]
    data = client_data(context)
    assert data is not None
    x, y = data
    n, bs = len(y), int(config["batch-size"])
    opt = torch.optim.SGD(model.parameters(), lr=float(config["lr"]))
    gen = torch.Generator().manual_seed(int(config["seed"]))
    sq_sum = loss_sum = torch.zeros(())
    seen = batches = 0
    model.train()
    for epoch in range(int(config["local-epochs"])):
        order = torch.randperm(n, generator=gen)
        for start in range(0, n, bs):
            idx = order[start : start + bs]
            per = F.cross_entropy(model(x[idx]), y[idx], reduction="none")
            if epoch == 0:
                sq_sum = sq_sum + per.detach().square().sum()
                seen += len(idx)
            loss = per.mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum = loss_sum + loss.detach()
            batches += 1
    return MetricRecord(
        {
            "num-examples": n,
            "train_loss": float(loss_sum) / max(batches, 1),
            "stat-utility": n * (float(sq_sum) / seen) ** 0.5 if seen else 0.0,
        }
    )


felix_loop = ClientApp()


@felix_loop.train()
@_timed("felix_loop")
def train(msg: Message, context: Context) -> Message:
    """felix's local loop in the quickstart's pattern: a new network per message, loaded from
    the message, and Flower's ``ArrayRecord(model.state_dict())`` as the reply."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    metrics = local_loop(model, msg, context)
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)


felix_loop_lean = ClientApp()
#: ``felix_loop_lean``'s network, built once per process (every message loads all its weights).
_NET: list[Net] = []


@felix_loop_lean.train()
@_timed("felix_loop_lean")
def train_lean(msg: Message, context: Context) -> Message:
    """The same updates through felix's helpers: one network per process, the message's weights
    copied into it (``load_arrays``) and felix's own local loop on it (``local_train``, the loop
    felix's trainer runs), whose content (the ``state_dict`` through ``state_dict_record``, the
    metrics) is the reply."""
    from felix.flower.helpers import local_train  # here: --overhead runs on checkouts without it

    if not _NET:
        _NET.append(Net())
    return Message(local_train(msg, context, _NET[0]), reply_to=msg)


echo = ClientApp()
#: CPU seconds inside ``echo``'s handler (``overhead`` reads and resets it).
ECHO_CPU_S = [0.0]


@echo.train()
def train_echo(msg: Message, context: Context) -> Message:
    """No training: the received arrays back as plain Flower ``Array`` s (as a handler's own
    record holds them) with fixed metrics, so a task's time is the Flower path's own."""
    t0 = time.process_time()
    arrays = ArrayRecord(dict(msg.content["arrays"].items()))  # Flower copies them into plain Arrays
    metrics = MetricRecord({"num-examples": 16, "train_loss": 0.0})
    reply = Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)
    ECHO_CPU_S[0] += time.process_time() - t0
    return reply


def overhead(tasks: int, repeats: int) -> dict[str, Any]:
    """The Flower path's own cost per task, without training: ``FlowerTrainer`` over ``echo``
    on the quickstart's ``Net`` (8 tensors), ``tasks`` tasks per repeat, CPU time per task
    (the whole ``train`` call, and the part outside the handler: felix's), min and median
    over the repeats. Runs on any felix checkout with the Flower trainer (``PYTHONPATH``)."""
    from felix.client.trainer import ClientData, TrainConfig
    from felix.client.weights import model_vector
    from felix.flower.trainer import CLIENT_KEY, FlowerTrainer
    from felix.strategies.objectives import make_objective

    trainer = FlowerTrainer(
        echo, "flower_speed:echo", Net(), make_objective("ce"), TrainConfig(), 10, 100, {}
    )
    weights = model_vector(Net())
    data = ClientData(torch.zeros(16, 1, 8, 8), torch.zeros(16, dtype=torch.long))
    gen = torch.Generator().manual_seed(0)
    total: list[float] = []
    outside: list[float] = []
    for _ in range(repeats + 1):  # the first: warm-up, not reported
        ECHO_CPU_S[0] = 0.0
        t0 = time.process_time()
        for i in range(tasks):
            upd = trainer.train(weights, data, {CLIENT_KEY: i % 100}, {}, gen)
        spent = time.process_time() - t0
        assert not upd.delta.any()
        total.append(spent / tasks * 1e6)
        outside.append((spent - ECHO_CPU_S[0]) / tasks * 1e6)

    def stats(v: list[float]) -> dict[str, Any]:
        return {
            "min": round(min(v), 1),
            "median": round(statistics.median(v), 1),
            "all": [round(x, 1) for x in v],
        }

    return {
        "what": "overhead",
        "tasks": tasks,
        "repeats": repeats,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "cpu_us_per_task": stats(total[1:]),
        "outside_handler_cpu_us_per_task": stats(outside[1:]),
    }


def breakdown(repeats: int, aggregations: int) -> dict[str, Any]:
    """Where a task's time goes, felix's trainer against the Flower path, on the same tasks: the
    default scenario's (recorded from a felix run of ``aggregations`` aggregations), replayed
    through felix's ``LocalTrainer`` and through ``FlowerTrainer`` over each app; CPU time per
    task, min and median over ``repeats`` replays, of the whole ``train`` call and of its steps
    (the functions named, timed where they are called from: each costs a timer call, well under
    a microsecond; a recursive call counts once). The quickstart handler's steps are its calls
    (a new network, ``to_torch_state_dict``, ``load_state_dict``, the loop, ``state_dict``, the
    reply's ``ArrayRecord`` and ``Message``), the lean handler's ``local_train``'s (the load, the
    objective's setup, felix's local loop, the reply's record) and its ``Message``; felix's part
    is the time outside the handler."""
    import flower_speed as bench  # the apps' module as felix imports them (flower_speed:...)

    import felix.client.trainer as trainer_mod
    from felix.flower import helpers
    from felix.flower.trainer import CLIENT_KEY

    tasks: list[tuple[Any, Any, int]] = []
    built = api.build(_config(aggregations, 0, None, False))
    own = built.sim.trainer
    record = own.train

    def recording(weights: Any, data: Any, state: Any, aux: Any, gen: torch.Generator) -> Any:
        tasks.append((weights.copy(), data, gen.initial_seed()))
        return record(weights, data, state, aux, gen)

    own.train = recording
    built.sim.run()
    del own.train  # the class's method again
    sides = {"felix": own}
    for side, app in APPS.items():
        sides[side] = api.build(_config(1, 0, app, False)).sim.trainer

    steps: dict[str, float] = {}
    reply = (bench, "Message", "the reply Message (the handler's)")
    timed: dict[str, list[tuple[Any, str, str]]] = {  # (module or class, attribute, step)
        "felix": [(trainer_mod, "local_loop", "felix's local loop")],
        "flower": [
            (bench, "Net", "a new network (Net())"),
            (ArrayRecord, "to_torch_state_dict", "the message's arrays as tensors (to_torch_state_dict)"),
            (torch.nn.Module, "load_state_dict", "load_state_dict"),
            (bench, "local_loop", "the benchmark's local loop"),
            (torch.nn.Module, "state_dict", "model.state_dict()"),
            (ArrayRecord, "__init__", "ArrayRecord(state_dict) (the reply's arrays)"),
            reply,
        ],
        "flower_lean": [
            (helpers, "local_train", "local_train"),
            (helpers, "_load", "load_arrays (the message's model into the kept network)"),
            (helpers, "_objective", "the objective's setup (felix's objective, its hooks)"),
            (helpers, "local_loop", "felix's local loop"),
            (helpers, "_record_of", "the reply's ArrayRecord"),
            reply,
        ],
    }

    def wrapped(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        depth = [0]  # a recursive call (state_dict's of the submodules) is in its caller's time

        def timing(*args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            t0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    steps[label] = steps.get(label, 0.0) + time.process_time() - t0

        return timing

    out: dict[str, Any] = {"what": "breakdown", "tasks": len(tasks), "repeats": repeats}
    for side, trainer in sides.items():
        originals = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in timed[side]]
        for (owner, attr, label), (_, _, orig) in zip(timed[side], originals):
            setattr(owner, attr, wrapped(orig, label))
        app = trainer.app if side != "felix" else None
        if app is not None:  # the handler's own time: the rest of the task's is felix's part
            handler_key = next(iter(app._registered_funcs))
            handler = app._registered_funcs[handler_key]
            app._registered_funcs[handler_key] = wrapped(handler, "the handler")
        totals: list[float] = []
        per: dict[str, list[float]] = {}
        try:
            for rep in range(repeats + 1):  # the first: warm-up, not reported
                steps.clear()
                t0 = time.process_time()
                for i, (weights, data, seed) in enumerate(tasks):
                    trainer.train(
                        weights, data, {CLIENT_KEY: i % 100}, {}, torch.Generator().manual_seed(seed)
                    )
                spent = time.process_time() - t0
                if "the handler" in steps:
                    steps["outside the handler (felix's part)"] = spent - steps["the handler"]
                if rep:
                    totals.append(spent / len(tasks) * 1e6)
                    for name, v in steps.items():
                        per.setdefault(name, []).append(v / len(tasks) * 1e6)
        finally:
            for owner, attr, orig in originals:
                setattr(owner, attr, orig)
            if app is not None:
                app._registered_funcs[handler_key] = handler
        out[side] = {
            "cpu_us_per_task": {"min": round(min(totals), 1), "median": round(statistics.median(totals), 1)},
            "steps_us_per_task": {
                name: {"min": round(min(v), 1), "median": round(statistics.median(v), 1)}
                for name, v in per.items()
            },
        }
    for side in APPS:
        out[f"ratio_min_{side}"] = round(
            out[side]["cpu_us_per_task"]["min"] / out["felix"]["cpu_us_per_task"]["min"], 3
        )
        out[f"ratio_median_{side}"] = round(
            out[side]["cpu_us_per_task"]["median"] / out["felix"]["cpu_us_per_task"]["median"], 3
        )
    out["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    return out


#: The Flower sides of the speed comparison: the app each runs.
APPS = {"flower": "flower_speed:felix_loop", "flower_lean": "flower_speed:felix_loop_lean"}


#: Whether a busy-looping process shared the machine during the speed part (``--busy-core``).
BUSY = [False]

#: The speed workloads: the default scenario's clients take one or two SGD steps per task (the
#: Flower path's fixed cost per task weighs most); 20 clients x 5 local epochs take about 25.
WORKLOADS: dict[str, dict[str, Any]] = {
    "default (100 clients, 1 epoch)": {},
    "20 clients, 5 epochs": {"partition": {"num_clients": 20}, "client": {"epochs": 5}},
}
#: ``--workload``'s names for them.
WORKLOAD_NAMES = {"steps1-2": "default (100 clients, 1 epoch)", "steps25": "20 clients, 5 epochs"}


def _config(
    aggregations: int, seed: int, app: str | None, stop_at_target: bool, over: dict[str, Any] | None = None
) -> dict[str, Any]:
    over = over or {}
    client: dict[str, Any] = {**over.get("client", {}), **({} if app is None else {"flower_app": app})}
    return {
        **{k: v for k, v in over.items() if k != "client"},
        "strategy": "fedbuff",
        "seed": seed,
        "model": "flower_example:make_net",
        "client": client,
        "run": {
            "max_aggregations": aggregations,
            "stop_at_target": stop_at_target,
            "target_accuracy": 0.8,
            "cohort": 1,
            "threads": 1,
        },
    }


def _run(cfg: dict[str, Any]) -> tuple[float, float, float, list[Any]]:
    """One run: the wall seconds inside the trainer and of the whole run, the process's CPU
    seconds over the run (one torch thread: less sensitive than wall time to other work on the
    machine), and the evaluations."""
    built = api.build(cfg)
    cpu = time.process_time()
    out = built.sim.run()
    cpu = time.process_time() - cpu
    return out.train_seconds, out.wall_time_s, cpu, built.recorder.rows


def speed(repeats: int, aggregations: int, workload: str) -> dict[str, Any]:
    # The apps run as felix imports them (``flower_speed:...``): that module's handler times.
    from flower_speed import HANDLER_S as handler_s

    over = WORKLOADS[workload]
    sides = {"felix": None, **APPS}
    train: dict[str, list[float]] = {side: [] for side in sides}
    wall: dict[str, list[float]] = {side: [] for side in sides}
    cpu: dict[str, list[float]] = {side: [] for side in sides}
    handler: dict[str, list[float]] = {side: [] for side in APPS}
    rows: dict[str, Any] = {}
    load = [round(x, 2) for x in os.getloadavg()]
    for app in sides.values():  # warm every path (imports, first optimiser)
        _run(_config(3, 0, app, False, over))
    for _ in range(repeats):
        for side, app in sides.items():
            handler_s.clear()
            t, w, c, r = _run(_config(aggregations, 0, app, False, over))
            train[side].append(t)
            wall[side].append(w)
            cpu[side].append(c)
            if app is not None:
                handler[side].append(handler_s[app.split(":")[1]])
            rows[side] = [(x.version, x.time_s, x.accuracy, x.bytes_total) for x in r]
    same = all(rows[side] == rows["felix"] for side in APPS)

    def stats(d: dict[str, list[float]], ratios: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for side, v in d.items():
            out[side] = {"min": round(min(v), 3), "median": round(statistics.median(v), 3), "all": v}
        if ratios:
            for side in APPS:
                tail = side.removeprefix("flower")
                out[f"ratio_min{tail}"] = round(min(d[side]) / min(d["felix"]), 3)
                out[f"ratio_median{tail}"] = round(
                    statistics.median(d[side]) / statistics.median(d["felix"]), 3
                )
        return out

    # Per aggregation, in milliseconds: inside the trainer and the whole run's wall time.
    per_aggregation = {
        what: {
            side: {
                "min": round(min(v) / aggregations * 1e3, 2),
                "median": round(statistics.median(v) / aggregations * 1e3, 2),
            }
            for side, v in d.items()
        }
        for what, d in (("train", train), ("wall", wall))
    }
    # The Flower path's time outside the handler: felix's own part (message, dispatch, checks).
    outside = {side: [t - h for t, h in zip(train[side], handler[side])] for side in APPS}
    return {
        "what": "speed",
        "workload": workload,
        "aggregations": aggregations,
        "repeats": repeats,
        "busy_core": BUSY[0],
        "loadavg_before": load,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "same_evaluations": same,
        "train_s": stats(train),
        "ms_per_aggregation": per_aggregation,
        "handler_s": stats(handler, ratios=False),
        "outside_handler_s": stats(outside, ratios=False),
        "wall_s": stats(wall),
        "cpu_s": stats(cpu),
    }


def curve(seeds: list[int], aggregations: int, targets: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {"what": "curve", "aggregations": aggregations, "seeds": seeds, "targets": targets}
    for side, app in (("felix", None), ("flower_quickstart", "flower_example:app")):
        finals: list[float] = []
        ttt: dict[float, list[float | None]] = {t: [] for t in targets}
        for seed in seeds:
            _, _, _, rows = _run(_config(aggregations, seed, app, False))
            finals.append(rows[-1].accuracy)
            for t in targets:
                ttt[t].append(_time_to(rows, t))
        out[side] = {
            "final_accuracy": finals,
            "final_mean": round(statistics.mean(finals), 4),
            "final_std": round(statistics.stdev(finals), 4) if len(finals) > 1 else 0.0,
        }
        for t, times in ttt.items():
            reached = [x for x in times if x is not None]
            out[side][f"time_to_{t}_s"] = times
            out[side][f"time_to_{t}_mean"] = round(statistics.mean(reached), 1) if reached else None
            out[side][f"time_to_{t}_std"] = round(statistics.stdev(reached), 1) if len(reached) > 1 else None
    return out


def _time_to(rows: list[Any], target: float, window: int = 5) -> float | None:
    """Virtual seconds to ``target`` by felix's rule (mean of the last ``window`` evaluations and
    the last one at or above it), or None."""
    accs: list[float] = []
    for r in rows:
        accs.append(r.accuracy)
        if reached_target(accs, target, window):
            return float(r.time_s)
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--aggregations", type=int, default=60)
    p.add_argument("--curve-aggregations", type=int, default=150)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--targets", type=float, nargs="+", default=[0.3, 0.4, 0.5])
    p.add_argument("--skip-curve", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument(
        "--busy-core",
        action="store_true",
        help="keep one core busy (a second Python process looping) during the speed part",
    )
    p.add_argument(
        "--overhead",
        type=int,
        metavar="TASKS",
        help="only the Flower path's own cost per task (no training), TASKS tasks per repeat",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="only where a task's CPU time goes, felix's trainer against the Flower path (--repeats replays)",
    )
    p.add_argument(
        "--workload",
        choices=["all", *WORKLOAD_NAMES],
        default="all",
        help="the speed part's workloads: both, or one of them",
    )
    p.add_argument("--json", help="append the results as JSON lines to this file")
    args = p.parse_args()
    torch.set_num_threads(1)
    prov = provenance()  # the code that runs (before any edit of the tree during a long run)
    results = []
    if args.overhead:
        results.append(overhead(args.overhead, args.repeats))
    elif args.breakdown:
        results.append(breakdown(args.repeats, args.aggregations))
    elif not args.skip_speed:
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy_core else None
        BUSY[0] = busy is not None
        try:
            names = (
                WORKLOAD_NAMES if args.workload == "all" else {args.workload: WORKLOAD_NAMES[args.workload]}
            )
            results = [speed(args.repeats, args.aggregations, w) for w in names.values()]
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
    if not args.skip_curve and not args.overhead and not args.breakdown:
        results.append(curve(args.seeds, args.curve_aggregations, args.targets))
    for r in results:
        r["provenance"] = prov
        print(json.dumps(r))
    if args.json:
        with open(args.json, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
