"""The soak benchmark's shortest version (``benchmarks/soak.py --tiny``): a server and 12 emulated
clients under churn while a client group, the broker and the server are each killed with SIGKILL
(and come back), and a hostile client sends 150 fuzzed messages and poisoning attempts."""

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

pytestmark = needs_mosquitto
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
