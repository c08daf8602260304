"""CPU cost of heavy headers: ``felix serve`` (fedbuff on digits, 4 clients' logins, none
connected) against one login publishing 64 KiB headers (a registration with 32,000 class counts)
at ``--rate`` per second for ``--seconds``, on a local Mosquitto. Prints one JSON line: the
headers sent, the CPU seconds of the server, the broker and this publisher over the attack (and
2 s after it), and what the server refused, by kind. Run: ``python benchmarks/heavy_header_cost.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import paho.mqtt.client as mqtt

from felix.deploy import wire
from felix.deploy.topics import SERVER_USER, Topics, client_user

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test broker fixture
from broker import MosquittoBroker

RUN = "h"


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def heavy_header(cid: int) -> bytes:
    doc = {"fmt": wire.FORMAT_VERSION, "type": "register", "run": RUN, "msg": "h-1", "sent": 1.0}
    doc |= {"payload": 0, "arrays": [], "client": cid, "incarnation": "h", "num_samples": 0}
    doc |= {"tier": "AVL_TRAIN", "class_counts": [0] * 32_000}
    header = json.dumps(doc, separators=(",", ":")).encode()
    return struct.pack("<4sHI", wire.MAGIC, wire.FORMAT_VERSION, len(header)) + header


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="felix-heavy-") as tmp:
        work = Path(tmp)
        cfg = work / "c.yaml"
        cfg.write_text(
            "name: h\nstrategy: fedbuff\nmodel: mlp\ndataset: {name: digits}\n"
            "partition: {kind: dirichlet, num_clients: 4, alpha: 0.5}\n"
        )
        with MosquittoBroker(4, run_id=RUN, workdir=work / "broker") as broker:
            users = json.loads(broker.credentials_file.read_text())
            log = work / "server.log"
            server = subprocess.Popen(
                [sys.executable, "-m", "felix.deploy", "-v", "serve", str(cfg), "--broker", broker.address]
                + ["--run-id", RUN, "--out", str(work / "out"), "--time-scale", "0.05"],
                env={**os.environ, "FELIX_MQTT_PASSWORD": users[SERVER_USER]},
                stdout=open(log, "wb"),  # noqa: SIM115 - the child keeps it
                stderr=subprocess.STDOUT,
            )
            deadline = time.monotonic() + 120
            while "serving run" not in log.read_text(errors="replace"):
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the server did not start serving")
                time.sleep(0.2)
            pub = mqtt.Client(
                mqtt.CallbackAPIVersion.VERSION2, client_id=client_user(1), protocol=mqtt.MQTTv5
            )
            pub.username_pw_set(client_user(1), users[client_user(1)])
            pub.connect("127.0.0.1", broker.port)
            pub.loop_start()
            topic, payload = Topics(RUN).register(1), heavy_header(1)
            assert broker._proc is not None
            s0, b0, p0 = cpu_s(server.pid), cpu_s(broker._proc.pid), time.process_time()
            start, sent = time.monotonic(), 0
            while time.monotonic() - start < args.seconds:
                due = (time.monotonic() - start) * args.rate
                while sent < due:
                    pub.publish(topic, payload, qos=0)
                    sent += 1
                time.sleep(0.002)
            time.sleep(2.0)
            s1, b1, p1 = cpu_s(server.pid), cpu_s(broker._proc.pid), time.process_time()
            pub.disconnect()
            pub.loop_stop()
            server.terminate()
            server.wait(60)
            summ = json.loads((work / "out" / "summary.json").read_text())
    out = {
        "sent": sent,
        "server_cpu_s": round(s1 - s0, 2),
        "broker_cpu_s": round(b1 - b0, 2),
        "publisher_cpu_s": round(p1 - p0, 2),
        "refused_by_kind": summ["transport"]["refused_by_kind"],
    }
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
