"""Server checkpoints and broker credentials (no broker needed)."""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import numpy as np
import pytest

from felix.core.commands import Command, NewModelVersion, UpdateRejected
from felix.core.events import ClientRegistered, Event, TaskFinished, Tick, TierChanged
from felix.core.orchestrator import Orchestrator
from felix.core.types import ClientUpdate, TaskKind, Tier
from felix.deploy import checkpoint as ckpt
from felix.deploy import security
from felix.engine.components import build_orchestrator
from felix.engine.setup import resolve_config
from felix.scenario.build import build_population

N = 16


def _orch(preset: str, aggregator: dict | None = None) -> Orchestrator:
    cfg = resolve_config(
        None,
        preset,
        {
            "model": "mlp",
            "partition": {"num_clients": N},
            "orchestrator": {"agg_goal": 3, "concurrency": 5},
            "aggregator": aggregator or {},
        },
    )
    return build_orchestrator(cfg, build_population(cfg).initial_weights, None)


def _summary(cmds: list[Command]) -> list[tuple]:
    out = []
    for c in cmds:
        w = getattr(c, "weights", None)
        out.append(
            (
                type(c).__name__,
                getattr(c, "task_id", None),
                getattr(c, "client_id", None),
                None if w is None else float(np.asarray(w, np.float64).sum()),
            )
        )
    return out


def _events(orch: Orchestrator, t: float, rng: np.random.Generator) -> list[Event]:
    """Answer every open task (train with a random delta, eval with a utility), flip two tiers."""
    evs: list[Event] = []
    for task in orch.tasks():
        t += 1.0
        delta = (
            rng.normal(0, 0.01, orch.weights.size).astype(np.float32) if task.kind is TaskKind.TRAIN else None
        )
        evs.append(
            TaskFinished(
                t,
                task.client_id,
                task.task_id,
                ClientUpdate(20, float(rng.uniform(1, 5)), 0.7, float(rng.uniform(2, 30)), delta),
            )
        )
    evs += [TierChanged(t + 1, 2, Tier.UN_AVL), TierChanged(t + 2, 5, Tier.AVL_EVAL), Tick(t + 200)]
    return evs


def _drive(orch: Orchestrator, evs: list[Event]) -> list[tuple]:
    return [x for e in evs for x in _summary(orch.handle(e))]


def _save(path: Path, orch: Orchestrator, shell: dict) -> int:
    return ckpt.save_checkpoint(path, {"orchestrator": orch.state_dict(), "shell": shell})


def _load(path: Path, orch: Orchestrator) -> dict:
    doc = ckpt.load_checkpoint(path)
    orch.load_state_dict(doc["orchestrator"])
    return doc["shell"]


def _same(a: object, b: object) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize(
    ("preset", "aggregator"),
    [
        ("felix", {}),
        ("fedbuff", {}),
        ("fedavg", {}),
        ("felix-authors", {"server_optimizer": "adam"}),
        ("fedavg", {"server_optimizer": "momentum"}),
    ],
)
def test_restored_orchestrator_behaves_identically(preset: str, aggregator: dict, tmp_path: Path) -> None:
    """Oort's exploration and pacer, TierSelect's eval budget, TierFuse, the server optimiser's
    moments, the rng: all resume."""
    live = _orch(preset, aggregator)
    rng = np.random.default_rng(0)
    for c in range(N):
        live.handle(
            ClientRegistered(0.0, c, 20 + c, Tier.AVL_TRAIN if c % 4 else Tier.AVL_EVAL, (10, 10 + c))
        )
    for _ in range(3):
        _drive(live, _events(live, live.now, rng))
    assert live.version >= 1
    path = tmp_path / "ck.safetensors"
    _save(path, live, {"note": "x", "ids": [1, 2], "inf": float("inf")})
    restored = _orch(preset, aggregator)
    shell = _load(path, restored)
    assert shell == {"note": "x", "ids": [1, 2], "inf": float("inf")}
    assert np.array_equal(restored.weights, live.weights) and not restored.weights.flags.writeable
    # The same future gives the same commands, weights and state.
    for _ in range(3):
        r1 = np.random.default_rng(live.version)
        r2 = np.random.default_rng(live.version)
        assert _drive(live, _events(live, live.now, r1)) == _drive(
            restored, _events(restored, restored.now, r2)
        )
    assert np.array_equal(restored.weights, live.weights)
    assert _same(live.state_dict(), restored.state_dict())


def test_a_checkpoint_without_server_optimizer_state_still_loads(tmp_path: Path) -> None:
    """A checkpoint written before server optimisers (no aggregator state) resumes an adam run with
    fresh moments; the same checkpoint with its moments resumes the live trajectory exactly."""
    live = _orch("fedbuff", {"server_optimizer": "adam"})
    rng = np.random.default_rng(0)
    for c in range(N):
        live.handle(ClientRegistered(0.0, c, 20 + c, Tier.AVL_TRAIN, (10, 10 + c)))
    for _ in range(3):
        _drive(live, _events(live, live.now, rng))
    state = live.state_dict()
    assert state["aggregator"]["server_optimizer"]["steps"] == live.version >= 2
    old = {**state, "aggregator": {}}
    ckpt.save_checkpoint(tmp_path / "old", {"orchestrator": old, "shell": {}})
    ckpt.save_checkpoint(tmp_path / "new", {"orchestrator": state, "shell": {}})
    resumed = {}
    for name in ("old", "new"):
        orch = _orch("fedbuff", {"server_optimizer": "adam"})
        _load(tmp_path / name, orch)
        _drive(orch, _events(orch, orch.now, np.random.default_rng(1)))
        resumed[name] = orch.weights
    _drive(live, _events(live, live.now, np.random.default_rng(1)))
    assert np.array_equal(resumed["new"], live.weights)
    assert not np.array_equal(resumed["old"], live.weights)


def test_closed_task_ids_are_compacted_by_a_watermark() -> None:
    """Closed task ids are remembered one by one only above the oldest open task; below it a
    result is still refused (as for a closed task), and the remembered set stays bounded."""
    from felix.core.ledger import CLOSED_COMPACT_AT

    orch = _orch("fedbuff")
    for c in range(N):
        orch.handle(ClientRegistered(0.0, c, 20, Tier.AVL_TRAIN, (10, 10)))
    rng = np.random.default_rng(1)
    first = min(t.task_id for t in orch.tasks())
    for _ in range(CLOSED_COMPACT_AT // 5 + 200):
        _drive(orch, _events(orch, orch.now, rng)[:-3])
    st = orch.state_dict()
    assert st["closed_below"] > first and len(st["closed_ids"]) <= CLOSED_COMPACT_AT
    out = orch.handle(
        TaskFinished(
            orch.now + 1, 0, first, ClientUpdate(20, 1.0, 0.5, 1.0, np.zeros(orch.weights.size, np.float32))
        )
    )
    assert [c.reason for c in out if isinstance(c, UpdateRejected)] == ["result for a closed task"]


@pytest.mark.slow
def test_checkpoint_cost_does_not_grow_with_history(tmp_path: Path) -> None:
    """Finding 5: at 100,000 applied updates and 10,000 clients a checkpoint (snapshot plus the
    applied-update log's fsync) takes well under 100 ms. (The reflective JSON checkpoint took
    4.7 s at 100,000 applied updates: every applied and closed task id, re-encoded each time.)"""
    import time

    from felix.core.orchestrator import AvailabilityName, OrchestratorConfig
    from felix.strategies.aggregation.fedavg import FedBuffAggregator
    from felix.strategies.selection.random import RandomSelector

    n_clients, active, updates = 10_000, 200, 100_000
    orch = Orchestrator(
        OrchestratorConfig(agg_goal=50, concurrency=100, knowledge=AvailabilityName.TIERTRACK),
        np.zeros(64, np.float32),
        RandomSelector(),
        FedBuffAggregator(),
        np.random.default_rng(0),
    )
    for c in range(n_clients):
        orch.handle(ClientRegistered(0.0, c, 30, Tier.AVL_TRAIN if c < active else Tier.UN_AVL, (15, 15)))
    log = ckpt.AppliedLog(tmp_path / "ck.applied.csv")
    delta = np.full(64, 1e-3, np.float32)
    t = 0.0
    while orch.stats.updates_applied < updates:
        for task in orch.tasks():
            # A client's pace: each of the 200 answers every ~20 s, within the default task budget
            # (orchestrator.admission: 2 tasks a second), which would hold back clients paced at 1 ms.
            t += 0.1
            for cmd in orch.handle(
                TaskFinished(t, task.client_id, task.task_id, ClientUpdate(30, 1.0, 0.5, 1.0, delta))
            ):
                if isinstance(cmd, NewModelVersion):
                    for tid, cid, st, w in zip(
                        cmd.report.task_ids,
                        cmd.report.client_ids,
                        cmd.report.staleness,
                        cmd.report.weights,
                        strict=True,
                    ):
                        log.append(ckpt.AppliedUpdate(cmd.version, tid, cid, st, w, t))
    assert orch.stats.updates_applied >= updates and len(orch.clients) == n_clients and log.unique
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        log.sync()
        ckpt.save_checkpoint(tmp_path / "ck", {"orchestrator": orch.state_dict(), "shell": log.position()})
        times.append(time.perf_counter() - t0)
    assert min(times) < 0.1, f"checkpoint took {min(times) * 1000:.0f} ms"
    restored = Orchestrator(
        OrchestratorConfig(agg_goal=50, concurrency=100, knowledge=AvailabilityName.TIERTRACK),
        np.zeros(64, np.float32),
        RandomSelector(),
        FedBuffAggregator(),
        np.random.default_rng(9),
    )
    restored.load_state_dict(ckpt.load_checkpoint(tmp_path / "ck")["orchestrator"])
    assert _same(restored.state_dict(), orch.state_dict())
    log.close()


def test_applied_log_truncates_to_the_checkpoint(tmp_path: Path) -> None:
    log = ckpt.AppliedLog(tmp_path / "log.csv")
    log.append(ckpt.AppliedUpdate(1, 5, 0, 0, 0.5, 1.0))
    pos = log.position()
    log.append(ckpt.AppliedUpdate(2, 6, 1, 0, 0.5, 2.0))
    log.sync()
    log.close()
    again = ckpt.AppliedLog(tmp_path / "log.csv")
    again.truncate(pos)
    assert [r.task_id for r in again.rows()] == [5] and again.count == 1
    again.append(ckpt.AppliedUpdate(2, 7, 1, 0, 0.5, 2.0))
    assert [r.task_id for r in again.rows()] == [5, 7]
    with pytest.raises(ckpt.CheckpointError, match="shorter"):
        again.truncate({"count": 9, "bytes": 10**6})


def test_checkpoint_is_atomic_and_checked(tmp_path: Path) -> None:
    orch = _orch("fedbuff")
    path = tmp_path / "ck.safetensors"
    _save(path, orch, {})
    assert not (tmp_path / "ck.safetensors.tmp").exists()
    with pytest.raises(ckpt.CheckpointError, match="not found"):
        ckpt.load_checkpoint(tmp_path / "missing")
    (tmp_path / "junk").write_bytes(b"\x80\x04\x95 not a checkpoint")
    with pytest.raises(ckpt.CheckpointError, match="safetensors"):
        ckpt.load_checkpoint(tmp_path / "junk")


def test_unsupported_state_fails_loudly(tmp_path: Path) -> None:
    """Only plain data is saved: anything else names its path instead of being pickled."""
    with pytest.raises(ckpt.CheckpointError, match="state.shell.handle"):
        ckpt.save_checkpoint(tmp_path / "ck", {"shell": {"handle": open}})
    with pytest.raises(ckpt.CheckpointError, match="not a plain string"):
        ckpt.save_checkpoint(tmp_path / "ck", {"shell": {3: 1}})


def test_reserved_task_ids_after_resume() -> None:
    orch = _orch("fedbuff")
    orch.reserve_task_ids(2 * ckpt.RESUME_TASK_ID_STRIDE + 1)
    orch.handle(ClientRegistered(0.0, 0, 10, Tier.AVL_TRAIN))
    assert [t.task_id for t in orch.tasks()] == [2 * ckpt.RESUME_TASK_ID_STRIDE + 1]


def test_password_hash_is_mosquittos_format() -> None:
    # A line written by `mosquitto_passwd -b` (Mosquitto 2.0.11) for alice / secret:
    ref = (
        "$7$101$LKMPPp5+MDnPkaoj$P0isEV3IpSHUo8zdhGKlrObzCnJA9ZgrdWV31owcQyhTwZaU+buK/9oEjHAOis48SLQ8"
        "rLLcgPk6knMpFt+Zlw=="
    )
    salt = base64.b64decode(ref.split("$")[3])
    assert security.hash_password("secret", 101, salt) == ref
    with pytest.raises(ValueError):
        security.password_file_text({"bad:name": "x"})


def test_generated_credentials_and_acl(tmp_path: Path) -> None:
    out = security.generate(tmp_path, 3, "run-1")
    users = json.loads(out.credentials.read_text())
    assert set(users) == {"felix-server", "client-0", "client-1", "client-2"}
    # Letters and digits only: a password passed as `--password <it>` is never read as an option.
    assert all(len(pw) == 24 and pw.isascii() and pw.isalnum() for pw in users.values())
    assert len(set(users.values())) == 4
    drawn = [security.new_password() for _ in range(2000)]
    assert len(set(drawn)) == 2000 and not any(pw.startswith("-") for pw in drawn)
    assert oct(out.credentials.stat().st_mode & 0o777) == "0o600"
    lines = out.password_file.read_text().splitlines()
    assert len(lines) == 4 and all(line.split(":", 1)[1].startswith("$7$") for line in lines)
    acl = out.acl_file.read_text()
    block = acl.split("user client-1\n")[1].split("\n\n")[0].splitlines()
    assert block == [
        "topic read felix/run-1/client/1/task",
        "topic read felix/run-1/server/status",
        "topic write felix/run-1/server/register/1",
        "topic write felix/run-1/server/state/1",
        "topic write felix/run-1/server/result/1",
        "topic write felix/run-1/server/secagg/1",
    ]
    assert "topic write felix/+/client/+/task" in security.acl_file_text([0])
    assert security.load_credentials(out.credentials) == users


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (None, "not found"),
        (b"\xff\xfe", "not JSON"),  # not UTF-8
        (b"{oops", "not JSON"),
        (b'{"client-0": 7}', "expected a JSON object of username -> password strings"),
        ("folder", "Is a directory"),
    ],
)
def test_a_bad_credentials_file_is_a_clear_error(
    tmp_path: Path, content: bytes | str | None, needle: str
) -> None:
    path = tmp_path / "credentials.json"
    if content == "folder":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    with pytest.raises(ValueError, match=f"credentials file {path}: {needle}" if content else needle):
        security.load_credentials(path)
