"""How far a client update moves when its start weights move by float noise: the yardstick for
cohort-against-sequential differences (benchmarks/gpu_check.sh, tests/test_cohort.py).

    python benchmarks/start_sensitivity.py [--client 4] [--draws 8]

Trains one of gpu_check.sh's clients alone (the sequential trainer, the FeLiX CNN) from the
model's initial weights, then from those weights times ``1 + 1e-7 * N(0, 1)`` (about one float32
ulp) for each draw, and prints each draw's relative L2 difference of the update. gpu_check.sh's
data: eight clients of 5, 40, 333, 64, 1000, 17, 250 and 96 random 3x32x32 inputs with random
labels, drawn in that order; lr 0.04, batch 32 with drop_last; client 4 (1,000 samples) takes 31
steps. Where a draw moves the
update by a lot, a cohort's ulp-level differences (another convolution kernel for a stack of
clients) can move it as much: the problem is chaotic there, not the engine wrong.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import numpy as np
import torch
from torch.nn.utils import parameters_to_vector

from felix.client.trainer import ClientData, LocalTrainer, TrainConfig
from felix.scenario.models import make_model
from felix.strategies.objectives import make_objective

SIZES = [5, 40, 333, 64, 1000, 17, 250, 96]  # gpu_check.sh's clients, drawn in this order


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--client", type=int, default=4, help="which of gpu_check.sh's eight clients")
    ap.add_argument("--draws", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    shape = (3, 32, 32)
    model = make_model("felix_cnn", shape, 10, seed=1)
    w0 = parameters_to_vector(model.parameters()).detach().numpy()
    g = torch.Generator().manual_seed(0)
    datas = [
        ClientData(torch.randn(n, *shape, generator=g), torch.randint(0, 10, (n,), generator=g))
        for n in SIZES
    ]
    data, seed = datas[args.client], args.client
    cfg = TrainConfig(lr=0.04, batch_size=32, drop_last=True)
    trainer = LocalTrainer(copy.deepcopy(model), make_objective("ce"), cfg, 10, args.device)
    base = trainer.train(w0, data, {}, {}, torch.Generator().manual_seed(seed)).delta
    assert base is not None
    rel = []
    for draw in range(args.draws):
        rng = np.random.default_rng(draw)
        w1 = (w0 * (1 + 1e-7 * rng.standard_normal(w0.size))).astype(np.float32)
        moved = trainer.train(w1, data, {}, {}, torch.Generator().manual_seed(seed)).delta
        assert moved is not None
        rel.append(float(np.linalg.norm(base - moved) / np.linalg.norm(base)))
    n = len(data)
    print(json.dumps({"client": args.client, "samples": n, "steps": n // cfg.batch_size, "relative_l2": rel}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
