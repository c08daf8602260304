import json
import os
from pathlib import Path

import numpy as np
import pytest

from felix.core.types import Tier
from felix.scenario.traces import (
    DeviceTrace,
    TraceError,
    always_available,
    load_fedscale,
    load_mobiperf,
    slotted_churn,
)

# The MobiPerf trace: under $FELIX_TRACES, else in the development setup's ../shared/traces.
SHARED_TRACE = str(Path(os.environ.get("FELIX_TRACES", "../shared/traces")) / "mobiperf-300.json")


def test_step_function_last_event_at_same_time_wins_and_merges_neighbours():
    d = DeviceTrace.from_events(
        [(0, Tier.AVL_TRAIN), (5, Tier.UN_AVL), (5, Tier.AVL_TRAIN), (9, Tier.AVL_EVAL)]
    )
    assert d.times.tolist() == [0.0, 9.0]
    assert d.tier_at(4.9) is Tier.AVL_TRAIN and d.tier_at(9) is Tier.AVL_EVAL
    assert d.next_change(0) == (9.0, Tier.AVL_EVAL) and d.next_change(9) is None


def test_periodic_trace_wraps_like_fedscale():
    d = DeviceTrace.from_events([(10, Tier.AVL_TRAIN), (20, Tier.UN_AVL)], period=30.0, initial=Tier.UN_AVL)
    assert d.tier_at(45) is Tier.AVL_TRAIN and d.tier_at(55) is Tier.UN_AVL
    assert d.next_change(25) == (40.0, Tier.AVL_TRAIN)
    assert d.available_throughout(41, 49) and not d.available_throughout(41, 51)


def test_slotted_churn_hits_the_unavailable_fraction_per_slot():
    tr = slotted_churn(200, 0.5, np.random.default_rng(1), slot_s=600, horizon_s=6000)
    for t in (0, 650, 5999):
        down = sum(tr.tier_at(c, t) is Tier.UN_AVL for c in range(200))
        assert down == 100
    assert tr.tier_at(7, 100.0) is tr.tier_at(7, 6100.0)  # repeats after the horizon


def test_round_robin_reuse_of_devices():
    tr = always_available(1)
    assert tr.for_client(0) is tr.for_client(57)


@pytest.mark.skipif(
    not Path(SHARED_TRACE).exists(),
    reason="needs the MobiPerf trace: set FELIX_TRACES to the folder that holds mobiperf-300.json",
)
def test_real_mobiperf_trace_loads_all_series():
    for series in ("2", "3_50", "3_75", "failures_48h"):
        tr = load_mobiperf(SHARED_TRACE, series)
        assert len(tr.devices) == 300
    tr = load_mobiperf(SHARED_TRACE, "3_50")
    # the authors' traces start with an all-available head
    assert all(tr.tier_at(c, 10.0) is Tier.AVL_TRAIN for c in range(300))
    later = [tr.tier_at(c, 20000.0) for c in range(300)]
    assert 0 < later.count(Tier.AVL_TRAIN) < 150 and Tier.AVL_EVAL in later


@pytest.mark.parametrize(
    "devices, needle",
    [
        (
            {"7": {"avl_events_3_state_50": [[0, "AVL_TRAIN"], [5, "SLEEPING"]]}},
            "device 7, event 1: unknown tier",
        ),
        ({"7": {"avl_events_3_state_50": [[0, "AVL_TRAIN"], [-5, "UN_AVL"]]}}, "device 7, event 1: bad time"),
        (
            {"7": {"avl_events_3_state_50": [[9, "AVL_TRAIN"], [5, "UN_AVL"]]}},
            "device 7, event 1: time 5 goes back",
        ),
        ({"7": {"avl_events_3_state_50": [[0]]}}, "device 7, event 0: expected [t_seconds, tier]"),
        ({"7": {"avl_events_2_state": []}}, "device 7: missing or empty"),
    ],
)
def test_malformed_trace_names_device_and_event(tmp_path, devices, needle):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"devices": devices}))
    with pytest.raises(TraceError) as e:
        load_mobiperf(p, "3_50")
    assert needle in str(e.value)


def test_missing_and_non_json_trace(tmp_path):
    with pytest.raises(TraceError, match="not found"):
        load_mobiperf(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{oops")
    with pytest.raises(TraceError, match="not a JSON trace"):
        load_mobiperf(tmp_path / "bad.json")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")  # not UTF-8
    with pytest.raises(TraceError, match="binary.json: not a JSON trace"):
        load_mobiperf(tmp_path / "binary.json")
    with pytest.raises(TraceError, match="not a JSON trace"):
        load_mobiperf(tmp_path)  # a folder


def test_a_damaged_fedscale_pickle_is_a_trace_error(tmp_path):
    """A pickle damaged in transit fails inside the unpickler in many ways (EOF, overflow, a
    type or attribute error from a mangled opcode): each is a TraceError naming the file."""
    import pickle
    import random

    good = pickle.dumps({"1": {"active": [0, 30], "inactive": [10, 40], "finish_time": 100}})
    rng = random.Random(0)
    p = tmp_path / "behave.pkl"
    kinds = set()
    for _ in range(400):
        damaged = bytearray(good)
        for _ in range(rng.randrange(1, 4)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        p.write_bytes(bytes(damaged))
        try:
            load_fedscale(p)
        except TraceError as exc:
            assert "behave.pkl" in str(exc)
            kinds.add(str(exc).split("(")[-1].split(":")[0])
    assert len(kinds) > 3  # several of the unpickler's failure types were met, and each became a TraceError


def test_fedscale_format_json_and_plain_pickle(tmp_path):
    import pickle

    doc = {1: {"active": [10, 50], "inactive": [20, 60], "finish_time": 100, "duration": 5}}
    p = tmp_path / "behave.pkl"
    p.write_bytes(pickle.dumps(doc))
    tr = load_fedscale(p)
    assert tr.tier_at(0, 15) is Tier.AVL_TRAIN and tr.tier_at(0, 30) is Tier.UN_AVL
    assert tr.tier_at(0, 115) is Tier.AVL_TRAIN  # wraps at finish_time
    j = tmp_path / "behave.json"
    j.write_text(json.dumps({"1": {"active": [10], "inactive": [5], "finish_time": 100}}))
    with pytest.raises(TraceError, match="client 1, interval 0"):
        load_fedscale(j)


def test_fedscale_pickle_with_code_is_refused(tmp_path):
    import pickle

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    p = tmp_path / "evil.pkl"
    p.write_bytes(pickle.dumps({1: Evil()}))
    with pytest.raises(TraceError, match="refusing to load"):
        load_fedscale(p)
