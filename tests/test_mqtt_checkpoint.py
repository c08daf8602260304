"""Server checkpoints and broker credentials (no broker needed)."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from felix.build import build_orchestrator, build_population
from felix.core.commands import Command
from felix.core.events import ClientRegistered, Event, TaskFinished, Tick, TierChanged
from felix.core.orchestrator import Orchestrator
from felix.core.types import ClientUpdate, TaskKind, Tier
from felix.experiment import resolve_config
from felix.runtime import checkpoint as ckpt
from felix.runtime import security

N = 16


def _orch(preset: str) -> Orchestrator:
    cfg = resolve_config(None, preset, {"model": "mlp", "partition": {"num_clients": N},
                                        "orchestrator": {"agg_goal": 3, "concurrency": 5}})
    return build_orchestrator(cfg, build_population(cfg).initial_weights, None)


def _summary(cmds: list[Command]) -> list[tuple]:
    out = []
    for c in cmds:
        w = getattr(c, "weights", None)
        out.append((type(c).__name__, getattr(c, "task_id", None), getattr(c, "client_id", None),
                    None if w is None else float(np.asarray(w, np.float64).sum())))
    return out


def _events(orch: Orchestrator, t: float, rng: np.random.Generator) -> list[Event]:
    """Answer every open task (train with a random delta, eval with a utility), flip two tiers."""
    evs: list[Event] = []
    for task in orch.tasks():
        t += 1.0
        delta = rng.normal(0, 0.01, orch.weights.size).astype(np.float32) if task.kind is TaskKind.TRAIN else None
        evs.append(TaskFinished(t, task.client_id, task.task_id,
                                ClientUpdate(20, float(rng.uniform(1, 5)), 0.7, float(rng.uniform(2, 30)), delta)))
    evs += [TierChanged(t + 1, 2, Tier.UN_AVL), TierChanged(t + 2, 5, Tier.AVL_EVAL), Tick(t + 200)]
    return evs


def _drive(orch: Orchestrator, evs: list[Event]) -> list[tuple]:
    return [x for e in evs for x in _summary(orch.handle(e))]


@pytest.mark.parametrize("preset", ["felix", "fedbuff", "fedavg"])
def test_restored_orchestrator_behaves_identically(preset: str, tmp_path: Path) -> None:
    """Oort's exploration and pacer, TierSelect's eval budget, TierFuse, the rng: all resume."""
    live = _orch(preset)
    rng = np.random.default_rng(0)
    for c in range(N):
        live.handle(ClientRegistered(0.0, c, 20 + c, Tier.AVL_TRAIN if c % 4 else Tier.AVL_EVAL, (10, 10 + c)))
    for _ in range(3):
        _drive(live, _events(live, live.now, rng))
    assert live.version >= 1
    path = tmp_path / "ck.safetensors"
    ckpt.save_checkpoint(path, live, {"note": "x", "ids": {3: (1, 2)}, "inf": float("inf")})
    restored = _orch(preset)
    shell = ckpt.restore(path, restored)
    assert shell == {"note": "x", "ids": {3: (1, 2)}, "inf": float("inf")}
    assert np.array_equal(restored.weights, live.weights) and not restored.weights.flags.writeable
    # The same future gives the same commands, weights and state.
    for _ in range(3):
        r1 = np.random.default_rng(live.version)
        r2 = np.random.default_rng(live.version)
        assert _drive(live, _events(live, live.now, r1)) == _drive(restored, _events(restored, restored.now, r2))
    assert np.array_equal(restored.weights, live.weights)
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    ckpt.save_checkpoint(a, live, {})
    ckpt.save_checkpoint(b, restored, {})
    assert ckpt.load_checkpoint(a)[0] == ckpt.load_checkpoint(b)[0]


def test_checkpoint_is_atomic_and_checked(tmp_path: Path) -> None:
    orch = _orch("fedbuff")
    path = tmp_path / "ck.safetensors"
    ckpt.save_checkpoint(path, orch, {})
    assert not (tmp_path / "ck.safetensors.tmp").exists()
    with pytest.raises(ckpt.CheckpointError, match="not found"):
        ckpt.restore(tmp_path / "missing", orch)
    (tmp_path / "junk").write_bytes(b"\x80\x04\x95 not a checkpoint")
    with pytest.raises(ckpt.CheckpointError, match="safetensors"):
        ckpt.restore(tmp_path / "junk", orch)
    with pytest.raises(ckpt.CheckpointError, match="the checkpoint holds"):
        ckpt.restore(path, _orch("felix"))  # a different selector than the one saved


def test_unsupported_state_fails_loudly(tmp_path: Path) -> None:
    orch = _orch("fedbuff")
    orch.selector.handle = open  # type: ignore[attr-defined]  # a function is not plain data
    with pytest.raises(ckpt.CheckpointError, match="orchestrator.selector.handle"):
        ckpt.save_checkpoint(tmp_path / "ck", orch, {})


def test_classes_outside_felix_are_refused(tmp_path: Path) -> None:
    dec = ckpt._Decoder({})
    with pytest.raises(ckpt.CheckpointError, match="outside the felix package"):
        dec.dec({"$dc": "os:system", "f": {}}, "x")


def test_reserved_task_ids_after_resume() -> None:
    orch = _orch("fedbuff")
    ckpt.reserve_task_ids(orch, 2)
    orch.handle(ClientRegistered(0.0, 0, 10, Tier.AVL_TRAIN))
    assert [t.task_id for t in orch.tasks()] == [2 * ckpt.RESUME_TASK_ID_STRIDE + 1]


def test_password_hash_is_mosquittos_format() -> None:
    # A line written by `mosquitto_passwd -b` (Mosquitto 2.0.11) for alice / secret:
    ref = ("$7$101$LKMPPp5+MDnPkaoj$P0isEV3IpSHUo8zdhGKlrObzCnJA9ZgrdWV31owcQyhTwZaU+buK/9oEjHAOis48SLQ8"
           "rLLcgPk6knMpFt+Zlw==")
    salt = base64.b64decode(ref.split("$")[3])
    assert security.hash_password("secret", 101, salt) == ref
    with pytest.raises(ValueError):
        security.password_file_text({"bad:name": "x"})


def test_generated_credentials_and_acl(tmp_path: Path) -> None:
    out = security.generate(tmp_path, 3, "run-1")
    users = json.loads(out.credentials.read_text())
    assert set(users) == {"felix-server", "client-0", "client-1", "client-2"}
    assert oct(out.credentials.stat().st_mode & 0o777) == "0o600"
    lines = out.password_file.read_text().splitlines()
    assert len(lines) == 4 and all(line.split(":", 1)[1].startswith("$7$") for line in lines)
    acl = out.acl_file.read_text()
    block = acl.split("user client-1\n")[1].split("\n\n")[0].splitlines()
    assert block == ["topic read felix/run-1/client/1/task", "topic read felix/run-1/server/status",
                     "topic write felix/run-1/server/register/1", "topic write felix/run-1/server/state/1",
                     "topic write felix/run-1/server/result/1"]
    assert "topic write felix/+/client/+/task" in security.acl_file_text([0])
