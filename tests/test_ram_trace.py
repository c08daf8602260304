"""``trace.kind: ram`` (the Random Access Model as the engine's availability trace), the sync RAM
rounds it drives, q-FFL's received-model loss (``client.probe_loss``) and their validation."""

from __future__ import annotations

import numpy as np
import pytest

from felix.config import ConfigError, deep_merge, parse_set, validate
from felix.core.commands import NewModelVersion
from felix.core.types import Tier
from felix.scenario.build import _stream, build_population, build_trace
from felix.scenario.random_access import RandomAccessModel, participation_trace, ram_probabilities
from felix.sim.run import run_config

#: 10 digits clients, sync rounds of one 60 s RAM slot, every drawn client trains.
RAM_RUN = {
    "model": "mlp",
    "dataset": {"name": "digits"},
    "partition": {"kind": "dirichlet", "num_clients": 10, "alpha": 0.5, "min_samples": 8},
    "trace": {
        "kind": "ram",
        "slot_s": 60,
        "horizon_s": 360,
        "ram": {"p_dist": "beta", "a": 1.0, "b": 1.0, "p_min": 0.1, "p_max": 0.9},
    },
    "runtime": {"kind": "constant", "constant_s": 10},
    "orchestrator": {
        "mode": "sync",
        "agg_goal": 10,
        "overcommit": 1.0,
        "deadline_s": 60,
        "task_timeout_s": None,
        "knowledge": "tiertrack",
    },
    "client": {"batch_size": 8, "max_steps": 2},
    "run": {"eval_every": 0, "stop_at_target": False, "max_time_s": 360},
}


def cfg_of(**sets: object):
    return validate(deep_merge(RAM_RUN, parse_set([f"{k}={v}" for k, v in sets.items()])))


def test_participation_trace_follows_the_draw() -> None:
    part = np.array([[True, False], [True, True], [False, False]])
    trace = participation_trace(part, 60.0)
    for r in range(3):
        for c in range(2):
            expect = Tier.AVL_TRAIN if part[r, c] else Tier.UN_AVL
            assert trace.tier_at(c, 60.0 * r + 30) is expect
    assert trace.tier_at(0, 200.0) is Tier.UN_AVL  # nothing past the drawn horizon


def test_sync_ram_rounds_train_exactly_the_drawn_clients() -> None:
    """One aggregation per non-empty slot, of exactly the clients the RAM drew for it."""
    cfg = cfg_of()
    pop = build_population(cfg)
    counts = np.stack([d.class_counts(10).numpy() for d in pop.client_data])
    rng = _stream(cfg.seed, 1)  # the trace stream: the p, then the draws
    p = ram_probabilities(cfg.trace, 10, rng, counts)
    draws = RandomAccessModel(p).draw_rounds(6, rng)
    applied: list[tuple[float, tuple[int, ...]]] = []

    def keep(cmd: NewModelVersion) -> None:
        applied.append((cmd.time, tuple(sorted(cmd.report.client_ids))))

    res = run_config(cfg, prepare=lambda built: built.recorder.aggregation_hooks.append(keep))
    expected = [
        (60.0 * (r + 1), tuple(np.flatnonzero(row).tolist())) for r, row in enumerate(draws) if row.any()
    ]
    assert applied == expected and max(len(ids) for _, ids in expected) >= 2
    assert res.summary["aggregations"] == len(expected)


def test_ram_probabilities_and_coupling() -> None:
    cfg = cfg_of(
        **{
            "trace.ram.p_dist": "two_level",
            "trace.ram.frequent_fraction": 0.5,
            "trace.ram.p_frequent": 0.6,
            "trace.ram.p_rare": 0.1,
        }
    )
    counts = np.zeros((10, 3), dtype=np.int64)
    counts[:, 0] = 10
    counts[7:, 2] = 1  # clients 7-9 hold the globally rarest class
    p = ram_probabilities(cfg.trace, 10, np.random.default_rng(0), counts)
    assert sorted(p) == [0.1] * 5 + [0.6] * 5 and (p[7:] == 0.1).all()
    free = ram_probabilities(
        cfg_of(**{"trace.ram.coupling": "none", "trace.ram.p_dist": "two_level"}).trace,
        10,
        np.random.default_rng(0),
    )
    assert set(free) == {0.05, 0.5}
    with pytest.raises(ConfigError, match="needs the clients' class counts"):
        build_trace(cfg)


@pytest.mark.parametrize(
    "sets, message",
    [
        ({"trace.horizon_s": 30}, "horizon_s (30) must be at least slot_s"),
        ({"trace.ram.p_min": 0.5, "trace.ram.p_max": 0.2}, "need p_min <= p_max"),
        ({"trace.ram.coupling": "rare_clients"}, "needs trace.ram.p_dist 'two_level'"),
        (
            {"trace.ram.coupling": "rare_clients", "trace.ram.p_dist": "two_level"},
            "needs partition.kind 'rare_clients'",
        ),
        ({"trace.ram.p_frequent": 1.5}, "trace.ram.p_frequent"),
        ({"client.probe_loss": True}, "only aggregator 'qffl' reads"),
        (
            {"partition.kind": "rare_clients", "partition.rare_fraction": 0.01},
            "round(rare_fraction x num_clients)",
        ),
        ({"partition.imbalance": 0.5}, "partition.imbalance"),
    ],
)
def test_bad_settings_name_the_key(sets: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cfg_of(**sets)


def test_probe_loss_sends_the_received_model_loss() -> None:
    """client.probe_loss: q-FFL's F_k is the loss at the received weights over the client's data."""
    from felix.engine.plan import plan_run

    cfg = cfg_of(**{"client.probe_loss": True, "aggregator.name": "qffl", "aggregator.params": "{q: 1}"})
    plan = plan_run(cfg)
    pop = plan.gathered()
    trainer = plan.trainers.trainer()
    import torch

    data = pop.client_data[0]
    upd = trainer.train(pop.initial_weights, data, {}, {}, torch.Generator().manual_seed(0))
    assert float(upd.aux["qffl_loss"]) == pytest.approx(trainer.probe(pop.initial_weights, data).loss)
    res = run_config(cfg)
    assert res.summary["aggregations"] >= 1 and res.summary["updates_discarded"] == 0
