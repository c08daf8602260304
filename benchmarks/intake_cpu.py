"""CPU of the server's loop thread per tier message, with the messages parsed in the loop and in
the decode worker (``felix serve --decode-worker``).

A server (the in-memory transport, nothing sent) with 400 registered clients of the MQTT tests'
digits run (FeLiX preset, 10 tasks at a time) is fed pre-encoded STATE messages that flip each
client between UN_AVL and AVL_TRAIN, the way the link hands them over (batches of 64). Measured
with ``time.thread_time`` on the loop thread: its CPU per message in all, and the part spent in
the orchestrator (``Server._deliver``: the run controller and the orchestrator's handling of the
tier change, with the dispatches it triggers); with the worker, also the worker's parsing time per
message (on the other core). ``--repeats`` rounds of ``--messages`` each, alternating the two
ways; one JSON line with the mean and spread of each and the provenance.

``--baseline REV`` compares the working tree's code with commit ``REV`` side by side: each repeat
runs one round of each way in a fresh process on each code (``git archive`` of ``REV``, this
script on both), the two codes alternating, so that other work on the machine weighs on both
alike; the line then holds, for each code and way, the mean, spread, minimum and median.

The rounds run with the objects made before them frozen, as ``Server.run`` serves
(``felix.engine.heap.gc_frozen``; a commit that predates it runs them unfrozen, as its server
did), and ``gc_us`` is the loop thread's CPU per message in the cyclic collector's passes (a full
pass walks every object not frozen), a part of ``loop_us``.

``--batch N`` hands the messages over N at a time instead of the inbox's 64 (the worker's round
trip per batch against parsing in the loop: the server sends batches under
``WORKER_MIN_BATCH`` to no worker).

Run: ``python benchmarks/intake_cpu.py [--messages 10000] [--repeats 3] [--plain-only] [--baseline REV] [--batch N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from felix.core.types import Tier
from felix.deploy import wire
from felix.deploy.channels import Address, Channel
from felix.deploy.memory_transport import MemoryOptions
from felix.deploy.server import INBOX_BATCH, ServeOptions, Server
from felix.deploy.transport import Ack, Delivery
from felix.engine.setup import resolve_config
from felix.metrics.provenance import provenance

CLIENTS = 400


def make_server(work: Path) -> Server:
    doc = {
        "name": "intake-cpu",
        "strategy": "felix",
        "seed": 0,
        "model": "mlp",
        "dataset": {"name": "digits"},
        "partition": {"kind": "dirichlet", "num_clients": CLIENTS, "alpha": 0.5},
        "trace": {"kind": "always"},
        "runtime": {"kind": "constant", "constant_s": 10.0},
        "orchestrator": {"agg_goal": 5, "concurrency": 10},
    }
    (work / "cfg.yaml").write_text(yaml.safe_dump(doc))
    cfg = resolve_config(str(work / "cfg.yaml"), None, {})
    opts = ServeOptions(
        MemoryOptions(),
        run_id="r",
        status_every_s=1e9,
        transport="memory",
        client_msg_rate=None,  # every message reaches the orchestrator: no budget refuses any
        client_cost_limit=False,
    )
    srv = Server(cfg, opts)
    srv.link.send = lambda *a: None  # type: ignore[method-assign]
    for c in range(CLIENTS):
        counts = [0] * srv.num_classes
        counts[0] = srv.partition_sizes[c]
        reg = wire.Register(
            run="r",
            msg_id=f"i{c}-1",
            sent_at=time.time(),
            client=c,
            incarnation=f"i{c}",
            num_samples=counts[0],
            tier=Tier.AVL_TRAIN,
            class_counts=tuple(counts),
        )
        srv.handle_inbound(Delivery(Address(Channel.REGISTER, c), wire.encode(reg), Ack(0, 0, 1), "r"))
    return srv


def flips(n: int, first_seq: int) -> list[Delivery]:
    out = []
    for k in range(n):
        c, seq = k % CLIENTS, first_seq + k // CLIENTS
        tier = Tier.UN_AVL if seq % 2 == 0 else Tier.AVL_TRAIN
        msg = wire.State(
            run="r", msg_id=f"i{c}-{seq}", sent_at=time.time(), client=c, incarnation=f"i{c}", tier=tier
        )
        out.append(Delivery(Address(Channel.STATE, c), wire.encode(msg), Ack(0, 0, 1), "r"))
    return out


class Timed:
    """Wraps ``Server._deliver`` to add up its CPU time on the loop thread."""

    def __init__(self, srv: Server) -> None:
        self.inner = srv._deliver
        self.cpu = 0.0
        srv._deliver = self  # type: ignore[method-assign]

    def __call__(self, *args: Any, **kwargs: Any) -> bool:
        t0 = time.thread_time()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.cpu += time.thread_time() - t0


class GcTime:
    """The loop thread's CPU in the cyclic collector's passes (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self._t0 = 0.0
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.thread_time()
        else:
            self.cpu += time.thread_time() - self._t0


def frozen() -> contextlib.AbstractContextManager[None]:
    """The heap frozen as ``Server.run`` freezes it (nothing, for a commit whose server did not)."""
    try:
        from felix.engine.heap import gc_frozen
    except ImportError:
        return contextlib.nullcontext()
    return gc_frozen()


def one_round(
    srv: Server,
    timed: Timed,
    msgs: list[Delivery],
    worker: Any,
    batch_size: int = INBOX_BATCH,
    gc_time: GcTime | None = None,
) -> dict[str, float]:
    parse = 0.0
    gc_before = 0.0 if gc_time is None else gc_time.cpu
    if worker is not None:
        original = worker.collect

        def collect() -> list[Any]:
            nonlocal parse
            out = original()
            parse += sum(s for _, s in out)
            return out

        worker.collect = collect
    timed.cpu = 0.0
    before = srv.stats.tier_messages
    t0 = time.thread_time()
    for i in range(0, len(msgs), batch_size):
        batch = msgs[i : i + batch_size]
        if worker is None:
            for m in batch:
                srv.handle_inbound(m)
        else:
            srv._pipeline(worker, batch)
    if worker is not None:
        srv._pipeline(worker, [])
        worker.collect = original
    loop = time.thread_time() - t0
    n = srv.stats.tier_messages - before
    assert n == len(msgs) and srv.stats.rejected == 0, (n, srv.stats.rejected_by_reason)
    return {
        "loop_us": 1e6 * loop / n,
        "orchestrator_us": 1e6 * timed.cpu / n,
        "intake_us": 1e6 * (loop - timed.cpu) / n,
        "worker_parse_us": 1e6 * parse / n,
        "gc_us": 0.0 if gc_time is None else 1e6 * (gc_time.cpu - gc_before) / n,
    }


def _stats(rows: list[dict[str, float]], spread: bool = False) -> dict[str, dict[str, float]]:
    out = {}
    for k in rows[0]:
        xs = [r[k] for r in rows]
        out[k] = {"mean": round(statistics.fmean(xs), 1), "sd": round(statistics.pstdev(xs), 1)}
        if spread:
            out[k] |= {"min": round(min(xs), 1), "median": round(statistics.median(xs), 1)}
    return out


def _one_process(src: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One round of each way in a fresh process on the code under ``src``."""
    cmd = [
        sys.executable,
        __file__,
        "--messages",
        str(args.messages),
        "--repeats",
        "1",
        "--batch",
        str(args.batch),
    ]
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(
        cmd + (["--plain-only"] if args.plain_only else []),
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """The working tree's code and ``args.baseline``'s, one process each per repeat, alternating."""
    root = Path(__file__).resolve().parents[1]
    rev = subprocess.run(
        ["git", "rev-parse", "--short", args.baseline], cwd=root, check=True, capture_output=True, text=True
    ).stdout.strip()
    rows: dict[str, dict[str, list[dict[str, float]]]] = {"baseline": {}, "this": {}}
    with tempfile.TemporaryDirectory(prefix="felix-intake-base-") as tmp:
        archive = Path(tmp) / "base.tar"
        subprocess.run(["git", "archive", "-o", str(archive), rev, "src"], cwd=root, check=True)
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        codes = {"baseline": Path(tmp) / "src", "this": root / "src"}
        for i in range(args.repeats):
            for name in ("baseline", "this") if i % 2 == 0 else ("this", "baseline"):
                line = _one_process(codes[name], args)
                for way in ("loop_parses", "decode_worker"):
                    if way in line:
                        rows[name].setdefault(way, []).append({k: v["mean"] for k, v in line[way].items()})
    return {
        "baseline": {"commit": rev, **{w: _stats(r, True) for w, r in rows["baseline"].items()}},
        "this": {w: _stats(r, True) for w, r in rows["this"].items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=10000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--plain-only", action="store_true", help="only the loop's own parsing")
    p.add_argument(
        "--batch",
        type=int,
        default=INBOX_BATCH,
        help="messages handed over per loop turn (the inbox's batch)",
    )
    p.add_argument("--baseline", metavar="REV", help="also run commit REV's code, interleaved")
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    load_before = os.getloadavg()
    if args.baseline is not None:
        out = {
            "clients": CLIENTS,
            "messages": args.messages,
            "repeats": args.repeats,
            "batch": args.batch,
            **compare(args),
        }
        _finish(out, load_before)
        return
    worker = None
    with tempfile.TemporaryDirectory(prefix="felix-intake-") as tmp:
        srv = make_server(Path(tmp))
        timed = Timed(srv)
        if not args.plain_only:
            from felix.deploy.decode_worker import DecodeWorker

            worker = DecodeWorker(srv.max_bytes, srv.protocol.header_bytes)
        plain, piped = [], []
        seq = 2
        one_round(srv, timed, flips(2 * CLIENTS, seq), None)  # warm up
        seq += 2
        gc_time = GcTime()
        with frozen():
            for _ in range(args.repeats):
                msgs = flips(args.messages, seq)
                plain.append(one_round(srv, timed, msgs, None, args.batch, gc_time))
                seq += args.messages // CLIENTS + 1
                if worker is not None:
                    msgs = flips(args.messages, seq)
                    piped.append(one_round(srv, timed, msgs, worker, args.batch, gc_time))
                    seq += args.messages // CLIENTS + 1
        if worker is not None:
            worker.close()
    out: dict[str, Any] = {
        "clients": CLIENTS,
        "messages": args.messages,
        "repeats": args.repeats,
        "batch": args.batch,
    }
    out["loop_parses"] = _stats(plain)
    if piped:
        out["decode_worker"] = _stats(piped)
    _finish(out, load_before)


def _finish(out: dict[str, Any], load_before: tuple[float, float, float]) -> None:
    out["command"] = "python " + " ".join(["benchmarks/intake_cpu.py", *sys.argv[1:]])
    out["provenance"] = provenance()
    # Other work on the machine moves these figures: the load average before and after the rounds.
    out["loadavg_before"] = [round(x, 2) for x in load_before]
    out["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
