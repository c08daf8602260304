"""Secure aggregation's cost beside plaintext and beside Flower's SecAgg+ (docs/privacy.md).

    python benchmarks/secagg_speed.py [--groups 10 100 1000] [--models digits_mlp fmnist_mlp cifar_cnn]
        [--flower-clients 8] [--json FILE]

For each model (felix's digits MLP, Fashion-MNIST MLP and the 537k-parameter CIFAR CNN, as flat
updates of their parameter count) and group size n, one group of n members with a SecAgg+ graph of
``k`` share holders (n itself up to 10, else 2 ceil(log2 n) + 1: 15 at 100, 21 at 1,000), threshold
a strict majority of k, clipping range 8, 2^22 levels, modulus 2^32, no dropouts:

- felix (``felix.secagg``): the whole group run through ``felix.secagg.session.run_group``, every
  message encoded; CPU time (``time.process_time``) of the members' work per member (setup, keys,
  shares, masking, unmask answer) and of the server's work (validating and summing the masked
  vectors, rebuilding the seeds, removing the masks), and the bytes each member sends and
  receives against the plaintext update (4 bytes a parameter);
- Flower's SecAgg+ (``flwr`` 1.42): the same steps with the functions its ``secaggplus_mod`` and
  ``SecAggPlusWorkflow`` call (EC key pairs, pycryptodome Shamir, Fernet, numpy ``RandomState``
  masks, int64 arithmetic), in one process without Flower's messaging: the members' steps of
  ``--flower-clients`` members are timed (their mean is reported per member), and the server's
  unmasking of all n members (n masked vectors summed, n seeds rebuilt from k shares, n masks
  removed) is timed whole; bytes are the payloads' own bytes (the keys, ciphertexts, the masked
  arrays as Flower serialises them, the shares), without Flower's message envelope.

The machine's load is shared: each figure is one measurement; the load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from felix.metrics.provenance import provenance
from felix.secagg.graph import GroupLayout
from felix.secagg.quantize import Quantizer
from felix.secagg.session import run_group

#: model -> (sample shape, model factory name) as felix builds it (felix.scenario.models).
MODELS = {
    "digits_mlp": ((1, 8, 8), "mlp"),
    "fmnist_mlp": ((1, 28, 28), "mlp"),
    "cifar_cnn": ((3, 32, 32), "felix_cnn"),
}
CLIP, QBITS, MBITS, MAX_WEIGHT = 8.0, 22, 32, 1000.0


def shapes(model: str) -> list[tuple[int, ...]]:
    from felix.scenario.models import make_model

    sample, name = MODELS[model]
    net = make_model(name, sample, 10)
    return [tuple(p.shape) for p in net.parameters()]


def degree(n: int) -> int:
    return n if n <= 10 else 2 * math.ceil(math.log2(n)) + 1


def felix_group(length: int, n: int, rng: np.random.Generator) -> dict[str, Any]:
    k = degree(n)
    layout = GroupLayout(1, tuple(range(n)), k, k // 2 + 1)
    delta = rng.normal(0, 0.01, length).astype(np.float32)
    updates = {m: (0.06, delta) for m in layout.members}
    t0 = time.perf_counter()
    server, traffic = run_group(layout, Quantizer(CLIP, QBITS, MBITS), updates, clock=time.process_time)
    wall = time.perf_counter() - t0
    assert server.result is not None and len(server.result.members) == n
    up, down = sum(traffic.up.values()) / n, sum(traffic.down.values()) / n
    return {
        "num_shares": k,
        "threshold": k // 2 + 1,
        "client_cpu_s_per_task": traffic.client_seconds / n,
        "server_cpu_s_per_aggregation": traffic.server_seconds,
        "bytes_up_per_update": up,
        "bytes_down_per_update": down,
        "bytes_ratio_up": up / (4 * length),
        "bytes_ratio_up_down": (up + down) / (4 * length),
        "wall_s": wall,
    }


def flower_group(
    layer_shapes: list[tuple[int, ...]], n: int, sample: int, rng: np.random.Generator
) -> dict[str, Any]:
    """Flower's SecAgg+ steps (see the module docstring), as its client mod and workflow run them."""
    from flwr.common import ndarray_to_bytes
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
        decrypt,
        encrypt,
        generate_shared_key,
    )
    from flwr.common.secure_aggregation.ndarrays_arithmetic import (
        factor_combine,
        factor_extract,
        parameters_addition,
        parameters_mod,
        parameters_multiply,
        parameters_subtraction,
    )
    from flwr.common.secure_aggregation.quantization import dequantize, quantize
    from flwr.common.secure_aggregation.secaggplus_utils import (
        pseudo_rand_gen,
        share_keys_plaintext_concat,
        share_keys_plaintext_separate,
    )
    from flwr.supercore.primitives.asymmetric import (
        bytes_to_private_key,
        bytes_to_public_key,
        generate_key_pairs,
        private_key_to_bytes,
        public_key_to_bytes,
    )

    k = degree(n)
    t = k // 2 + 1
    mod_range, target = 1 << MBITS, 1 << QBITS
    params = [rng.normal(0, 0.01, s).astype(np.float32) for s in layer_shapes]
    length = sum(int(np.prod(s)) for s in layer_shapes)
    half = (k - 1) // 2
    ring = list(range(n))

    def neighbours(i: int) -> list[int]:
        if k >= n:
            return ring
        return sorted({(i + d) % n for d in range(-half, half + 1)})

    # every member's keys (the setup stage; timed for the sampled members below)
    keys: dict[int, tuple[bytes, bytes, bytes, bytes]] = {}
    for i in ring:
        sk1, pk1 = generate_key_pairs()
        sk2, pk2 = generate_key_pairs()
        keys[i] = (
            private_key_to_bytes(sk1),
            public_key_to_bytes(pk1),
            private_key_to_bytes(sk2),
            public_key_to_bytes(pk2),
        )

    client_cpu, up_bytes, down_bytes = [], [], []
    masked_one: list[np.ndarray] | None = None
    for i in ring[:sample]:
        c0 = time.process_time()
        sk1, pk1 = generate_key_pairs()  # setup: two key pairs
        sk2, pk2 = generate_key_pairs()
        keys_i = (
            private_key_to_bytes(sk1),
            public_key_to_bytes(pk1),
            private_key_to_bytes(sk2),
            public_key_to_bytes(pk2),
        )
        keys[i] = keys_i
        nbrs = neighbours(i)
        seed = os.urandom(32)  # share keys
        b_shares = create_shares(seed, t, k)
        s_shares = create_shares(keys_i[0], t, k)
        cts, ss2 = {}, {}
        for idx, j in enumerate(nbrs):
            if j == i:
                continue
            ss2[j] = generate_shared_key(bytes_to_private_key(keys_i[2]), bytes_to_public_key(keys[j][3]))
            cts[j] = encrypt(ss2[j], share_keys_plaintext_concat(i, j, b_shares[idx], s_shares[idx]))
        for j, ct in cts.items():  # collect masked vectors: the neighbours' ciphertexts (same size)
            share_keys_plaintext_separate(decrypt(ss2[j], ct))
        ratio = 60 / MAX_WEIGHT
        q_ratio = round(ratio * target)
        q = quantize(parameters_multiply(params, q_ratio / target), CLIP, target)
        q = factor_combine(q_ratio, q)
        dims = [a.shape for a in q]
        q = parameters_addition(q, pseudo_rand_gen(seed, mod_range, dims))
        for j in nbrs:
            if j == i:
                continue
            key = generate_shared_key(bytes_to_private_key(keys_i[0]), bytes_to_public_key(keys[j][1]))
            mask = pseudo_rand_gen(key, mod_range, dims)
            q = parameters_addition(q, mask) if i > j else parameters_subtraction(q, mask)
        q = parameters_mod(q, mod_range)
        payload = [ndarray_to_bytes(a) for a in q]
        client_cpu.append(time.process_time() - c0)
        masked_one = q
        shares_back = [b_shares[0]] * len(nbrs)  # unmask answer: one share per neighbour
        up_bytes.append(
            len(keys_i[1])
            + len(keys_i[3])
            + sum(len(c) for c in cts.values())
            + sum(len(p) for p in payload)
            + sum(len(s) for s in shares_back)
        )
        down_bytes.append(
            sum(len(keys[j][1]) + len(keys[j][3]) for j in nbrs)
            + sum(len(c) for c in cts.values())
            + 8 * len(nbrs)
        )
    assert masked_one is not None

    # the server's aggregation: n masked vectors summed, n seeds rebuilt from k shares, n masks removed
    seeds = [os.urandom(32) for _ in ring]
    shares = [create_shares(s, t, k) for s in seeds]  # what the members would return (not timed)
    c0 = time.process_time()
    total = [np.zeros_like(a) for a in masked_one]
    for _ in ring:
        total = parameters_mod(parameters_addition(total, masked_one), mod_range)
    for i in ring:
        secret = combine_shares(shares[i])
        total = parameters_subtraction(total, pseudo_rand_gen(secret, mod_range, [a.shape for a in total]))
    total = parameters_mod(total, mod_range)
    _, recon = factor_extract(total)
    dequantize(recon, CLIP, target)
    server_cpu = time.process_time() - c0
    up, down = float(np.mean(up_bytes)), float(np.mean(down_bytes))
    return {
        "num_shares": k,
        "threshold": t,
        "client_cpu_s_per_task": float(np.mean(client_cpu)),
        "clients_timed": len(client_cpu),
        "server_cpu_s_per_aggregation": server_cpu,
        "bytes_up_per_update": up,
        "bytes_down_per_update": down,
        "bytes_ratio_up": up / (4 * length),
        "bytes_ratio_up_down": (up + down) / (4 * length),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument(
        "--flower-clients", type=int, default=8, help="members whose steps are timed on Flower's side"
    )
    ap.add_argument("--no-flower", action="store_true")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    rows = []
    load_before = os.getloadavg()
    for model in args.models:
        layer_shapes = shapes(model)
        length = sum(int(np.prod(s)) for s in layer_shapes)
        for n in args.groups:
            row: dict[str, Any] = {
                "model": model,
                "params": length,
                "group": n,
                "plaintext_bytes_per_update": 4 * length,
            }
            row["felix"] = felix_group(length, n, rng)
            if not args.no_flower:
                row["flower"] = flower_group(layer_shapes, n, min(n, args.flower_clients), rng)
            rows.append(row)
            f = row["felix"]
            line = (
                f"{model:11s} n={n:5d} felix: client {f['client_cpu_s_per_task'] * 1e3:8.1f} ms  server "
                f"{f['server_cpu_s_per_aggregation']:7.3f} s  up x{f['bytes_ratio_up']:.3f}"
            )
            if "flower" in row:
                g = row["flower"]
                line += (
                    f" | flower: client {g['client_cpu_s_per_task'] * 1e3:8.1f} ms  server "
                    f"{g['server_cpu_s_per_aggregation']:7.3f} s  up x{g['bytes_ratio_up']:.3f}"
                )
            print(line, flush=True)
    out = {
        "benchmark": "secagg_speed",
        "command": "python benchmarks/secagg_speed.py "
        + " ".join(
            [
                f"--groups {' '.join(map(str, args.groups))}",
                f"--models {' '.join(args.models)}",
                f"--flower-clients {args.flower_clients}",
            ]
            + (["--no-flower"] if args.no_flower else [])
        ),
        "settings": {
            "clipping_range": CLIP,
            "quantization_bits": QBITS,
            "modulus_bits": MBITS,
            "dropouts": 0,
        },
        "provenance": {
            **provenance(),
            "flwr": _flwr_version(),
            "cpus": os.cpu_count(),
            "load_before": load_before,
            "load_after": os.getloadavg(),
        },
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


def _flwr_version() -> str | None:
    try:
        import flwr

        return str(flwr.__version__)
    except ImportError:
        return None


if __name__ == "__main__":
    main()
