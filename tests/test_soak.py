"""The soak benchmark's shortest version (``benchmarks/soak.py --tiny``): a server and 12 emulated
clients under churn while a client group, the broker and the server are each killed with SIGKILL
(and come back), and a hostile client sends 150 fuzzed messages and poisoning attempts; before
that, a flapping client (200 tier flips a second), a flooding one (1,000 a second), a slow
flipper (26 changes per config minute) and a heavy-header sender (64 KiB headers, 200 a second)
attack for 10 s while the honest aggregation rate is compared with a quiet window; an
aux-poisoning client answers its training tasks with a 1e30 SCAFFOLD entry all along, and two
clients with utilities of 1.7e308 and 1e36; before the server's resume, a login publishes 70 x 1
MB on its result topic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from mqtt_support import (
    needs_mosquitto,
    one_torch_thread,  # noqa: F401  (a fixture)
)

pytestmark = [*needs_mosquitto, pytest.mark.slow]  # a soak: after the default suite (.ci/run)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    keep = tmp_path_factory.mktemp("soak")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--tiny", "--keep", str(keep)],
        capture_output=True,
        text=True,
        timeout=420,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = done.stdout.strip().splitlines()[-1]
    result = json.loads(line)
    assert set(result) == {
        "acked_lost",
        "applied_twice",
        "server_crashes",
        "bad_updates_applied",
        "poisoning_attempts",
        "rss_start_mb",
        "rss_end_mb",
        "tier_msgs_per_s",
        "round_trips_per_s",
        "aux_poisoning_attempts",
        "attack_msgs_per_s",
        "attack_bytes_up",
        "attack_bytes_down",
        "amplification",
        "amplification_bound",
        "flapper_amplification",
        "versions_per_s_quiet",
        "versions_per_s_attack",
        "updates_per_s_quiet",
        "updates_per_s_attack",
        "throughput_ratio",
        "rate_limited",
        "damped",
        "slow_flips",
        "slow_flipper_amplification",
        "slow_flipper_messages_down",
        "slow_flipper_broker_amplification",
        "slow_flipper_http_bytes_down",
        "model_http",
        "heavy_headers_sent",
        "extreme_utility_answers",
        "resume_after_backlog_s",
        "cost_limited",
    }
    return result  # type: ignore[no-any-return]


def test_soak_loses_nothing_and_applies_nothing_twice(soak: dict[str, Any]) -> None:
    assert soak["acked_lost"] == 0 and soak["applied_twice"] == 0, soak
    assert soak["round_trips_per_s"] > 0 and soak["tier_msgs_per_s"] > 0, soak


def test_soak_no_crash_and_no_poison_applied(soak: dict[str, Any]) -> None:
    assert soak["server_crashes"] == 0 and soak["bad_updates_applied"] == 0, soak
    assert soak["poisoning_attempts"] > 0, soak  # the hostile client got training tasks to poison
    # Without crashes, the last life runs long enough to compare memory (a crash loop's lives do not).
    assert soak["rss_end_mb"] < 1.2 * soak["rss_start_mb"], soak


def test_soak_aux_poisoning_is_refused(soak: dict[str, Any]) -> None:
    assert soak["aux_poisoning_attempts"] > 0, soak  # it got training tasks to poison
    assert soak["bad_updates_applied"] == 0, soak


def test_soak_attack_is_bounded(soak: dict[str, Any]) -> None:
    """What the flapping and flooding clients are sent stays within what admission control allows
    (the bound: one task per accepted change to an available tier and one cancel per task, until
    damping after 100 changes a minute, and at most the task budget), and the honest aggregation
    rate under the attack keeps at least half of the quiet window's (without admission control a
    5,000 flips/s flood took it from 14.0 to 5.6 versions/s, a ratio of 0.4)."""
    assert soak["rate_limited"] > 0 and soak["damped"] >= 1, soak
    assert 0 < soak["amplification"] <= soak["amplification_bound"], soak
    assert soak["amplification"] < 1.0, soak  # the attackers are sent less than they send
    assert soak["versions_per_s_quiet"] > 0, soak
    assert soak["throughput_ratio"] >= 0.5, soak


def test_soak_slow_flipper_heavy_headers_extreme_utilities_and_a_backlog(soak: dict[str, Any]) -> None:
    """A tier flipper under the flap limit (26 changes per config minute) is sent at most what the
    drop budget allows over the window (about 220 config seconds: 2 + 1 unanswered downloads, one
    more it may hold at the end, and a cancel each), not a task per flip; 64 KiB headers and
    utilities of 1.7e308 and 1e36 break nothing (no crash, the 1.7e308 answers are never
    applied); a resume after 70 x 1 MB queued on a login's result topic serves. (The bytes
    ratio, 3x at most for the issue's 200 flips, is the ``--quick`` soak's figure: over the tiny
    window's 88 flips three downloads already outweigh them.)"""
    assert soak["slow_flips"] >= 50, soak
    assert 0 < soak["slow_flipper_messages_down"] <= 2 * (2 + 1 + 1), soak
    assert soak["heavy_headers_sent"] > 0, soak
    assert soak["server_crashes"] == 0 and soak["bad_updates_applied"] == 0, soak
    assert soak["resume_after_backlog_s"] is not None and soak["resume_after_backlog_s"] < 120, soak
