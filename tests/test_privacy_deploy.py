"""Privacy in a deployment (felix serve / felix client over the in-memory transport): the server
applies the same mechanism through the shared setup with noise from the OS's CSPRNG, the devices
clip (and under local DP noise) before sending, the server re-checks the bound, and the evaluation
log carries epsilon."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest
from mqtt_support import Background, load_config, one_torch_thread, wait_until, write_config  # noqa: F401

from felix.deploy.client import ClientHost, ClientOptions
from felix.deploy.memory_transport import MemoryOptions
from felix.deploy.server import ServeOptions, Server
from felix.privacy.central import CentralGaussian

SCALE = 0.1
CLIENTS = [0, 1, 2]


def _deploy(tmp_path: Path, privacy: dict[str, Any]) -> tuple[Server, list[ClientHost], dict[str, Any]]:
    pytest.importorskip("dp_accounting", reason="extra felix-fl[privacy] not installed")
    cfg = load_config(
        write_config(
            tmp_path / "cfg.yaml", partition={"num_clients": len(CLIENTS)}, trace={"kind": "always"}
        ),
        {
            "strategy": "fedbuff",
            "orchestrator": {"agg_goal": 1, "concurrency": 1},
            "aggregator": {"normalize": "count"},
            "run": {"max_aggregations": 3, "target_accuracy": 1.0},
            "privacy": privacy,
        },
    )
    run_id = f"dp-{privacy['mechanism']}"
    server = Server(
        cfg,
        ServeOptions(
            MemoryOptions(),
            run_id=run_id,
            out_dir=tmp_path / "out",
            time_scale=SCALE,
            status_every_s=1e9,
            transport="memory",
        ),
    )
    serving = Background(server.run, "server")
    serving.start()
    hosts: list[tuple[ClientHost, Background]] = []
    try:
        for cid in CLIENTS:
            opts = ClientOptions(
                broker=MemoryOptions(), run_id=run_id, time_scale=SCALE, max_wall_s=60.0, transport="memory"
            )
            host = ClientHost(cfg, [cid], opts, lambda c: (None, None))
            hosts.append((host, Background(host.run, f"client-{cid}")))
            hosts[-1][1].start()
            wait_until(lambda c=cid: c in server.orch.clients, 30, f"client {cid} to register")
        summ = serving.result(90)
        for _, thread in hosts:
            thread.result(20)
    finally:
        server.stop_requested.set()
        for host, _ in hosts:
            host.stop_requested.set()
    return server, [h for h, _ in hosts], summ


def _epsilons(out: Path) -> list[tuple[int, float]]:
    with open(out / "evaluations.csv", newline="") as f:
        return [(int(r["version"]), float(r["epsilon"])) for r in csv.DictReader(f)]


def test_a_central_deployment_noises_from_the_os_and_logs_epsilon(tmp_path: Path) -> None:
    dp = pytest.importorskip("dp_accounting", reason="extra felix-fl[privacy] not installed")

    server, hosts, summ = _deploy(
        tmp_path, {"mechanism": "central_gaussian", "noise_multiplier": 2.0, "clip_norm": 0.3}
    )
    p = summ["privacy"]
    assert p["noise_source"] == "os_csprng" and p["aggregations"] == 3
    mech = server.orch.aggregator.privacy
    assert isinstance(mech, CentralGaussian) and mech.os_noise
    assert mech.state_dict()["rng"] is None  # a checkpoint cannot replay the noise
    assert 0 < mech.max_contribution_norm <= 0.3 * (1 + 1e-6)
    assert server.orch.validator.privacy_bound == pytest.approx(0.3 * (1 + 1e-5))  # the server re-checks
    for host in hosts:  # each device clips, with no noise and no seed of its own
        assert host.rules.privacy is not None and host.rules.privacy.clip_norm == 0.3
        assert host.rules.privacy.noise_multiplier is None and host.rules.privacy.noise_source == "os_csprng"
    rows = _epsilons(tmp_path / "out")
    assert rows and rows[-1][0] == 3
    for version, eps in rows:
        acc = dp.rdp.RdpAccountant()
        if version:
            acc.compose(dp.SelfComposedDpEvent(dp.GaussianDpEvent(2.0), version))
        assert eps == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    assert (
        json.loads((tmp_path / "out" / "summary.json").read_text())["privacy"]["noise_source"] == "os_csprng"
    )


def test_a_local_dp_deployment_noises_on_the_devices(tmp_path: Path) -> None:
    sigma, c = 1.0, 0.2
    privacy = {"mechanism": "local", "noise_multiplier": sigma, "clip_norm": c, "max_participations": 3}
    server, hosts, summ = _deploy(tmp_path, privacy)
    assert summ["privacy"]["noise_source"] == "os_csprng" and summ["updates_applied"] == 3
    sent = sum(sum(h.rules.privacy.reports.values()) for h in hosts if h.rules.privacy is not None)
    assert sent >= 3  # every applied update was noised on its device
    assert all(h.rules.privacy is not None and h.rules.privacy.seed is None for h in hosts)
    d = int(server.orch.weights.size)  # the server re-checks: clip plus the noise's tail bound
    assert server.orch.validator.privacy_bound == pytest.approx(
        c * (1 + 1e-5) + sigma * c * (math.sqrt(d) + 10)
    )
    assert server.orch.aggregator.privacy is None  # the server adds no noise of its own


def test_a_banded_deployment_keeps_contributions_apart_and_logs_epsilon(tmp_path: Path) -> None:
    """banded_mf through the shared setup: the OS's noise, the separation rule on the deployed
    orchestrator, epsilon by the separated sensitivity."""
    dp = pytest.importorskip("dp_accounting", reason="extra felix-fl[privacy] not installed")
    from felix.privacy.banded import sensitivity
    from felix.privacy.ftrl import BandedAggregation

    privacy = {"mechanism": "banded_mf", "bands": 2, "noise_multiplier": 2.0, "clip_norm": 0.3}
    server, _, summ = _deploy(tmp_path, privacy)
    assert summ["privacy"]["noise_source"] == "os_csprng" and summ["privacy"]["bands"] == 2
    mech = server.orch.aggregator.privacy
    assert isinstance(mech, BandedAggregation) and mech.os_noise and mech.state_dict()["rng"] is None
    assert server.orch.separation.bands == 2
    # one update per aggregation (agg_goal 1): the last aggregation's client is the one held back
    assert len(server.orch.separation.blocked([])) == 1
    for version, eps in _epsilons(tmp_path / "out"):
        acc = dp.rdp.RdpAccountant()
        if version:
            acc.compose(dp.GaussianDpEvent(2.0 / sensitivity(version, 2, None)))
        assert eps == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
