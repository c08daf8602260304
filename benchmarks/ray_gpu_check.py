"""GPU check of the Ray backend (needs a CUDA machine with felix-fl[ray] and a CUDA torch):
runs whose ``run.device`` is ``cuda`` ask Ray for a GPU share, ``--gpus-per-run 0.5`` puts two on
one GPU at once, and each run sees its assigned GPU as ``cuda``.

Run: ``PYTHONPATH=src python benchmarks/ray_gpu_check.py [--runs 4] [--gpus-per-run 0.5]``

Prints, per run, the GPU ids Ray assigned, ``CUDA_VISIBLE_DEVICES``, the device the run trained on
and its start/end time; then how many runs overlapped on one GPU, and whether every summary equals
the same run done in this process on ``cuda`` (apart from wall time; GPU kernels may not be
bit-reproducible, in which case the largest accuracy difference is printed).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from felix.engine.setup import resolve_config
from felix.experiments.runs import InlineBackend, RunOutput, RunSpec, execute, run_all


def traced(spec: RunSpec) -> RunOutput:
    import ray
    import torch

    t0 = time.time()
    out = execute(spec)
    out.summary["_trace"] = {
        "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        "t0": t0,
        "t1": time.time(),
        "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "device": spec.config.run.device,
        "torch_sees": torch.cuda.device_count(),
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--gpus-per-run", type=float, default=0.5)
    args = ap.parse_args()
    import ray

    from felix.distributed.ray_runtime import start_local
    from felix.experiments.ray_backend import RayTaskBackend

    with tempfile.TemporaryDirectory() as tmp:

        def specs(root: str) -> list[RunSpec]:
            return [
                RunSpec(
                    f"s{seed}",
                    resolve_config(
                        None,
                        "fedbuff",
                        {
                            "seed": seed,
                            "partition": {"num_clients": 50},
                            "run": {"device": "cuda", "max_aggregations": 30, "stop_at_target": False},
                        },
                    ),
                    Path(tmp) / root / f"s{seed}",
                )
                for seed in range(args.runs)
            ]

        start_local()
        print("cluster:", ray.cluster_resources())
        backend = RayTaskBackend(gpus_per_run=args.gpus_per_run, fn=traced)
        par = run_all(specs("ray"), backend)
        backend.close()
        ray.shutdown()
        seq = run_all(specs("local"), InlineBackend())
    assert not par.failed, par.failed
    spans = []
    for k, o in par.outputs.items():
        tr = o.summary.pop("_trace")
        spans.append((tr["t0"], tr["t1"]))
        print(k, tr)
    overlap = max(sum(a0 < b1 and b0 < a1 for b0, b1 in spans) for a0, a1 in spans)
    print(f"most runs at once: {overlap} (expected {min(args.runs, int(1 / args.gpus_per_run))} per GPU)")
    diffs = []
    for k in seq.outputs:
        a = {x: v for x, v in par.outputs[k].summary.items() if x != "wall_time_s"}
        b = {x: v for x, v in seq.outputs[k].summary.items() if x != "wall_time_s"}
        diffs.append((a == b, abs(a["final_accuracy"] - b["final_accuracy"])))
    print(
        "summaries identical to the in-process cuda runs:",
        [d[0] for d in diffs],
        "largest final-accuracy difference:",
        max(d[1] for d in diffs),
    )


if __name__ == "__main__":
    main()
