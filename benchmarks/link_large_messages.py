"""How fast the server's link reads a burst of large messages, with its read interval as shipped
(``felix.deploy.link.READ_INTERVAL_S``) and with it off, paired and alternating in one process.

One client login publishes ``--messages`` messages of ``--size`` bytes back to back on its result
topic through a local Mosquitto; the server's link takes them. Each round times the burst from
the first publish to the last message handed over. A network thread that waited out the interval
after every pass would read one body larger than its read chunk per 5 ms; this checks that a link
with a backlog reads on at once, over plain TCP and (``--tls``) over TLS. Prints one JSON line per
setting. Run: ``python benchmarks/link_large_messages.py [--tls]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from felix.deploy import link
from felix.deploy.topics import SERVER_USER, Topics, client_user
from felix.metrics.provenance import provenance

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test broker fixture
from broker import MosquittoBroker

RUN = "large"


def options(broker: MosquittoBroker, user: str) -> link.BrokerOptions:
    users = json.loads(broker.credentials_file.read_text())
    opts = link.BrokerOptions("127.0.0.1", broker.port, user, users[user])
    return replace(opts, tls_ca=str(broker.ca_file)) if broker.ca_file is not None else opts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--messages", type=int, default=20, help="messages per burst")
    ap.add_argument("--size", type=int, default=2_000_000, help="bytes per message")
    ap.add_argument("--rounds", type=int, default=5, help="bursts per setting, alternating")
    ap.add_argument("--tls", action="store_true", help="connect over TLS (a throwaway CA)")
    args = ap.parse_args()
    if args.messages < 1 or args.size < 1 or args.rounds < 1:
        ap.error("--messages, --size and --rounds must be at least 1")
    shipped = link.READ_INTERVAL_S
    times: dict[float, list[float]] = {shipped: [], 0.0: []}
    topics = Topics(RUN)
    got: list[link.Inbound] = []
    done = threading.Event()

    def take(batch: list[link.Inbound]) -> bool:
        got.extend(batch)
        if len(got) >= args.messages:
            done.set()
        return True

    with MosquittoBroker(1, run_id=RUN, tls=args.tls) as broker:
        broker.start()
        server = link.MqttLink(
            SERVER_USER,
            options(broker, SERVER_USER),
            topics.server_subscriptions(),
            lambda m: None,
            batch_sink=take,
        )
        server.start(fresh=True)
        client = link.MqttLink("c", options(broker, client_user(0)), [], lambda m: None)
        client.start(fresh=True)
        payload = bytes(args.size)
        try:
            for _ in range(args.rounds):
                for interval, burst_s in times.items():
                    link.READ_INTERVAL_S = interval
                    got.clear()
                    done.clear()
                    t0 = time.monotonic()
                    for _ in range(args.messages):
                        client.publish(topics.result(0), payload)
                    if not done.wait(120.0):
                        raise SystemExit(f"only {len(got)} of {args.messages} messages arrived in 120 s")
                    burst_s.append(time.monotonic() - t0)
        finally:
            link.READ_INTERVAL_S = shipped
            client.close()
            server.close()
    for interval, ts in times.items():
        line = {
            "read_interval_s": interval,
            "tls": args.tls,
            "messages": args.messages,
            "size": args.size,
            "burst_s_min": round(min(ts), 4),
            "burst_s_median": round(statistics.median(ts), 4),
            "rounds_s": [round(t, 4) for t in ts],
            "provenance": provenance(),
        }
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
