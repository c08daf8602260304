"""One cohort step's gradient call: the stacked-chain kernel against functorch's vmap(grad(...)).

    python benchmarks/chain_kernel.py [--device cuda] [--repeats 30] [--json]

For each model (the MLP on Fashion-MNIST shapes, the small CNN on digits and Fashion-MNIST shapes,
the FeLiX CNN on CIFAR-10 shapes, and a two-channel copy of the FeLiX CNN on 22x22 inputs whose
arithmetic is negligible, so that its time is about the per-call fixed cost a GPU step pays) and number of clients K:
``CohortTrainer.grad`` on one stacked batch per client (32 samples, 4 for the thin CNN; the plain
objective, half of the last client's batch masked), timed with the kernel and with vmap alternately; min and median milliseconds per
call, and whether the two gave the same bits. One thread on a CPU (``--threads``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any
from unittest import mock

import torch
from torch import nn

from felix.client.cohort import CohortTrainer
from felix.client.trainer import TrainConfig
from felix.metrics.provenance import provenance
from felix.scenario.models import make_model
from felix.strategies.objectives import make_objective


def thin_felix_cnn(num_classes: int = 10) -> nn.Module:
    """The FeLiX CNN's layers (three unpadded 3x3 convolutions and 2x2 pools, three linear layers)
    with two channels each, for 22x22 inputs: the same operations, almost no arithmetic."""
    c = 2
    return nn.Sequential(
        nn.Conv2d(3, c, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c, c, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c, c, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(c, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, num_classes),
    )  # fmt: skip


# model, one sample's shape, batch per client, numbers of clients
CASES: list[tuple[str, tuple[int, ...], int, list[int]]] = [
    ("mlp", (1, 28, 28), 32, [10, 30]),
    ("small_cnn", (1, 8, 8), 32, [10, 30]),
    ("small_cnn", (1, 28, 28), 32, [10]),
    ("felix_cnn_thin", (3, 22, 22), 4, [10, 30]),
    ("felix_cnn", (3, 32, 32), 32, [3, 10]),
]


def measure(
    name: str, shape: tuple[int, ...], batch: int, k: int, device: str, repeats: int
) -> dict[str, Any]:
    model = thin_felix_cnn() if name == "felix_cnn_thin" else make_model(name, shape, 10, seed=1)
    cfg = TrainConfig(lr=0.04, batch_size=batch)
    kernel = CohortTrainer(model, make_objective("ce"), cfg, 10, device, sample_shape=shape)
    with mock.patch("felix.client.cohort.StackedChain.of", return_value=None):
        plain = CohortTrainer(model, make_objective("ce"), cfg, 10, device)
    gen = torch.Generator().manual_seed(0)
    params = {
        n: (p.detach().cpu().unsqueeze(0) + 0.01 * torch.randn(k, *p.shape, generator=gen)).to(device)
        for n, p in model.named_parameters()
    }
    x = torch.randn(k, batch, *shape, generator=gen).to(device)
    y = torch.randint(0, 10, (k, batch), generator=gen).to(device)
    mask = torch.ones(k, batch)
    mask[-1, batch // 2 :] = 0
    mask = mask.to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def call(tr: CohortTrainer) -> tuple[dict[str, torch.Tensor], Any]:
        return tr.grad(params, x, y, mask, {})  # type: ignore[no-any-return]

    times: dict[str, list[float]] = {"kernel": [], "vmap": []}
    for _ in range(repeats + 2):  # the first two rounds warm up (allocator, first launches)
        for label, tr in (("kernel", kernel), ("vmap", plain)):
            sync()
            t0 = time.perf_counter()
            call(tr)
            sync()
            times[label].append((time.perf_counter() - t0) * 1e3)
    (gk, ak), (gv, av) = call(kernel), call(plain)
    same = all(torch.equal(gk[n], gv[n]) for n in gv) and all(torch.equal(a, b) for a, b in zip(ak, av))
    out: dict[str, Any] = {"model": name, "sample_shape": list(shape), "clients": k, "batch": batch}
    out["kernel_applies"] = kernel.chain is not None
    out["bit_identical"] = same
    for label, ts in times.items():
        out[f"{label}_ms_min"] = round(min(ts[2:]), 3)
        out[f"{label}_ms_median"] = round(statistics.median(ts[2:]), 3)
    out["vmap_over_kernel_median"] = round(out["vmap_ms_median"] / out["kernel_ms_median"], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="JSON lines (with provenance) instead of a table")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    prov = provenance()
    for name, shape, batch, ks in CASES:
        for k in ks:
            res = measure(name, shape, batch, k, args.device, args.repeats)
            if args.json:
                print(json.dumps({**res, "device": args.device, "threads": args.threads, "provenance": prov}))
            else:
                print(
                    f"{name:>15} {'x'.join(map(str, shape)):>8} K={k:<3} kernel {res['kernel_ms_median']:8.2f} ms"
                    f"  vmap {res['vmap_ms_median']:8.2f} ms  ({res['vmap_over_kernel_median']}x)"
                    f"  bit-identical {res['bit_identical']}"
                )
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
