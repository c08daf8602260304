"""Streaming data (felix.stream): arrivals, drift and label delays follow their configured
distributions (statistical tests with fixed seeds), the store and its windows, a sample is never
trained on before its label is known, recovery time on a hand-made accuracy trace, and the
settings refused with one line."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from felix.config import ConfigError, StreamCfg, validate
from felix.deploy import checkpoint as ckpt
from felix.metrics.freshness import FreshnessTracker, recovery_time, time_average
from felix.stream.labels import draw_delays, mean_delay
from felix.stream.model import StreamModel
from felix.stream.store import LocalStore

C = 10
POOL = np.repeat(np.arange(C), 50)  # 50 samples of each class


def stream_cfg(**over: object) -> StreamCfg:
    return validate({"stream": {"enabled": True, **over}}).stream


def model(cfg: StreamCfg, clients: int = 20, seed: int = 0, tier_at=None) -> StreamModel:  # type: ignore[no-untyped-def]
    return StreamModel(cfg, POOL, C, clients, seed, tier_at)


def all_arrivals(m: StreamModel, cid: int, end: float) -> dict[str, np.ndarray]:
    """Every sample of client ``cid`` up to ``end``, read with a cap larger than the stream."""
    s = m.client(cid)
    s.advance(end)
    st = s.store
    return {k: st._ordered(k) for k in ("arrival", "label_time", "index", "label", "proxy")}


# ---------------------------------------------------------------------- arrivals
def test_poisson_arrivals_have_the_configured_rate_and_exponential_gaps() -> None:
    cfg = stream_cfg(arrivals={"rate_per_hour": 40, "rate_spread": 0, "warmup_s": 0}, store={"cap": 100_000})
    m = model(cfg, clients=30)
    hours = 48
    counts = np.array([len(all_arrivals(m, k, hours * 3600.0)["arrival"]) for k in range(30)])
    # Sum of 30 Poisson(40 x 48) counts: z-test of the mean, and the dispersion index near 1.
    expected = 40 * hours
    z = (counts.sum() - 30 * expected) / math.sqrt(30 * expected)
    assert abs(z) < 3.5
    assert 0.5 < counts.var(ddof=1) / counts.mean() < 1.7
    gaps = np.diff(all_arrivals(m, 0, hours * 3600.0)["arrival"])
    assert stats.kstest(gaps, "expon", args=(0, 3600 / 40)).pvalue > 0.01


def test_per_client_rates_are_lognormal_around_the_mean() -> None:
    cfg = stream_cfg(arrivals={"rate_per_hour": 10, "rate_spread": 0.7})
    m = model(cfg, clients=4000)
    logs = np.log(m.rates)
    assert abs(np.mean(m.rates) / 10 - 1) < 0.05
    assert abs(logs.std() - 0.7) < 0.03
    assert stats.kstest(logs, "norm", args=(math.log(10) - 0.7**2 / 2, 0.7)).pvalue > 0.01


def test_diurnal_arrivals_follow_the_time_of_day() -> None:
    amp, peak = 0.8, 20.0
    cfg = stream_cfg(
        arrivals={
            "kind": "diurnal",
            "rate_per_hour": 30,
            "rate_spread": 0,
            "diurnal_amplitude": amp,
            "peak_hour": peak,
            "warmup_s": 0,
        },
        store={"cap": 100_000},
    )
    m = model(cfg, clients=10)
    times = np.concatenate([all_arrivals(m, k, 10 * 86400.0)["arrival"] for k in range(10)])
    hours = (times // 3600 % 24).astype(int)
    observed = np.bincount(hours, minlength=24)
    grid = np.linspace(0, 1, 61)[:-1] + 1 / 120  # the expected share of each hour, by its midpoint rule
    h = np.arange(24)[:, None] + grid[None, :]
    density = (1 + amp * np.cos(2 * np.pi * (h - peak) / 24)).mean(axis=1)
    expected = density / density.sum() * observed.sum()
    assert stats.chisquare(observed, expected).pvalue > 0.01
    assert observed.argmax() in (19, 20, 21)


def test_availability_tied_arrivals_only_while_the_device_is_in_use() -> None:
    def in_train_tier(cid: int, t: float) -> bool:
        return (t // 600) % 2 == 0  # available in even 10-minute slots

    cfg = stream_cfg(
        arrivals={"kind": "availability", "tied_to": "unavailable", "warmup_s": 0, "rate_spread": 0},
        store={"cap": 100_000},
    )
    m = model(cfg, tier_at=in_train_tier)
    times = all_arrivals(m, 3, 86400.0)["arrival"]
    z = (len(times) - 30 * 12) / math.sqrt(30 * 12)  # the configured rate, while in use (half the day)
    assert abs(z) < 3.5
    assert not any(in_train_tier(3, t) for t in times)
    with pytest.raises(ValueError, match="availability trace"):
        model(cfg, tier_at=None).client(0)


def test_streams_do_not_depend_on_when_they_are_read() -> None:
    cfg = stream_cfg(
        labels={"delay": "lognormal", "proxy_error": 0.2},
        store={"cap": 50},
        drift={"personal_weight": 0.5, "personal_shifts_per_day": 4},
    )
    a, b = model(cfg, seed=7), model(cfg, seed=7)
    for t in np.sort(np.random.default_rng(0).uniform(0, 20000, 200)):
        a.client(2).snapshot(float(t))
    sa, sb = a.client(2).snapshot(20000.0), b.client(2).snapshot(20000.0)
    np.testing.assert_array_equal(sa.index, sb.index)
    np.testing.assert_array_equal(sa.label, sb.label)
    np.testing.assert_array_equal(sa.arrival, sb.arrival)
    assert not np.array_equal(sa.index, model(cfg, seed=8).client(2).snapshot(20000.0).index)


# ---------------------------------------------------------------------- drift
def test_a_surge_raises_its_classes_to_the_configured_share() -> None:
    cfg = stream_cfg(
        arrivals={"rate_per_hour": 200, "rate_spread": 0, "warmup_s": 0},
        drift={
            "shifts": [{"kind": "surge", "at_s": 3600, "classes": [2, 7], "factor": 9, "duration_s": 3600}]
        },
        store={"cap": 100_000},
    )
    m = model(cfg, clients=10)
    rows = [all_arrivals(m, k, 3 * 3600.0) for k in range(10)]
    times = np.concatenate([r["arrival"] for r in rows])
    labels = np.concatenate([r["label"] for r in rows])
    for lo, hi, share in ((0, 3600, 0.2), (3600, 7200, 18 / 26), (7200, 10800, 0.2)):
        sel = labels[(times >= lo) & (times < hi)]
        observed = np.bincount(sel, minlength=C)
        assert stats.chisquare(observed, m.mix.at((lo + hi) / 2) * len(sel)).pvalue > 0.01
        assert abs(np.isin(sel, [2, 7]).mean() - share) < 0.04
    assert [(s.at_s, s.kind) for s in m.shifts()] == [(3600, "surge"), (7200, "surge_end")]


def test_a_rotation_moves_the_mix_gradually_and_the_samples_follow() -> None:
    cfg = stream_cfg(
        arrivals={"rate_per_hour": 300, "rate_spread": 0, "warmup_s": 0},
        drift={"imbalance": 20, "shifts": [{"kind": "rotate", "at_s": 0, "period_s": 7200, "steps": 3}]},
        store={"cap": 100_000},
    )
    m = model(cfg, clients=10)
    g_half, g1 = m.mix.at(3600.0), m.mix.at(7200.0)
    # One class step later each class has the weight of the next rank; half-way, the average.
    w = m.mix.by_rank / m.mix.by_rank.sum()
    np.testing.assert_allclose(m.mix.at(0.0), w[m.mix.rank], rtol=1e-12)
    np.testing.assert_allclose(g1, w[(m.mix.rank + 1) % C], rtol=1e-12)
    np.testing.assert_allclose(g_half, (w[m.mix.rank] + w[(m.mix.rank + 1) % C]) / 2, rtol=1e-12)
    np.testing.assert_allclose(m.mix.at(30 * 3600.0), w[(m.mix.rank + 3) % C], rtol=1e-12)  # stops after 3
    rows = [all_arrivals(m, k, 4 * 3600.0) for k in range(10)]
    times = np.concatenate([r["arrival"] for r in rows])
    labels = np.concatenate([r["label"] for r in rows])
    sel = (times >= 3 * 3600) & (times < 4 * 3600)
    expected = m.mix.at(times[sel]).sum(axis=0)  # the mix moves within the hour: sum it per sample
    assert stats.chisquare(np.bincount(labels[sel], minlength=C), expected).pvalue > 0.01


def test_personal_interests_shift_at_their_rate() -> None:
    cfg = stream_cfg(
        arrivals={"rate_per_hour": 100, "rate_spread": 0},
        drift={"personal_weight": 1.0, "personal_alpha": 0.2, "personal_shifts_per_day": 0},
        store={"cap": 100_000},
    )
    m = model(cfg, clients=5)
    a = all_arrivals(m, 0, 48 * 3600.0)
    observed = np.bincount(a["label"], minlength=C)
    pref = m.client(0).pref
    assert pref is not None
    assert stats.chisquare(observed, pref * observed.sum() + 1e-9).pvalue > 0.001


# ---------------------------------------------------------------------- labels
@pytest.mark.parametrize("dist", ["exponential", "lognormal", "pareto", "constant"])
def test_label_delays_follow_their_distribution(dist: str) -> None:
    cfg = stream_cfg(labels={"delay": dist, "median_s": 900, "sigma": 1.2, "shape": 2.5}).labels
    d = draw_delays(cfg, np.random.default_rng(3), 20_000)
    assert abs(np.median(d) / 900 - 1) < 0.05
    if dist == "exponential":
        assert stats.kstest(d, "expon", args=(0, 900 / math.log(2))).pvalue > 0.01
    elif dist == "lognormal":
        assert stats.kstest(np.log(d), "norm", args=(math.log(900), 1.2)).pvalue > 0.01
    elif dist == "pareto":
        assert stats.kstest(d, "lomax", args=(2.5, 0, 900 / (2 ** (1 / 2.5) - 1))).pvalue > 0.01
    else:
        assert (d == 900).all()
    assert abs(d.mean() / mean_delay(cfg) - 1) < (0.15 if dist == "pareto" else 0.05)


def test_no_sample_is_trained_on_before_its_label_time() -> None:
    cfg = stream_cfg(labels={"delay": "lognormal", "median_s": 1800, "sigma": 1.5}, store={"cap": 80})
    m = model(cfg)
    seen_unlabelled = False
    for t in np.linspace(0, 40000, 300):
        for k in (0, 5):
            snap = m.client(k).snapshot(float(t))
            assert (snap.label_time <= t).all() and (snap.arrival <= t).all()
            assert snap.proxied == 0
            seen_unlabelled |= snap.held > len(snap)
    assert seen_unlabelled  # the store did hold samples waiting for their labels


def test_proxy_labels_are_wrong_at_the_configured_rate_until_the_true_label_arrives() -> None:
    cfg = stream_cfg(
        arrivals={"rate_per_hour": 400, "rate_spread": 0},
        labels={"delay": "constant", "median_s": 36000, "proxy_error": 0.3},
        store={"cap": 100_000},
    )
    m = model(cfg, clients=3)
    a = all_arrivals(m, 1, 30000.0)
    wrong = a["proxy"] != a["label"]
    assert abs(wrong.mean() - 0.3) < 3 * math.sqrt(0.3 * 0.7 / len(wrong))
    snap = m.client(1).snapshot(30000.0)  # nothing labelled yet: all proxies
    assert snap.proxied == len(snap) > 0
    later = m.client(1).snapshot(36000.0 + 5000.0)
    truth = dict(zip(a["index"].tolist(), a["label"].tolist()))
    known = later.label_time <= 41000.0
    assert known.any()
    # A labelled sample carries its true class (its pool index's class).
    np.testing.assert_array_equal(later.label[known], POOL[later.index[known]])
    assert truth  # the pool indices drawn are of the arrivals' classes
    np.testing.assert_array_equal(POOL[a["index"]], a["label"])


# ---------------------------------------------------------------------- store
def test_store_keeps_the_newest_samples_up_to_its_cap() -> None:
    st = LocalStore(5)
    for start in range(0, 12, 3):
        t = np.arange(start, start + 3, dtype=float)
        st.push(t, t, t.astype(np.int64), np.zeros(3, np.int64), np.zeros(3, np.int64))
    np.testing.assert_array_equal(st.snapshot(100.0, proxy=False).arrival, [7, 8, 9, 10, 11])
    assert st.dropped == 7 and st.size == 5
    big = np.arange(20, 40, dtype=float)
    st.push(big, big, big.astype(np.int64), np.zeros(20, np.int64), np.zeros(20, np.int64))
    np.testing.assert_array_equal(st.snapshot(100.0, proxy=False).arrival, [35, 36, 37, 38, 39])


def test_recency_windows_by_age_and_by_count() -> None:
    st = LocalStore(100)
    t = np.arange(0.0, 50.0)
    st.push(t, t + 10, np.arange(50), np.zeros(50, np.int64), np.ones(50, np.int64))
    snap = st.snapshot(45.0, proxy=False, window_s=20.0)
    np.testing.assert_array_equal(
        snap.arrival, np.arange(26.0, 36.0)
    )  # labelled (by 45) and younger than 20 s
    np.testing.assert_array_equal(st.snapshot(45.0, proxy=False, window_count=4).arrival, [32, 33, 34, 35])
    with_proxy = st.snapshot(45.0, proxy=True, window_count=12)
    np.testing.assert_array_equal(with_proxy.arrival, np.arange(34.0, 46.0))
    assert with_proxy.proxied == 10 and (with_proxy.label[-10:] == 1).all()


def test_memory_is_bounded_by_the_cap() -> None:
    cfg = stream_cfg(arrivals={"rate_per_hour": 500}, store={"cap": 64})
    m = model(cfg, clients=50)
    for t in (3600.0, 5 * 86400.0):
        for k in range(50):
            m.client(k).advance(t)
    assert all(m.client(k).store.size <= 64 for k in range(50))
    assert m.held_bytes() < 50 * (64 + 600) * 40  # the stores and at most an hour's block pending


# ---------------------------------------------------------------------- freshness
def test_recovery_time_on_a_hand_made_trace() -> None:
    t = np.arange(0.0, 100.0, 10.0)
    acc = np.array([0.80, 0.82, 0.80, 0.82, 0.50, 0.60, 0.70, 0.795, 0.81, 0.82])
    # Level over [10, 40): mean(0.82, 0.80, 0.82) = 0.8133; within 0.02 from 0.7933: at t = 70.
    level, rec = recovery_time(t, acc, 40.0, 0.02, 30.0, 100.0)
    assert level == pytest.approx(0.81333333)
    assert rec == pytest.approx(30.0)
    assert recovery_time(t, acc, 40.0, 0.005, 30.0, 100.0)[1] == pytest.approx(40.0)  # 0.81 >= 0.8083
    assert recovery_time(t, acc, 40.0, 0.001, 30.0, 100.0)[1] == pytest.approx(50.0)  # 0.82 >= 0.8123
    assert recovery_time(t, acc, 40.0, 0.005, 30.0, 75.0)[1] is None  # not before the next shift
    assert recovery_time(t, acc, 20.0, 0.02, 30.0, 100.0)[1] == 0.0  # never left the level
    assert recovery_time(t, acc, 0.0, 0.02, 30.0, 100.0) == (None, None)  # no level before it


def test_freshness_tracker_state_survives_a_checkpoint(tmp_path: Path) -> None:
    """The tracker's evaluations (per-class accuracy and loss, NaN for a class without test
    samples) and the newest data behind the model go through the server's checkpoint format, so
    a resumed MQTT server continues the curve and its summary instead of starting afresh."""
    per_class = iter(
        [(np.array([0.5, np.nan, 0.7]), np.array([1.0, np.nan, 2.0])), (np.ones(3), np.zeros(3))]
    )

    def track() -> FreshnessTracker:
        return FreshnessTracker(
            lambda w: next(per_class), lambda t: np.array([0.2, 0.3, 0.5]), [], 0.02, 600.0, 60.0
        )

    before = track()
    ckpt.save_checkpoint(tmp_path / "empty", {"f": before.state_dict()})
    track().load_state_dict(ckpt.load_checkpoint(tmp_path / "empty")["f"])  # no evaluation yet
    before.evaluate_at(10.0, 1, np.zeros(3))
    before.newest_data = 4.0
    before.evaluate_at(70.0, 2, np.zeros(3))
    ckpt.save_checkpoint(tmp_path / "ck", {"f": before.state_dict()})
    after = track()
    after.load_state_dict(ckpt.load_checkpoint(tmp_path / "ck")["f"])
    assert [(e.time_s, e.version, e.newest_data) for e in after.evals] == [(10.0, 1, None), (70.0, 2, 4.0)]
    assert np.array_equal(after.evals[0].acc, before.evals[0].acc, equal_nan=True)
    assert after.summary(120.0) == before.summary(120.0)
    curves = [t.curve(120.0) for t in (before, after)]
    assert all(np.array_equal(curves[0][k], curves[1][k], equal_nan=True) for k in curves[0])
    bad = {**before.state_dict(), "version": np.array([1])}
    with pytest.raises(ValueError, match="differ in length"):
        after.load_state_dict(bad)


def test_time_average_of_a_step_curve() -> None:
    assert time_average(np.array([0.0, 10.0, 30.0]), np.array([1.0, 0.0, 0.5]), 40.0) == pytest.approx(
        (10 * 1 + 20 * 0 + 10 * 0.5) / 40
    )


# ---------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("stream", "message"),
    [
        (
            {"arrivals": {"rate_per_hour": -1}},
            "stream.arrivals.rate_per_hour: Input should be greater than or equal to 0",
        ),
        ({"labels": {"delay": "pareto", "shape": 1.0}}, "no finite mean"),
        ({"labels": {"proxy_error": 1.5}}, "stream.labels.proxy_error"),
        ({"store": {"cap": 0}}, "stream.store.cap"),
        ({"drift": {"shifts": [{"kind": "surge", "at_s": 10}]}}, "a surge needs the classes"),
        ({"drift": {"shifts": [{"kind": "rotate", "at_s": 10}]}}, "set drift.imbalance above 1"),
        (
            {"drift": {"shifts": [{"kind": "surge", "at_s": 10, "classes": [-2]}]}},
            "greater than or equal to 0",
        ),
    ],
)
def test_bad_stream_settings_are_refused_with_one_line(stream: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate({"stream": {"enabled": True, **stream}})
    lines = str(err.value).splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_a_shift_to_an_unknown_class_is_refused() -> None:
    cfg = stream_cfg(drift={"shifts": [{"kind": "surge", "at_s": 10, "classes": [3, 12]}]})
    with pytest.raises(
        ConfigError, match=r"shifts\[0\].classes: class 12 is not one of the dataset's 10 classes"
    ):
        model(cfg)


def test_a_config_without_streams_is_written_as_before() -> None:
    assert "stream" not in validate({}).model_dump()
    assert validate({"stream": {"enabled": True}}).model_dump()["stream"]["enabled"] is True


# ---------------------------------------------------------------------- TierFuse on streams
def test_tierfuse_data_age_option_weighs_fresher_data_more_and_is_off_by_default() -> None:
    from felix.core.types import BufferedUpdate, ClientUpdate
    from felix.strategies.aggregation.tierfuse import TierFuseAggregator, TierFuseParams

    def item(span: tuple[float, float] | None) -> BufferedUpdate:
        upd = ClientUpdate(10, 0.0, 0.0, 1.0, np.zeros(3, np.float32), data_span=span)
        return BufferedUpdate(0, 0, 0, 5000.0, upd, 0)

    fresh, old, none = item((100.0, 5000.0)), item((100.0, 1400.0)), item(None)
    paper = TierFuseAggregator()
    assert paper.weights([fresh, old, none]) == pytest.approx([0.7, 0.7, 0.7])  # sigma + (1-sigma) beta(0)
    aware = TierFuseAggregator(TierFuseParams(freshness="data_age", age_half_life_s=1800.0))
    # Age 0 keeps 0.7; age 3600 s = two half-lives: 0.7 / 4; no span (no stream): unchanged.
    assert aware.weights([fresh, old, none]) == pytest.approx([0.7, 0.175, 0.7])
    with pytest.raises(ValueError, match="age_half_life_s"):
        TierFuseParams(freshness="data_age", age_half_life_s=0.0)


def test_a_result_carries_its_data_span_over_the_wire_only_on_streams() -> None:
    from felix.core.types import ClientUpdate, TaskKind
    from felix.deploy import wire

    def result(span: tuple[float, float] | None) -> bytes:
        return wire.encode(
            wire.Result(
                run="r",
                msg_id="m-1",
                sent_at=1.0,
                client=3,
                incarnation="i",
                task=7,
                kind=TaskKind.TRAIN,
                version=2,
                update=ClientUpdate(
                    num_samples=5,
                    stat_utility=1.0,
                    loss=0.5,
                    duration=2.0,
                    delta=np.zeros(4, np.float32),
                    data_span=span,
                ),
            )
        )

    msg = wire.decode(result((-120.5, 300.25)))
    assert isinstance(msg, wire.Result) and msg.update.data_span == (-120.5, 300.25)
    plain = result(None)
    assert b"span" not in plain and wire.decode(plain).update.data_span is None  # type: ignore[union-attr]
    assert len(result((0.0, 1.0))) == len(plain) + 16 + len(b',{"name":"span","dtype":"<f8","shape":[2]}')


def test_a_task_takes_its_data_when_it_first_starts_and_keeps_it_through_a_pause() -> None:
    import torch

    from felix.client.trainer import ClientData
    from felix.core.types import TaskKind, Tier
    from felix.engine.device import DeviceRunner, TaskRules

    class Feed:
        def __init__(self) -> None:
            self.asked: list[float] = []

        def data_at(self, now: float) -> tuple[ClientData, tuple[float, float] | None]:
            self.asked.append(now)
            n = int(now)
            return ClientData(torch.zeros(n, 2), torch.zeros(n, dtype=torch.int64)), (0.0, now)

    feed = Feed()
    dev: DeviceRunner[object] = DeviceRunner(
        0, ClientData(torch.zeros(0, 2), torch.zeros(0, dtype=torch.int64)), 10.0, Tier.UN_AVL, feed=feed
    )
    rules = TaskRules()
    dev.receive(3.0, 1, TaskKind.TRAIN, np.zeros(2, np.float32), rules)  # queued: the tier forbids it
    assert feed.asked == []
    dev.set_tier(5.0, Tier.AVL_TRAIN)  # starts now
    assert feed.asked == [5.0] and len(dev.data) == 5
    dev.set_tier(8.0, Tier.UN_AVL)  # paused
    step = dev.set_tier(20.0, Tier.AVL_TRAIN)  # resumed: same data, no new read
    assert feed.asked == [5.0] and len(dev.data) == 5
    assert step is not None and step.timer is not None
    task = dev.complete(step.timer.token)
    assert task is not None and task.data_span == (0.0, 5.0)
