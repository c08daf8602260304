"""Admission control in ``felix serve`` over a real broker on 127.0.0.1: one logged-in client
flooding tier flips is held to its message budget at intake (refusals counted by kind), and the
flips that get through make the orchestrator damp it instead of sending it a task per flip."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
from broker import MosquittoBroker
from mqtt_support import (
    load_config,
    needs_mosquitto,
    one_torch_thread,  # noqa: F401  (a fixture)
    start_server,
    users,
    wait_serving,
    wait_until,
    write_config,
)

from felix.core.types import Tier
from felix.deploy import wire
from felix.deploy.topics import Topics
from felix.scenario.build import build_population

pytestmark = needs_mosquitto
T = Topics("t")


def test_a_tier_flip_flood_is_rate_limited_and_damped(tmp_path: Path) -> None:
    cfg = load_config(write_config(tmp_path / "cfg.yaml", partition={"num_clients": 4}))
    counts = np.bincount(build_population(cfg).client_data[0].y.numpy(), minlength=10)
    flood_s, per_s, scale = 8.0, 400, 0.25  # 32 config seconds of flood
    with MosquittoBroker(4, workdir=tmp_path / "broker") as broker:
        server, thread = start_server(cfg, broker, tmp_path / "out", scale)
        raw = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="client-0", protocol=mqtt.MQTTv5)
        raw.username_pw_set("client-0", users(broker)["client-0"])
        tasks: list[float] = []
        raw.on_message = lambda c, u, m: tasks.append(time.monotonic())
        raw.connect("127.0.0.1", broker.port)
        raw.subscribe(T.task(0), qos=1)
        raw.loop_start()
        seq = 0

        def env() -> dict[str, object]:
            nonlocal seq
            seq += 1
            return {"run": "t", "msg_id": f"fl-{seq}", "sent_at": time.time()}

        try:
            wait_serving(server)
            reg = wire.Register(
                **env(),
                client=0,
                incarnation="fl",
                num_samples=int(counts.sum()),
                tier=Tier.AVL_TRAIN,
                class_counts=tuple(int(c) for c in counts),
            )
            raw.publish(T.register(0), wire.encode(reg), qos=1).wait_for_publish(5)
            wait_until(lambda: 0 in server.orch.clients, 10, "the registration")
            start = time.monotonic()
            sent = 0
            while (elapsed := time.monotonic() - start) < flood_s:
                while sent < elapsed * per_s:
                    tier = Tier.UN_AVL if sent % 2 == 0 else Tier.AVL_TRAIN
                    state = wire.State(**env(), client=0, incarnation="fl", tier=tier)
                    raw.publish(T.state(0), wire.encode(state), qos=0)
                    sent += 1
                time.sleep(0.005)
            flood_end = time.monotonic()
            wait_until(lambda: server.stats.messages_in >= sent + 1, 30, "the server to read the flood")
            tasks_after = sum(1 for t in tasks if t > flood_end + 1.0)
            time.sleep(1.5)
            tasks_after = sum(1 for t in tasks if t > flood_end + 1.0) - tasks_after
        finally:
            raw.disconnect()
            raw.loop_stop()
            server.stop_requested.set()
        thread.result(30)
    refused = server.stats.rejected_by_reason.get("transport: rate limit (state)", 0)
    passed = server.stats.tier_messages
    config_s = (flood_end - start + 2.0) / scale  # the flood and the reading, in config seconds
    budget = 50 + 10 * config_s  # burst + rate x time
    assert refused >= sent - budget, (refused, sent)
    assert passed <= budget, (passed, budget)
    # More than 100 changes in a minute got through: the orchestrator damped the client, so it was
    # sent nothing more, and what it was sent stayed within its task budget (30 + 2/s).
    assert server.orch.admission.stats.damped == 1
    assert server.orch.admission.is_damped(0)
    assert tasks_after == 0
    assert len(tasks) <= 2 * (30 + 2 * config_s) + 2
