"""The simulation shell end to end, on the bundled digits data (fast, offline)."""

from __future__ import annotations

import json

import pytest

from felix.cli import main
from felix.core.types import Tier
from felix.engine.setup import resolve_config
from felix.scenario.traces import DeviceTrace
from felix.sim.run import run_config
from felix.sim.simulation import SimDevice

SMALL = {
    "partition": {"num_clients": 20, "alpha": 0.5},
    "model": "mlp",
    "run": {"target_accuracy": 0.5, "target_window": 2, "max_aggregations": 8, "stop_at_target": False},
    "orchestrator": {"concurrency": 6, "agg_goal": 3},
}


def small(**over):
    from felix.config import deep_merge

    return resolve_config(None, over.pop("preset", "fedbuff"), deep_merge(SMALL, over))


def test_same_seed_same_summary_except_wall_time(tmp_path):
    a = run_config(small(), tmp_path / "a", plots=False).summary
    b = run_config(small(), tmp_path / "b", plots=False).summary
    for s in (a, b):
        s.pop("wall_time_s")
    assert a == b
    assert a["aggregations"] == 8 and a["updates_applied"] == 24
    c = run_config(small(seed=1), None, plots=False).summary
    assert c["final_accuracy"] != a["final_accuracy"] or c["bytes_up"] != a["bytes_up"]


def test_bytes_count_every_model_transfer():
    res = run_config(small(), None, plots=False)
    s = res.summary
    model_bytes = 4 * s["num_params"] + 64
    d = s["diagnostics"]
    assert s["bytes_by_kind"]["down"]["train"] == d["train_dispatched"] * model_bytes
    # every applied update was uploaded once; some finished but were not yet aggregated
    assert s["bytes_by_kind"]["up"]["train"] >= s["updates_applied"] * model_bytes
    assert s["bytes_by_kind"]["up"]["train"] % model_bytes == 0


def test_diagnostics_keep_every_percentile_of_the_update_weights():
    """``agg_weight_percentiles``: percentiles 0-100 of every applied update's recorded weight,
    from which the report reads the weights' distribution (the FeLiX paper's Fig. 15)."""
    res = run_config(small(), None, plots=False)
    w = sorted(res.built.orch.stats.agg_weights)
    d = res.summary["diagnostics"]
    pct = d["agg_weight_percentiles"]
    assert len(w) == res.summary["updates_applied"] == 24
    assert len(pct) == 101 and pct == sorted(pct)
    assert (pct[0], pct[-1]) == (w[0], w[-1]) and (pct[5], pct[50], pct[95]) == (
        d["agg_weight_p5"],
        d["agg_weight_p50"],
        d["agg_weight_p95"],
    )


def test_training_improves_accuracy():
    res = run_config(
        small(
            run={"max_aggregations": 30, "target_accuracy": 0.6, "stop_at_target": True, "target_window": 2}
        ),
        None,
        plots=False,
    )
    assert res.summary["time_to_target_s"] is not None
    assert res.rows[0].accuracy < 0.3 < res.summary["final_accuracy"]


def test_sync_without_deadline_stalls_when_selected_clients_vanish():
    # Clients 0-9 leave at t=30 for good and sync FedAvg has no timeout: the round never closes.
    cfg = small(
        preset="fedavg",
        run={"max_time_s": 5000.0, "max_aggregations": 50},
        runtime={"kind": "constant", "constant_s": 40.0},
        orchestrator={"agg_goal": 20, "overcommit": 1.0},
    )
    res = run_config(cfg, None, plots=False)
    from felix.sim.build import build

    b = build(cfg)
    for dev in b.sim.devices[:10]:
        dev.trace = DeviceTrace.from_events([(0, Tier.AVL_TRAIN), (30, Tier.UN_AVL)])
    out = b.sim.run()
    assert b.orch.version == 0 and out.stop_reason in ("no_more_events", "max_time")
    assert res.summary["aggregations"] > 0  # without the departures the same run progresses


def test_paused_training_resumes_and_arrives_late():
    cfg = small(
        runtime={"kind": "constant", "constant_s": 40.0},
        run={"max_aggregations": 1},
        orchestrator={"concurrency": 1, "agg_goal": 1, "task_timeout_s": None},
        partition={"num_clients": 1},
    )
    from felix.sim.build import build

    b = build(cfg)
    dev: SimDevice = b.sim.devices[0]
    dev.trace = DeviceTrace.from_events([(0, Tier.AVL_TRAIN), (10, Tier.UN_AVL), (100, Tier.AVL_TRAIN)])
    b.sim.run()
    # 10 s of work, paused 90 s, the remaining 30 s: the update lands at t = 130
    assert b.orch.stats.aggregation_times == [130.0]


def test_cli_writes_outputs(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "partition: {num_clients: 10}\nmodel: mlp\nrun: {max_aggregations: 3, target_accuracy: 0.99}\n"
    )
    rc = main(
        [
            "run",
            str(cfg),
            "--preset",
            "fedbuff",
            "--out",
            str(tmp_path / "o"),
            "-q",
            "--set",
            "orchestrator.concurrency=4",
            "--set",
            "orchestrator.agg_goal=2",
        ]
    )
    assert rc == 0
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    required = {
        "strategy",
        "seed",
        "target_accuracy",
        "time_to_target_s",
        "bytes_to_target",
        "final_accuracy",
        "virtual_time_s",
        "wall_time_s",
        "aggregations",
        "updates_applied",
        "updates_discarded",
        "bytes_down",
        "bytes_up",
    }
    assert required <= set(s) and s["strategy"] == "fedbuff" and s["time_to_target_s"] is None
    assert s["aggregations"] == 3
    rows = (tmp_path / "o" / "evaluations.csv").read_text().splitlines()
    assert rows[0].startswith("time_s,version,accuracy,loss,bytes_total") and len(rows) == 1 + 4
    for png in ("accuracy_vs_time.png", "accuracy_vs_bytes.png"):
        assert (tmp_path / "o" / png).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["--set", "orchestrator.concurency=3"],
            "orchestrator.concurency: unknown key (did you mean `concurrency`?)",
        ),
        (["--set", "client.bacth_size=3"], "client.bacth_size: unknown key (did you mean `batch_size`?)"),
        (["--set", "client.lr=abc"], "client.lr: expected a number, got 'abc'"),
        (["--set", "run.max_aggregations=1.5"], "run.max_aggregations: expected a whole number, got 1.5"),
        (["--set", "orchestrator.agg_goal=0"], "orchestrator.agg_goal"),
        (["--set", "selector.name=magic"], "unknown selector 'magic'"),
        (["--preset", "nope"], "unknown strategy preset 'nope'"),
        (["--set", "trace.kind=mobiperf"], "trace.kind 'mobiperf' needs trace.path"),
        (["--set", "trace.kind=mobiperf", "--set", "trace.path=/no/such.json"], "not found"),
        (["--set", "dataset.name=cifar10"], "cifar10 needs dataset.root"),
        (["--set", "novalue"], "--set expects key=value"),
        (["--scenario", "felix-speech-cpu"], "scenario felix-speech-cpu names no strategy: add --preset"),
    ],
)
def test_bad_config_gets_clear_message(args, needle, capsys, tmp_path):
    rc = main(["run", "-q", "--out", str(tmp_path), *args])
    err = capsys.readouterr().err
    last = err.splitlines()[-1]
    assert rc == 2 and last.startswith("felix: error:") and needle in last, err  # one line


def test_config_file_errors(tmp_path, capsys):
    p = tmp_path / "c.yaml"
    p.write_text("- just\n- a list\n")
    assert main(["run", str(p)]) == 2
    assert "top level must be a mapping" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "missing.yaml")]) == 2
    assert "not found" in capsys.readouterr().err


def test_event_loop_keeps_the_built_objects_from_the_collector_and_hands_them_back():
    """The loop runs with everything built before it frozen (gc.freeze: the collector's passes
    skip them) and unfreezes them when it ends, so later garbage among them is collected."""
    import gc

    from felix.sim.build import build

    built = build(small())
    frozen: list[int] = []
    built.sim.ctl.on_evaluation.append(lambda row: frozen.append(gc.get_freeze_count()))
    before = gc.get_freeze_count()
    built.sim.run()
    assert len(frozen) > 1 and frozen[0] == before  # the initial model is evaluated before the loop
    assert min(frozen[1:]) > before
    assert gc.get_freeze_count() == before
