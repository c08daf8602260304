"""Simulator overhead: wall time of a simulated run against the pure local-training compute of the
same client updates, replayed in a bare PyTorch loop (same model, data, seeds, optimiser).

    python benchmarks/overhead.py [--preset fedbuff] [--scenario default] [--aggregations 150] [--eval-every 0]

Aim: ratio under 1.10. Everything the simulator adds (event heap, orchestrator, aggregation,
byte counting, weight copies) is overhead; global-model evaluation is reported separately
through --eval-every (0: only the initial and final model are evaluated).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from felix.engine.setup import resolve_config
from felix.sim.build import build


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="fedbuff")
    ap.add_argument("--scenario", default="default")
    ap.add_argument("--aggregations", type=int, default=150)
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads, as run.threads (default 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    def simulate(aggregations: int):
        cfg = resolve_config(
            None,
            args.preset,
            {
                "run": {
                    "max_aggregations": aggregations,
                    "stop_at_target": False,
                    "eval_every": args.eval_every,
                }
            },
            args.scenario,
        )
        built = build(cfg)
        tasks: list[tuple[int, int, np.ndarray]] = []
        built.sim._on_train = lambda dev, task: tasks.append((dev.cid, task.task_id, task.weights))
        return cfg, built, built.sim.run(), tasks

    simulate(5)  # warm-up: first-call costs of torch and the allocator are not the simulator's
    cfg, built, out, tasks = simulate(args.aggregations)
    sim_wall = out.wall_time_s

    # The same updates in a bare loop: load weights, SGD over the client's batches, take the delta.
    datas = built.population.client_data
    model = built.sim.trainer.model
    params = list(model.parameters())
    c = cfg.client

    def replay() -> float:
        t0 = time.perf_counter()
        for cid, task_id, weights in tasks:
            flat = torch.from_numpy(np.array(weights))
            vector_to_parameters(flat.clone(), params)
            opt = torch.optim.SGD(params, lr=c.lr)
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + task_id)
            x, y = datas[cid].x, datas[cid].y
            for _ in range(c.epochs):
                order = torch.randperm(len(y), generator=gen)
                for s in range(0, len(y), c.batch_size):
                    idx = order[s : s + c.batch_size]
                    loss = F.cross_entropy(model(x[idx]), y[idx])
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
            _ = (parameters_to_vector(params) - flat).detach().numpy()
        return time.perf_counter() - t0

    bare = min(replay(), replay())
    print(
        f"scenario {cfg.name}, strategy {cfg.strategy}: {len(tasks)} client updates, "
        f"{built.orch.version} aggregations, {out.virtual_time_s:.0f} virtual s"
    )
    print(f"simulator wall {sim_wall:.2f} s (of which inside local training {out.train_seconds:.2f} s)")
    print(f"bare PyTorch loop {bare:.2f} s")
    print(f"ratio simulator / bare = {sim_wall / bare:.3f}")


if __name__ == "__main__":
    main()
