"""The deployment subcommands: ``serve``, ``client``, ``emulate`` and ``mqtt-credentials``.

``add_parsers(subparsers)`` registers them on the ``felix`` command; ``main`` runs them on their
own (``python -m felix.deploy ...``), which is also how ``emulate`` starts its worker processes.
Broker logins come from ``--username/--password``, from the environment
(``FELIX_MQTT_USERNAME`` / ``FELIX_MQTT_PASSWORD``: keeps passwords out of ``ps``), or, for many
clients, from a ``credentials.json`` written by ``mqtt-credentials``.

One file of about 620 lines on purpose: the four subcommands share their argument groups (config,
transport and login, TLS) and the translation of those into the shells' options, which would
otherwise be repeated per command or spread over a module per flag group.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from felix.config import Config, ConfigError, parse_set

ENV_USER, ENV_PASSWORD = "FELIX_MQTT_USERNAME", "FELIX_MQTT_PASSWORD"


# ---------------------------------------------------------------------- shared options
def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="YAML config, the same file as for `felix run`")
    p.add_argument("--preset", help="strategy preset, e.g. felix, fedbuff")
    p.add_argument("--scenario", help="named scenario to start from (default: 'default' when no config)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--run-id", help="topic namespace of the run (default: <name>-<strategy>-s<seed>)")


def _broker_args(p: argparse.ArgumentParser, login: bool = True) -> None:
    p.add_argument(
        "--transport",
        default="mqtt",
        help="the registered transport the links use (felix.deploy.transport): mqtt (default) or "
        "memory (server and clients in one process)",
    )
    p.add_argument(
        "--link",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one of the transport's options (MQTT: felix.deploy.link.BrokerOptions, e.g. keepalive_s=30)",
    )
    p.add_argument(
        "--broker",
        metavar="HOST:PORT[,...]",
        help="MQTT broker (default 127.0.0.1:1883), or several comma-separated: one shard of the "
        "clients each, by client id (docs/deployment.md, Sharded brokers)",
    )
    if login:
        p.add_argument("--username", help=f"broker login (default: ${ENV_USER})")
        p.add_argument("--password", help=f"broker password (default: ${ENV_PASSWORD})")
    p.add_argument("--tls-ca", help="CA certificate file: connect with TLS and verify the broker")
    p.add_argument("--tls-cert", help="client certificate for mutual TLS (with --tls-key)")
    p.add_argument("--tls-key", help="private key of --tls-cert")


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--credentials", help="credentials.json from `felix mqtt-credentials` (per-client logins)")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="wall seconds per config second for the trace and runtimes (0.01: 100x faster)",
    )
    p.add_argument(
        "--runtime",
        choices=("profile", "compute"),
        default="profile",
        help="profile: tasks last the config's runtime profile (emulation); compute: real compute time",
    )
    p.add_argument("--t0", type=float, help="Unix time at which the trace starts (default: now)")
    p.add_argument("--no-train", action="store_true", help="reply with zero updates at once (load testing)")
    p.add_argument("--max-wall-s", type=float, help="give up after this many wall seconds")
    p.add_argument("--torch-threads", type=int, default=1, help="torch threads per process (default 1)")


def _resolve(args: argparse.Namespace) -> Config:
    from felix.engine.setup import resolve_config

    return resolve_config(args.config, args.preset, parse_set(args.set), args.scenario)


def _run_id(args: argparse.Namespace, cfg: Config) -> str:
    from felix.deploy.topics import check_run_id, sanitize_run_id

    return (
        check_run_id(args.run_id)
        if args.run_id
        else sanitize_run_id(f"{cfg.name}-{cfg.strategy}-s{cfg.seed}")
    )


def _link_settings(args: argparse.Namespace) -> dict[str, object]:
    """``--link KEY=VALUE`` settings, with ``--broker`` and ``--tls-*`` as shorthands for the MQTT
    transport's ``host``/``port`` and ``tls_*`` (a transport without them refuses them by name)."""
    settings: dict[str, object] = {}
    for item in args.link:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--link expects KEY=VALUE, got {item!r}")
        settings[key.strip()] = value
    if args.broker is not None:
        from felix.deploy.link import BrokerOptions

        addresses = BrokerOptions.parse_addresses(args.broker)
        settings.update(host=addresses[0][0], port=addresses[0][1])
        if len(addresses) > 1:  # one broker per shard of the clients (felix.deploy.shards)
            settings["shards"] = tuple(addresses)
    for key in ("tls_ca", "tls_cert", "tls_key"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    return settings


def _login(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """``--username``/``--password``, or the environment's."""
    user = getattr(args, "username", None) or os.environ.get(ENV_USER)
    return user, getattr(args, "password", None) or os.environ.get(ENV_PASSWORD)


def _broker_options(args: argparse.Namespace) -> Any:
    """The transport's options model (``felix.deploy.transport.link_options``)."""
    from felix.deploy.transport import link_options

    return link_options(args.transport, _link_settings(args))


def _guard(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn the runtime's user-facing errors into one line and exit code 2."""

    def run(args: argparse.Namespace) -> int:
        from felix.deploy.checkpoint import CheckpointError
        from felix.deploy.link import LinkError
        from felix.scenario.datasets import DatasetError
        from felix.scenario.traces import TraceError

        try:
            return func(args)
        except (ConfigError, DatasetError, TraceError, LinkError, CheckpointError, ValueError) as exc:
            print(f"felix {args.command}: error: {exc}", file=sys.stderr)
            return 2

    return run


@contextmanager
def _stop_on_signals(event: Any) -> Iterator[None]:
    """SIGTERM and SIGINT ask the loop to stop cleanly instead of killing it mid-message."""
    handler = lambda signum, frame: event.set()
    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# ---------------------------------------------------------------------- serve
def _serve(args: argparse.Namespace) -> int:
    from felix.deploy.metrics import MetricsEndpoint
    from felix.deploy.server import ServeOptions, Server
    from felix.deploy.topics import SERVER_USER

    if args.metrics_port is not None and not (1 <= args.metrics_port <= 65535):
        raise ValueError(f"--metrics-port {args.metrics_port} is outside 1-65535")
    cfg = _resolve(args)
    run_id = _run_id(args, cfg)
    out = Path(args.out or f"runs/{cfg.name}-{cfg.strategy}-s{cfg.seed}-mqtt")
    ckpt = Path(args.checkpoint) if args.checkpoint else None
    if args.resume and ckpt is None:
        raise ValueError("--resume needs --checkpoint PATH")
    opts = ServeOptions(
        broker=_broker_options(args).with_login(_login(args)[0] or SERVER_USER, _login(args)[1]),
        transport=args.transport,
        run_id=run_id,
        out_dir=out,
        checkpoint=ckpt,
        resume=args.resume,
        time_scale=args.time_scale,
        max_message_bytes=args.max_message_bytes,
        plots=args.plots,
        max_pending_bytes=args.max_pending_bytes,
        max_inbox_bytes=args.max_inbox_bytes,
        checkpoint_interval_s=args.checkpoint_interval,
        client_msg_rate=args.client_msg_rate or None,
        client_msg_burst=args.client_msg_burst,
        models=_model_hosting(args),
        decode_worker=args.decode_worker,
        link_process=args.link_process,
        **({} if args.secagg_stage_s is None else {"secagg_stage_s": args.secagg_stage_s}),
        download_ratio=args.download_ratio or None,
    )
    print(
        f"felix serve: {cfg.name} / {cfg.strategy} (seed {cfg.seed}), run {run_id} on {opts.broker.describe()} -> {out}",
        file=sys.stderr,
    )
    server = Server(cfg, opts)
    with (
        _stop_on_signals(server.stop_requested),
        MetricsEndpoint(server, args.metrics_host, args.metrics_port)
        if args.metrics_port is not None
        else nullcontext(),
    ):
        s = server.run()
    ttt = "not reached" if s["time_to_target_s"] is None else f"{s['time_to_target_s']:.0f} s"
    final = "-" if s["final_accuracy"] is None else f"{s['final_accuracy']:.4f}"  # None: run.eval_every 0
    print(
        f"target {s['target_accuracy']:.2f}: {ttt}; final accuracy {final} after {s['aggregations']} "
        f"aggregations, {s['virtual_time_s']:.0f} s ({s['wall_time_s']:.1f} wall s), "
        f"{(s['bytes_down'] + s['bytes_up']) / 1e6:.1f} MB, {s['transport']['duplicates']} duplicates, "
        f"{s['transport']['rejected']} rejected ({s['stop_reason']})",
        file=sys.stderr,
    )
    return 0 if s["stop_reason"] != "interrupted" else 130


# ---------------------------------------------------------------------- client
def _parse_ids(args: argparse.Namespace) -> list[int]:
    if (args.id is None) == (args.ids is None):
        raise ValueError("give exactly one of --id ID or --ids FIRST-LAST")
    if args.id is not None:
        return [args.id]
    first, sep, last = args.ids.partition("-")
    if not sep or not first.isdigit() or not last.isdigit() or int(first) > int(last):
        raise ValueError(f"--ids expects FIRST-LAST, got {args.ids!r}")
    return list(range(int(first), int(last) + 1))


def _client(args: argparse.Namespace) -> int:
    import torch

    from felix.deploy.client import ClientHost, ClientOptions, credentials_from_map
    from felix.deploy.security import load_credentials

    cfg = _resolve(args)
    ids = _parse_ids(args)
    if args.torch_threads < 1:
        raise ValueError(f"--torch-threads must be at least 1, not {args.torch_threads}")
    torch.set_num_threads(args.torch_threads)
    broker = _broker_options(args)
    login, password = _login(args)
    if args.credentials:
        creds = credentials_from_map(load_credentials(args.credentials))
    elif password is not None:
        if len(ids) > 1:
            raise ValueError("several clients need --credentials (one login each)")
        user = login or f"client-{ids[0]}"
        creds = lambda cid: (user, password)
    else:
        creds = lambda cid: (None, None)  # a broker that allows anonymous clients
    opts = ClientOptions(
        broker=broker,
        transport=args.transport,
        run_id=_run_id(args, cfg),
        time_scale=args.time_scale,
        runtime=args.runtime,
        trace_device=args.trace_device,
        t0=args.t0,
        no_train=args.no_train,
        max_wall_s=args.max_wall_s,
    )
    traces = None
    if args.trace_shard:
        from felix.deploy.client import load_trace_shard

        traces = load_trace_shard(args.trace_shard)
    host = ClientHost(cfg, ids, opts, creds, traces)
    with _stop_on_signals(host.stop_requested):
        done = host.run()
    logging.getLogger("felix.deploy.client").info("clients %d-%d: %d tasks done", ids[0], ids[-1], done)
    if host.stop_requested.is_set():
        _exit_now(0)
    return 0


def _exit_now(code: int) -> None:
    """Exit at once after a stop signal: the links are closed and nothing is left to write, but
    tearing down the interpreter (torch, the dataset) takes seconds on a busy machine, and a
    stopped worker must be gone within 5 s."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---------------------------------------------------------------------- emulate
def _emulate(args: argparse.Namespace) -> int:
    cfg = _resolve(args)
    if args.clients < 1 or args.processes < 1:
        raise ValueError("--clients and --processes must be at least 1")
    first = args.first_id
    if first + args.clients > cfg.partition.num_clients:
        raise ValueError(
            f"clients {first}..{first + args.clients - 1} exceed the config's "
            f"{cfg.partition.num_clients} clients"
        )
    import tempfile

    from felix.deploy.client import MAX_CLIENTS_PER_PROCESS, save_trace_shard
    from felix.engine.plan import plan_run

    t0 = args.t0 if args.t0 is not None else time.time()
    procs = min(max(args.processes, -(-args.clients // MAX_CLIENTS_PER_PROCESS)), args.clients)
    if procs > args.processes:
        print(
            f"felix emulate: {procs} processes instead of {args.processes}: at most {MAX_CLIENTS_PER_PROCESS} "
            f"clients fit in one",
            file=sys.stderr,
        )
    bounds = [first + (args.clients * k) // procs for k in range(procs + 1)]
    base = (
        [sys.executable, "-m", "felix.deploy"]
        + (["-v"] if getattr(args, "verbose", False) else [])
        + ["client"]
    )
    if args.config:
        base.append(args.config)
    for flag, value in (
        ("--preset", args.preset),
        ("--scenario", args.scenario),
        ("--run-id", args.run_id),
        ("--transport", args.transport),
        ("--broker", args.broker),
        ("--credentials", args.credentials),
        ("--tls-ca", args.tls_ca),
        ("--tls-cert", args.tls_cert),
        ("--tls-key", args.tls_key),
        ("--time-scale", str(args.time_scale)),
        ("--runtime", args.runtime),
        ("--t0", repr(t0)),
        ("--max-wall-s", None if args.max_wall_s is None else str(args.max_wall_s)),
        ("--torch-threads", str(args.torch_threads)),
    ):
        if value is not None:
            base += [flag, value]
    for item in args.set:
        base += ["--set", item]
    for item in args.link:
        base += ["--link", item]
    if args.no_train:
        base.append("--no-train")
    # The population's trace is built once, here, from the run's plan (the server's, class counts
    # included, no client's samples gathered); each worker reads only its clients' share, so
    # start-up grows with the number of clients, not with clients x workers.
    trace = plan_run(cfg, shards_only=True).trace
    device = getattr(args, "trace_device", None)
    shards = tempfile.TemporaryDirectory(prefix="felix-emulate-")
    children = []
    for k in range(procs):
        ids = range(bounds[k], bounds[k + 1])
        shard = Path(shards.name) / f"trace-{k}.npz"
        save_trace_shard(shard, {c: trace.for_client(c if device is None else device) for c in ids})
        children.append(
            subprocess.Popen(
                base + ["--ids", f"{bounds[k]}-{bounds[k + 1] - 1}", "--trace-shard", str(shard)]
            )
        )
    print(
        f"felix emulate: clients {first}-{first + args.clients - 1} in {procs} processes "
        f"(pids {' '.join(str(c.pid) for c in children)}), time scale {args.time_scale}",
        file=sys.stderr,
    )

    stop: dict[str, Any] = {"flag": False}

    def forward(signum: int, frame: object) -> None:
        stop["flag"] = True
        stop.setdefault("at", time.monotonic())
        for c in children:
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        codes = [_wait_child(c, stop) for c in children]
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        shards.cleanup()
    if stop["flag"]:
        _exit_now(130)
    return max(codes)


STOP_KILL_AFTER_S = 3.5  # a worker still running this long after SIGTERM is killed


def _wait_child(child: subprocess.Popen[bytes], stop: dict[str, Any]) -> int:
    """Wait for a worker; once a stop was forwarded, the workers have ``STOP_KILL_AFTER_S`` (all
    together, from the signal) before SIGKILL."""
    while True:
        try:
            return child.wait(0.1)
        except subprocess.TimeoutExpired:
            if "at" in stop and time.monotonic() - stop["at"] > STOP_KILL_AFTER_S:
                child.kill()
                return child.wait()


# ---------------------------------------------------------------------- credentials
def _credentials(args: argparse.Namespace) -> int:
    """Logins and ACL, and a mosquitto.conf whose size limits follow the run's model when a config
    is given (``felix.deploy.broker_config``)."""
    from felix.deploy import security
    from felix.deploy.broker_config import (
        UNSIZED_MESSAGE_BYTES,
        BrokerLimits,
        default_max_message_bytes,
        mosquitto_conf,
    )
    from felix.deploy.link import BrokerOptions

    n = args.clients
    run_id = args.run_id
    max_bytes, concurrency, sized = (
        UNSIZED_MESSAGE_BYTES,
        None,
        "not sized to a model (give the run's config)",
    )
    if args.config or args.preset or args.set or args.scenario:
        from felix.engine.plan import plan_run

        cfg = _resolve(args)
        n = n or cfg.partition.num_clients
        num_params = int(plan_run(cfg, shards_only=True).initial_weights.size)
        max_bytes = default_max_message_bytes(num_params)
        concurrency = cfg.orchestrator.concurrency
        sized = f"sized to {num_params:,} parameters"
    if args.max_message_bytes is not None:
        max_bytes, sized = args.max_message_bytes, "sized by --max-message-bytes"
    if not n:
        raise ValueError("give --clients N or a config")
    limits = BrokerLimits.for_run(n, concurrency or n, max_bytes)
    listeners = BrokerOptions.parse_addresses(args.listen)
    sets = security.generate_shards(args.out, n, len(listeners), run_id)
    confs = []
    for listen, creds in zip(listeners, sets, strict=True):  # one broker per shard (felix.deploy.shards)
        folder = creds.password_file.parent.resolve()
        (folder / "db").mkdir(exist_ok=True)
        conf = creds.password_file.parent / "mosquitto.conf"
        conf.write_text(
            mosquitto_conf(
                listen=listen,
                password_file=folder / "passwd",
                acl_file=folder / "acl",
                persistence_dir=folder / "db",
                limits=limits,
            )
        )
        confs.append(str(conf))
    print(
        f"wrote {', '.join(str(c.password_file) for c in sets)} ({n} clients + {security.SERVER_USER}"
        + (f", over {len(sets)} shards" if len(sets) > 1 else "")
        + f"), the ACLs (run {run_id or 'any'}), {sets[0].credentials} (plaintext, mode 0600), "
        f"{', '.join(confs)} (messages up to {limits.max_message_bytes:,} bytes, {sized}; at most "
        f"{limits.max_queued_messages:,} messages and {limits.max_queued_bytes:,} bytes queued per session)",
        file=sys.stderr,
    )
    return 0


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model-http",
        metavar="[HOST:]PORT",
        help="serve each model version once over HTTP by its hash (PORT 0: any free port; HOST "
        "default 127.0.0.1); tasks then name the hash and URL and the broker carries no models",
    )
    p.add_argument("--model-dir", help="also write each model to this folder, as a file named by its hash")
    p.add_argument(
        "--model-url",
        help="base URL clients fetch <URL>/<sha256> from: a static server or CDN serving --model-dir "
        "(without --model-http), or the built-in server's public address",
    )


def _model_hosting(args: argparse.Namespace) -> Any:
    """The ``--model-*`` options as a ``ModelHosting`` (None: models travel inside the tasks)."""
    from felix.deploy.model_store import ModelHosting

    folder = Path(args.model_dir) if args.model_dir else None
    if args.model_http is None:
        if folder is None and args.model_url is None:
            return None
        if folder is None or args.model_url is None:
            raise ValueError("--model-dir and --model-url go together (or give --model-http)")
        return ModelHosting(port=None, url=args.model_url, folder=folder)
    host, _, port = args.model_http.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"--model-http expects [HOST:]PORT, got {args.model_http!r}")
    return ModelHosting(host=host or "127.0.0.1", port=int(port), url=args.model_url, folder=folder)


# ---------------------------------------------------------------------- registration
def add_parsers(subparsers: Any) -> None:
    """Register ``serve``, ``client``, ``emulate`` and ``mqtt-credentials`` on ``felix``'s subparsers."""
    s = subparsers.add_parser("serve", help="run the federated server over MQTT (deployment)")
    _config_args(s)
    _broker_args(s)
    s.add_argument("--out", help="output folder (default runs/<name>-<strategy>-s<seed>-mqtt)")
    s.add_argument(
        "--checkpoint", help="checkpoint file (and PATH.applied.csv), rewritten after aggregations"
    )
    s.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    s.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="wall seconds per config second: timers and reported time in config seconds",
    )
    s.add_argument(
        "--max-message-bytes", type=int, help="largest inbound message (default: 2x model + 1 MiB)"
    )
    s.add_argument(
        "--max-pending-bytes",
        type=int,
        default=64 << 20,
        help="inbound bytes handled but not yet acknowledged before a checkpoint is forced (default 64 MiB)",
    )
    s.add_argument(
        "--max-inbox-bytes",
        type=int,
        default=64 << 20,
        help="inbound bytes received but not yet handled; when reached, reading from the broker waits "
        "(default 64 MiB)",
    )
    s.add_argument(
        "--checkpoint-interval",
        type=float,
        default=0.2,
        help="wall seconds between checkpoints at most; one covers every aggregation since the last",
    )
    s.add_argument(
        "--client-msg-rate",
        type=float,
        default=10.0,
        help="messages per config second each client may send (a token bucket; the rest are refused "
        "as 'transport: rate limit'); 0 turns the limit off (default 10)",
    )
    s.add_argument(
        "--client-msg-burst",
        type=float,
        default=50.0,
        help="the per-client message bucket's capacity (default 50)",
    )
    s.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on http://HOST:PORT/metrics (docs/deployment.md, Metrics; default: none)",
    )
    s.add_argument(
        "--metrics-host", default="127.0.0.1", help="the metrics endpoint's address (default %(default)s)"
    )
    _model_args(s)
    s.add_argument(
        "--decode-worker",
        action="store_true",
        help="parse inbound messages in a second process while the loop applies the ones before",
    )
    s.add_argument(
        "--link-process",
        action="store_true",
        help="run the broker connections (paho's network threads, one per shard) in a process of their "
        "own, out of the loop's interpreter; with --decode-worker, the setup for large populations",
    )
    s.add_argument(
        "--secagg-stage-s",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with secure_aggregation on: overrides the config's secure_aggregation.stage_timeout_s, "
        "the wall seconds a stage of a group waits at most for its members (default: the config's)",
    )
    s.add_argument(
        "--download-ratio",
        type=float,
        default=1.0,
        help="bytes a client may be sent and leave unanswered per byte it sent (a per-client download "
        "budget, docs/deployment.md); 0 turns it off (default 1)",
    )
    s.add_argument("--plots", action="store_true", help="also write the accuracy plots")
    s.set_defaults(func=_guard(_serve))

    c = subparsers.add_parser("client", help="run one (or a range of) federated client(s) over MQTT")
    _config_args(c)
    _broker_args(c)
    c.add_argument("--id", type=int, help="client id: its partition of the config's dataset")
    c.add_argument("--ids", help=argparse.SUPPRESS)  # FIRST-LAST, used by emulate's workers
    c.add_argument("--trace-shard", help=argparse.SUPPRESS)  # the workers' traces, written by emulate
    c.add_argument(
        "--trace-device", type=int, help="follow this device of the trace (default: the client's own)"
    )
    _client_args(c)
    c.set_defaults(func=_guard(_client))

    e = subparsers.add_parser(
        "emulate", help="run many clients on this machine, driven by the config's trace"
    )
    _config_args(e)
    _broker_args(e, login=False)
    e.add_argument("--clients", type=int, required=True, help="how many clients")
    e.add_argument("--first-id", type=int, default=0, help="id of the first client (default 0)")
    e.add_argument("--processes", type=int, default=1, help="worker processes (default 1)")
    _client_args(e)
    e.set_defaults(func=_guard(_emulate))

    m = subparsers.add_parser(
        "mqtt-credentials",
        help="write a Mosquitto password file, ACL, client logins and mosquitto.conf",
    )
    _config_args(m)
    m.add_argument("--clients", type=int, help="number of clients (default: the config's)")
    m.add_argument("--out", required=True, help="folder for passwd, acl, credentials.json and mosquitto.conf")
    m.add_argument(
        "--listen",
        default="127.0.0.1:1883",
        metavar="HOST:PORT[,...]",
        help="the broker's listener in mosquitto.conf (default %(default)s); several, comma-separated: "
        "one broker per shard, each in OUT/shard-K/ with its clients' logins and ACL",
    )
    m.add_argument(
        "--max-message-bytes",
        type=int,
        help="largest message the broker passes (default: the server's, from the config's model: "
        "8 bytes per parameter + 1 MiB; without a config 64 MiB); give the server the same",
    )
    m.set_defaults(func=_guard(_credentials))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m felix.deploy", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="log progress, rejections and reconnects")
    sub = p.add_subparsers(dest="command", required=True)
    add_parsers(sub)
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args.func(args))
