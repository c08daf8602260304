"""Peak memory of a run built from the Python API (``felix.api``) against a bare PyTorch loop doing
the same number of client updates on the same data, each in a fresh process (peak RSS, ``ru_maxrss``).

    python benchmarks/memory.py [--layout pairs|slices] [--clients 300] [--aggregations 40] [--repeats 3] [--json]

Both processes load Fashion-MNIST, split its 60,000 training samples over ``--clients`` clients
and hold the clients' data the same way for the whole run: ``pairs``, one ``(x, y)`` copy per
client (``x[idx]``); ``slices``, one client-ordered tensor whose row slices are the clients. The
felix process passes them to ``api.population`` and runs FedBuff (sequential or cohort training
as ``run.cohort: auto`` picks) until ``--aggregations``; the bare process then trains as many client
updates (load the global weights, one epoch of SGD over the client's batches, FedAvg every 10) with
the same model. Aim: felix's peak at most 1.2x the bare loop's. The population's data is held
once: a ``pairs`` population is concatenated into one pool once (a copy, the only one), a
``slices`` population is taken as it is.
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

MB = 1024.0  # ru_maxrss is in KiB on Linux


def _data(layout: str, clients: int) -> tuple[Any, Any, list[tuple[Any, Any]]]:
    import numpy as np
    import torch

    from felix.scenario.datasets import load_dataset

    train, test = load_dataset("fashion_mnist")
    assert test is not None
    parts = np.array_split(np.random.default_rng(0).permutation(len(train)), clients)
    if layout == "pairs":
        pairs = [(train.x[torch.as_tensor(ix)], train.y[torch.as_tensor(ix)]) for ix in parts]
    else:
        order = torch.as_tensor(np.concatenate(parts))
        xs, ys = train.x.index_select(0, order), train.y.index_select(0, order)
        ends = np.cumsum([len(ix) for ix in parts]).tolist()
        pairs = [(xs[a:b], ys[a:b]) for a, b in zip([0, *ends[:-1]], ends, strict=True)]
    return train, test, pairs


def _net(shape: tuple[int, ...], classes: int) -> Any:
    from torch import nn

    n = 1
    for s in shape:
        n *= s
    return nn.Sequential(nn.Flatten(), nn.Linear(n, 64), nn.ReLU(), nn.Linear(64, classes))


def child_felix(layout: str, clients: int, aggregations: int) -> dict[str, Any]:
    import torch

    from felix import api

    torch.manual_seed(0)
    train, test, pairs = _data(layout, clients)
    t0 = time.perf_counter()
    result = api.run(
        {
            "strategy": "fedbuff",
            "trace": {"kind": "always"},
            "client": {"lr": 0.04, "batch_size": 32, "epochs": 1},
            "run": {"max_aggregations": aggregations, "eval_every": 0, "stop_at_target": False, "threads": 1},
        },
        population=api.population(pairs, test=(test.x, test.y), classes=train.classes),
        model=_net,
    )
    s = result.summary
    return {
        "updates": int(s["updates_applied"]) + int(s["updates_discarded"]),
        "final_accuracy": s["final_accuracy"],
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def child_bare(layout: str, clients: int, updates: int) -> dict[str, Any]:
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    torch.set_num_threads(1)
    torch.manual_seed(0)
    train, test, pairs = _data(layout, clients)
    model = _net(tuple(train.x.shape[1:]), len(train.classes))
    params = list(model.parameters())
    global_w = parameters_to_vector(params).detach().clone()
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    buffer: list[torch.Tensor] = []
    for _ in range(updates):
        x, y = pairs[int(rng.integers(len(pairs)))]
        vector_to_parameters(global_w, params)
        opt = torch.optim.SGD(params, lr=0.04)
        perm = torch.randperm(len(y))
        for s in range(0, len(y), 32):
            ix = perm[s : s + 32]
            opt.zero_grad()
            F.cross_entropy(model(x[ix]), y[ix]).backward()
            opt.step()
        buffer.append(parameters_to_vector(params).detach() - global_w)
        if len(buffer) == 10:
            global_w = global_w + torch.stack(buffer).mean(0)
            buffer = []
    vector_to_parameters(global_w, params)
    with torch.no_grad():
        acc = float((model(test.x).argmax(1) == test.y).float().mean())
    return {"updates": updates, "final_accuracy": round(acc, 4), "wall_s": round(time.perf_counter() - t0, 2)}


def _run_child(args: list[str]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, *args], check=True, capture_output=True, text=True
    ).stdout.strip()
    return dict(json.loads(out.splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", choices=["pairs", "slices"], default="pairs")
    ap.add_argument("--clients", type=int, default=300)
    ap.add_argument("--aggregations", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON line with every repeat and provenance")
    ap.add_argument("--child", choices=["felix", "bare"], help=argparse.SUPPRESS)
    ap.add_argument("--updates", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        if args.child == "felix":
            res = child_felix(args.layout, args.clients, args.aggregations)
        else:
            res = child_bare(args.layout, args.clients, args.updates)
        res["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / MB, 1)
        print(json.dumps(res))
        return
    common = ["--layout", args.layout, "--clients", str(args.clients)]
    runs = []
    for k in range(args.repeats):
        felix = _run_child([*common, "--child", "felix", "--aggregations", str(args.aggregations)])
        bare = _run_child([*common, "--child", "bare", "--updates", str(felix["updates"])])
        ratio = felix["peak_rss_mb"] / bare["peak_rss_mb"]
        runs.append({"repeat": k + 1, "felix": felix, "bare": bare, "ratio": round(ratio, 3)})
        if not args.json:
            print(
                f"repeat {k + 1}: felix {felix['peak_rss_mb']:.0f} MB ({felix['updates']} updates), "
                f"bare loop {bare['peak_rss_mb']:.0f} MB: {ratio:.3f}x"
            )
    ratios = [r["ratio"] for r in runs]
    felix_mb = [r["felix"]["peak_rss_mb"] for r in runs]
    bare_mb = [r["bare"]["peak_rss_mb"] for r in runs]
    figures = {
        "ratio_min": min(ratios),
        "ratio_median": statistics.median(ratios),
        "ratio_max": max(ratios),
        "felix_mb_min": min(felix_mb),
        "felix_mb_median": statistics.median(felix_mb),
        "bare_mb_min": min(bare_mb),
        "bare_mb_median": statistics.median(bare_mb),
    }
    if args.json:
        from felix.metrics.provenance import provenance

        prov = provenance()
        print(
            json.dumps(
                {
                    "what": f"peak RSS of felix.api against a bare PyTorch loop, {args.layout} layout",
                    "command": "python benchmarks/memory.py " + " ".join(sys.argv[1:]),
                    "clients": args.clients,
                    "aggregations": args.aggregations,
                    **figures,
                    "runs": runs,
                    "provenance": {k: prov.get(k) for k in ("git", "torch", "cpu", "python", "machine")},
                    "platform": platform.system(),
                }
            )
        )
    else:
        print(
            f"felix / bare peak RSS: min {figures['ratio_min']:.3f}x, median {figures['ratio_median']:.3f}x "
            f"(felix {figures['felix_mb_median']:.0f} MB, bare {figures['bare_mb_median']:.0f} MB, medians)"
        )


if __name__ == "__main__":
    main()
