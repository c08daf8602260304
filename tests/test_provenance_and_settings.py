"""Settings YAML could mistype, trace offsets, and the provenance every summary carries."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from felix.config import ConfigError, load_yaml, parse_set, read_yaml, validate
from felix.core.types import Tier
from felix.engine.setup import resolve_config
from felix.scenario.traces import AvailabilityTrace, DeviceTrace
from felix.sim.run import run_config


@pytest.mark.parametrize("text", ["3_75", "3_50", "2", "failures_48h"])
def test_trace_series_from_set_is_the_series_named(text: str) -> None:
    sets = parse_set(["trace.kind=mobiperf", "trace.path=t.json", f"trace.series={text}"])
    assert validate(sets).trace.series == text


def test_yaml_12_scalars() -> None:
    doc = load_yaml("a: 1_000\nb: 1e4\nc: on\nd: 0x10\ne: [1, 2.5, null, true]\nf: 1:30\n")
    assert doc == {"a": "1_000", "b": 1e4, "c": "on", "d": 16, "e": [1, 2.5, None, True], "f": "1:30"}


def test_number_given_for_a_string_setting_is_its_text() -> None:
    assert validate(parse_set(["name=2024"])).name == "2024"
    with pytest.raises(ConfigError, match="trace.series"):
        validate(parse_set(["trace.series=375"]))


def _trace(events: list[tuple[float, Tier]], period: float | None = None) -> DeviceTrace:
    return DeviceTrace.from_events(events, period, initial=events[0][1])


def test_offset_shifts_an_aperiodic_trace() -> None:
    d = _trace([(0, Tier.AVL_TRAIN), (300, Tier.UN_AVL), (1000, Tier.AVL_EVAL), (2000, Tier.AVL_TRAIN)])
    s = d.shifted(500)
    for t in [0, 1, 499, 500, 1499, 1500, 5000]:
        assert s.tier_at(t) == d.tier_at(t + 500), t
    assert s.next_change(0) == (500.0, Tier.AVL_EVAL)


def test_offset_rotates_a_periodic_trace() -> None:
    d = _trace(
        [(0, Tier.AVL_TRAIN), (100, Tier.UN_AVL), (250, Tier.AVL_TRAIN), (400, Tier.UN_AVL)], period=500
    )
    for off in [0, 50, 100, 260, 499, 500, 1234]:
        s = d.shifted(off)
        assert s.period == 500
        for t in np.arange(0, 1600, 7.0):
            assert s.tier_at(float(t)) == d.tier_at(float(t) + off), (off, t)


def test_offset_applies_to_every_device_and_rejects_negative() -> None:
    tr = AvailabilityTrace(
        (_trace([(0, Tier.AVL_TRAIN), (10, Tier.UN_AVL)]), _trace([(0, Tier.UN_AVL), (20, Tier.AVL_TRAIN)])),
        "t",
    )
    s = tr.shifted(15)
    assert [s.tier_at(k, 0) for k in range(2)] == [Tier.UN_AVL, Tier.UN_AVL]
    assert s.tier_at(1, 5) is Tier.AVL_TRAIN
    with pytest.raises(ValueError, match="offset"):
        tr.devices[0].shifted(-1)
    with pytest.raises(ConfigError, match="trace.offset_s"):
        validate(parse_set(["trace.offset_s=-5"]))


def test_summary_records_provenance() -> None:
    cfg = resolve_config(
        None, "fedbuff", parse_set(["partition.num_clients=8", "run.max_aggregations=2", "run.threads=1"])
    )
    prov = run_config(cfg, plots=False).summary["provenance"]
    import torch

    assert prov["torch"] == torch.__version__ and prov["torch_threads"] >= 1
    assert prov["run"]["threads"] == 1 and prov["run"]["device"] == "cpu"
    assert prov["felix_version"]
    assert prov["git"] is None or len(prov["git"]["commit"]) == 40
    # The CPU and the kernels torch dispatches to: the same seed rounds differently across them.
    assert prov["cpu"] and prov["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()


@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        ("seed=-1", "seed: Input should be greater than or equal to 0"),
        ("seed=4294967296", "seed: Input should be less than or equal to 4294967295"),
        ("run.device=gpu0", "run.device: 'gpu0' is not a torch device"),
        ("run.device=meta", "run.device: 'meta' tensors hold no data"),
        ("client.lr=.inf", "client.lr: Input should be a finite number"),
        ("run.max_time_s=.inf", "run.max_time_s: Input should be a finite number"),
        ("trace.offset_s=.nan", "trace.offset_s: Input should be a finite number"),
    ],
)
def test_a_seed_device_or_number_that_cannot_run_is_a_config_error(setting: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        validate(parse_set([setting]))


def test_the_largest_seed_runs() -> None:
    """seed * 1,000,003 + task id seeds each task's torch generator, a 64-bit integer."""
    cfg = resolve_config(
        None, "fedbuff", parse_set(["partition.num_clients=8", "run.max_aggregations=1", "seed=4294967295"])
    )
    assert run_config(cfg, plots=False).summary["aggregations"] == 1


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a CUDA device")
def test_a_device_missing_here_is_named_before_any_data_is_loaded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from felix.cli import main

    # The dataset's folder is empty: the device check comes first.
    args = [
        "run",
        "--set",
        "run.device=cuda",
        "--set",
        "dataset.name=cifar10",
        "--set",
        f"dataset.root={tmp_path}",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "run.device 'cuda' is not usable here" in err and "Traceback" not in err


def test_a_config_file_that_is_not_yaml_text_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        read_yaml(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="Is a directory"):
        read_yaml(tmp_path)
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="bin.yaml: not a UTF-8 text file"):
        read_yaml(tmp_path / "bin.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="the top level must be a mapping"):
        read_yaml(tmp_path / "list.yaml")


@pytest.mark.parametrize("command", ["run", "compare", "sweep"])
def test_an_output_folder_that_cannot_be_made_is_named_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    from felix.cli import main

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    args = [command, "--set", "run.max_aggregations=1", "--out", str(a_file / "out")]
    assert main(args + (["--strategies", "fedbuff"] if command == "compare" else [])) == 2
    err = capsys.readouterr().err
    assert f"output folder {a_file / 'out'}: " in err and "Traceback" not in err


def test_result_files_record_portable_paths_and_commands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A result's command and file name no machine's absolute paths: felix's entry point is
    ``felix``, a shipped file is named under ``felix/``, a file below the working directory
    relative to it, and any other absolute path by its name."""
    from felix.metrics.provenance import portable_command, portable_path
    from felix.presets import CONFIG_DIR

    monkeypatch.chdir(tmp_path)
    shipped = CONFIG_DIR / "comparisons" / "federage.yaml"
    assert portable_path(shipped) == "felix/configs/comparisons/federage.yaml"
    assert portable_path(tmp_path / "runs" / "x.yaml") == "runs/x.yaml"
    assert portable_path("rel/x.yaml") == "rel/x.yaml"
    assert portable_path("/elsewhere/else/x.yaml") == "x.yaml"
    main = str(Path(__import__("felix").__file__).parent / "__main__.py")
    assert portable_command([main, "federage-compare", "--out", str(tmp_path / "o")]) == [
        "felix",
        "federage-compare",
        "--out",
        "o",
    ]
