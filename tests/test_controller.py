"""The run controller (felix.engine.controller): eval cadence, stop rules, the byte model, live
evaluations.csv, checkpoint state, and the rerun rule for interrupted runs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from felix.config import deep_merge
from felix.core.commands import CancelTask, DispatchEval, DispatchTrain
from felix.core.events import ClientRegistered, TaskFailed, TaskFinished, Tick, TierChanged
from felix.core.types import ClientUpdate, Tier
from felix.engine.controller import EVAL_RESULT_BYTES, downstream_bytes, upstream_bytes
from felix.engine.setup import resolve_config
from felix.experiments.runs import RunSpec
from felix.metrics.recorder import HEADER_BYTES
from felix.sim.build import Built
from felix.sim.run import run_config

SMALL = {
    "partition": {"num_clients": 12, "alpha": 0.5},
    "model": "mlp",
    "run": {"target_accuracy": 0.99, "target_window": 2, "max_aggregations": 4, "stop_at_target": False},
    "orchestrator": {"concurrency": 4, "agg_goal": 2},
}


def small(preset: str = "fedbuff", **over):
    return resolve_config(None, preset, deep_merge(SMALL, over))


def test_byte_model_per_message() -> None:
    model = 4 * 100 + HEADER_BYTES
    upd = ClientUpdate(10, 1.0, 0.5, 1.0, np.zeros(100, np.float32), {"beta": np.zeros(3, np.float32)})
    assert upstream_bytes(TaskFinished(0.0, 1, 2, upd), model, False) == ("train", model + 12)
    probe = ClientUpdate(10, 1.0, 0.5, 1.0)
    assert upstream_bytes(TaskFinished(0.0, 1, 2, probe), model, False) == ("eval", EVAL_RESULT_BYTES)
    assert upstream_bytes(ClientRegistered(0.0, 1, 10, Tier.AVL_TRAIN, (5, 5, 0)), model, False) == (
        "control",
        HEADER_BYTES + 24,
    )
    # Tier reports are part of the modelled protocol only when the orchestrator tracks tiers.
    assert upstream_bytes(TierChanged(0.0, 1, Tier.UN_AVL), model, False) is None
    assert upstream_bytes(TierChanged(0.0, 1, Tier.UN_AVL), model, True) == ("control", HEADER_BYTES)
    assert upstream_bytes(TaskFailed(0.0, 1, 2, "x"), model, False) == ("control", HEADER_BYTES)
    assert upstream_bytes(Tick(0.0), model, True) is None
    w = np.zeros(100, np.float32)
    assert downstream_bytes(DispatchTrain(1, 2, 0, w, {}, (1, 2)), model) == ("train", model + 16)
    assert downstream_bytes(DispatchEval(1, 2, 0, w), model) == ("eval", model)
    assert downstream_bytes(CancelTask(1, 2, "late"), model) == ("control", HEADER_BYTES)


def _count_events(built: Built, seen: dict[str, int]) -> None:
    handle = built.orch.handle

    def counting(event):
        seen[type(event).__name__] = seen.get(type(event).__name__, 0) + 1
        return handle(event)

    built.orch.handle = counting  # type: ignore[method-assign]


@pytest.mark.parametrize("knowledge", ["none", "tiertrack"])
def test_tier_reports_cost_bytes_only_under_tiertrack(knowledge: str) -> None:
    seen: dict[str, int] = {}
    cfg = small(
        trace={"kind": "slotted", "unavailable_fraction": 0.3, "slot_s": 5.0},
        orchestrator={"knowledge": knowledge},
        run={"max_aggregations": 6},
    )
    s = run_config(cfg, None, plots=False, prepare=lambda b: _count_events(b, seen)).summary
    registrations = cfg.partition.num_clients * (HEADER_BYTES + 8 * 10)
    tiers = seen.get("TierChanged", 0)
    assert tiers > 0, "the slotted trace changes tiers during the run"
    expected = registrations + (HEADER_BYTES * tiers if knowledge == "tiertrack" else 0)
    assert s["bytes_by_kind"]["up"]["control"] == expected


def test_eval_every_zero_evaluates_nothing(tmp_path: Path) -> None:
    calls = []

    def spy(built: Built) -> None:
        inner = built.recorder.evaluate
        built.recorder.evaluate = lambda w: calls.append(1) or inner(w)  # type: ignore[func-returns-value]

    res = run_config(small(run={"eval_every": 0}), tmp_path, plots=False, prepare=spy)
    assert calls == [] and res.rows == []
    s = res.summary
    assert s["evaluations"] == 0 and s["final_accuracy"] is None and s["aggregations"] == 4
    assert s["stop_reason"] == "max_aggregations"
    with open(tmp_path / "evaluations.csv") as f:
        assert list(csv.DictReader(f)) == []


def test_eval_cadence_and_final_model() -> None:
    rows = run_config(small(run={"eval_every": 3, "max_aggregations": 7}), None, plots=False).rows
    assert [r.version for r in rows] == [0, 3, 6, 7]  # the initial, every third, and the final model


def test_evaluations_csv_is_written_as_evaluations_happen(tmp_path: Path) -> None:
    on_disk: list[int] = []

    def watch(built: Built) -> None:
        def read(
            cmd,
        ) -> None:  # the hook runs before the version is evaluated: the file holds the earlier ones
            with open(tmp_path / "evaluations.csv") as f:
                on_disk.append(len(list(csv.DictReader(f))))

        built.recorder.aggregation_hooks.append(read)

    res = run_config(small(), tmp_path, plots=False, prepare=watch)
    assert on_disk == [1, 2, 3, 4]  # versions 1..4 each found 0..v-1 evaluated
    with open(tmp_path / "evaluations.csv") as f:
        written = [int(r["version"]) for r in csv.DictReader(f)]
    assert written == [r.version for r in res.rows] == [0, 1, 2, 3, 4]  # write_run rewrote it: no row twice


def test_stop_rules_first_reason_wins_and_interrupt() -> None:
    res = run_config(
        small(run={"max_aggregations": 50}),
        None,
        plots=False,
        prepare=lambda b: b.recorder.aggregation_hooks.append(
            lambda cmd: cmd.version == 2 and b.controller.request_stop()
        ),
    )
    s = res.summary
    assert s["stop_reason"] == "interrupted" and s["aggregations"] == 2
    assert [r.version for r in res.rows] == [0, 1, 2]  # everything measured so far
    ctl = res.built.controller
    ctl.stop("no_more_events")
    assert ctl.stop_reason == "interrupted"


def test_state_dict_round_trip() -> None:
    res = run_config(small(), None, plots=False)
    ctl = res.built.controller
    state = ctl.state_dict()
    fresh = run_config(small(run={"max_aggregations": 1}), None, plots=False).built.controller
    fresh.load_state_dict(state)
    assert fresh.rec.rows == ctl.rec.rows and fresh.rec.train_losses == ctl.rec.train_losses
    assert fresh.rec.bytes == ctl.rec.bytes and fresh.rec.time_to_target == ctl.rec.time_to_target


def test_interrupted_summary_is_not_a_finished_run(tmp_path: Path) -> None:
    spec = RunSpec("x", small(), tmp_path)
    assert not spec.done
    (tmp_path / "summary.json").write_text(json.dumps({"stop_reason": "interrupted"}))
    assert not spec.done, "an interrupted run is run again"
    (tmp_path / "summary.json").write_text(json.dumps({"stop_reason": "max_aggregations"}))
    assert spec.done
