"""Speech: WAV reading and its errors, log-mel features against an independent numpy computation,
the FSDD and Speech Commands loaders on clips written here, the speaker partition, the speech
models (ResNet34-1D's parameter count, cohorts), the speech scenarios' first aggregations, and the
real clips in $FELIX_DATA when they are there."""

from __future__ import annotations

import math
import os
import struct
import tarfile
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from felix.client.cohort import CohortTask, CohortTrainer, cohort_blocker
from felix.client.stacked_chain import StackedChain, masked_ce_grad
from felix.client.trainer import ClientData, LocalTrainer, TrainConfig
from felix.client.weights import model_vector
from felix.config import ConfigError
from felix.engine.setup import resolve_config
from felix.experiments.compare import load_comparison, variant_config
from felix.scenario.audio import (
    SPEECH_COMMANDS_V1,
    SPEECH_COMMANDS_V2,
    Features,
    log_mel,
    mel_filterbank,
    read_wav,
)
from felix.scenario.build import build_population
from felix.scenario.datasets import DatasetError, load_dataset
from felix.scenario.models import make_model
from felix.scenario.partition import speaker_partition
from felix.sim.run import run_config
from felix.strategies.objectives import make_objective

DATA = os.environ.get("FELIX_DATA")
FSDD = Path(DATA or ".") / "fsdd.tar.gz"
SC_SAMPLE = Path(DATA or ".") / "speech-commands-sample.tar.gz"
REAL_DATA_REASON = "needs $FELIX_DATA with {} (README.md, 'Data and traces': where to get the datasets)"


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FELIX_CACHE", str(tmp_path / "cache"))


def write_wav(path: Path, samples: np.ndarray, rate: int, width: int = 2, channels: int = 1) -> Path:
    """``samples`` in [-1, 1] (frames x channels or frames) as a PCM WAV of ``width``-byte samples."""
    path.parent.mkdir(parents=True, exist_ok=True)
    x = np.asarray(samples, dtype=np.float64).reshape(len(samples), -1)
    if width == 1:
        raw = np.round(x * 127 + 128).astype(np.uint8).tobytes()
    else:
        raw = np.round(x * (2 ** (8 * width - 1) - 1)).astype(f"<i{width}").tobytes()
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)
    return path


def tone(freq: float, rate: int, seconds: float, amp: float = 0.5) -> np.ndarray:
    return amp * np.sin(2 * np.pi * freq * np.arange(round(rate * seconds)) / rate)


# ---------------------------------------------------------------------- WAV files
def test_pcm_wav_files_read_back(tmp_path: Path) -> None:
    x = tone(440.0, 8000, 0.1)
    for width in (1, 2, 4):
        got = read_wav(write_wav(tmp_path / f"w{width}.wav", x, 8000, width), 8000)
        assert got.dtype == np.float32 and got.shape == x.shape
        assert np.abs(got - x).max() < (0.01 if width == 1 else 1e-4)
    stereo = np.stack([x, -x], axis=1)
    assert np.abs(read_wav(write_wav(tmp_path / "st.wav", stereo, 8000, 2, 2), 8000)).max() < 1e-4


def _float_wav(path: Path) -> Path:
    """A valid IEEE-float WAV (format tag 3), which is not PCM."""
    data = np.zeros(100, "<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, 8000, 32000, 4, 32)
    body = (
        b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    )
    path.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)
    return path


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda p: _float_wav(p), "not a readable PCM WAV file"),
        (lambda p: p.write_bytes(b"RIFF nonsense") and p, "not a readable PCM WAV file"),
        (
            lambda p: write_wav(p, tone(100.0, 16000, 0.05), 16000),
            "sample rate 16000 Hz, the dataset's is 8000 Hz",
        ),
    ],
)
def test_bad_audio_is_one_line_naming_the_file(tmp_path: Path, make, needle: str) -> None:
    path = tmp_path / "clip.wav"
    make(path)
    with pytest.raises(DatasetError, match=needle) as err:
        read_wav(path, 8000)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------------- features
def _reference_filterbank(rate: int, n_fft: int, n_mels: int, f_min: float, f_max: float) -> np.ndarray:
    """Triangles on the HTK mel scale, filter by filter and bin by bin (no vector code shared)."""
    mel = lambda f: 2595.0 * math.log10(1.0 + f / 700.0)
    hz = lambda m: 700.0 * (10.0 ** (m / 2595.0) - 1.0)
    step = (mel(f_max) - mel(f_min)) / (n_mels + 1)
    edges = [hz(mel(f_min) + i * step) for i in range(n_mels + 2)]
    fb = np.zeros((n_fft // 2 + 1, n_mels))
    for m in range(n_mels):
        left, centre, right = edges[m], edges[m + 1], edges[m + 2]
        for k in range(n_fft // 2 + 1):
            f = k * rate / n_fft
            if left <= f <= centre:
                fb[k, m] = (f - left) / (centre - left)
            elif centre < f <= right:
                fb[k, m] = (right - f) / (right - centre)
    return fb


def _reference_log_mel(
    x: np.ndarray, rate: int, win: int, hop: int, n_fft: int, fb: np.ndarray
) -> np.ndarray:
    """Centred frames of a periodic Hann window (padded to n_fft in the middle), |rfft|^2, filters, log."""
    window = np.zeros(n_fft)
    left = (n_fft - win) // 2
    window[left : left + win] = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(win) / win)
    padded = np.concatenate([np.zeros(n_fft // 2), x, np.zeros(n_fft // 2)])
    frames = [padded[t * hop : t * hop + n_fft] for t in range(1 + len(x) // hop)]
    power = np.abs(np.fft.rfft(np.array(frames) * window, axis=1)) ** 2  # frames x bins
    return np.log(power @ fb + 1e-6).T


def test_mel_filterbank_matches_an_independent_construction() -> None:
    for rate, n_fft, n_mels, lo, hi in ((16000, 512, 40, 20.0, 8000.0), (8000, 256, 24, 0.0, 3000.0)):
        got = mel_filterbank(rate, n_fft, n_mels, lo, hi).double().numpy()
        assert np.abs(got - _reference_filterbank(rate, n_fft, n_mels, lo, hi)).max() < 1e-5


def test_log_mel_matches_numpy_and_puts_a_tone_in_its_band() -> None:
    rate, feats = 16000, Features("logmel", n_mels=40, win_ms=25.0, hop_ms=10.0)
    win, hop, n_fft = feats.frames(rate)
    assert (win, hop, n_fft) == (400, 160, 512)
    rng = np.random.default_rng(0)
    x = np.stack(
        [tone(1000.0, rate, 0.5) + 0.01 * rng.standard_normal(8000), rng.standard_normal(8000) * 0.1]
    )
    got = log_mel(torch.from_numpy(x.astype(np.float32)), rate, feats).double().numpy()
    fb = _reference_filterbank(rate, n_fft, 40, 20.0, rate / 2)
    for i in range(2):
        want = _reference_log_mel(x[i], rate, win, hop, n_fft, fb)
        assert got[i].shape == want.shape == (40, 51)
        assert np.abs(got[i] - want).max() < 1e-3
    # A 1 kHz tone lands in the band whose centre is nearest 1 kHz on the HTK mel scale.
    mel = lambda f: 2595.0 * np.log10(1.0 + f / 700.0)
    centres = 700.0 * (10 ** (np.linspace(mel(20.0), mel(8000.0), 42)[1:-1] / 2595.0) - 1)
    assert int(np.argmax(got[0][:, 10:40].mean(axis=1))) == int(np.argmin(np.abs(centres - 1000.0)))


# ---------------------------------------------------------------------- datasets
def make_fsdd(root: Path, speakers: tuple[str, ...] = ("ann", "bob", "cy"), per: int = 2) -> Path:
    """``root/recordings/{digit}_{speaker}_{i}.wav``: short tones, a pitch per digit, 8 kHz."""
    for d in range(10):
        for s, spk in enumerate(speakers):
            for i in range(per):
                x = tone(200.0 + 150.0 * d + 7.0 * s, 8000, 0.3 + 0.1 * i)
                write_wav(root / "recordings" / f"{d}_{spk}_{i}.wav", x, 8000)
    return root


def test_fsdd_holds_out_speakers_and_caches_its_features(tmp_path: Path) -> None:
    root = make_fsdd(tmp_path / "fsdd")
    params = {"test_speakers": ["cy"], "n_mels": 16, "win_ms": 32.0, "hop_ms": 32.0}
    train, test = load_dataset("fsdd", str(root), params=params)
    assert train.sample_shape == (1, 16, 32) and len(train) == 40 and len(test) == 20
    assert train.classes == [str(d) for d in range(10)] and (train.class_counts() == 4).all()
    assert train.groups is not None and test.groups is not None
    assert set(train.groups.tolist()) == {0, 1} and set(test.groups.tolist()) == {2}
    # Standardised per mel band with the training set's statistics.
    assert train.x.mean(dim=(0, 1, 3)).abs().max() < 1e-4
    assert list((tmp_path / "cache").glob("audio-*.npz"))
    again, _ = load_dataset("fsdd", str(root), params=params)
    assert torch.equal(again.x, train.x)
    wave_train, _ = load_dataset("fsdd", str(root), params={**params, "features": "waveform", "clip_s": 0.5})
    assert wave_train.sample_shape == (1, 4000)
    one_name, _ = load_dataset("fsdd", str(root), params={**params, "test_speakers": "cy"})
    assert torch.equal(one_name.x, train.x)


def test_fsdd_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        load_dataset("fsdd", str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no recordings"):
        load_dataset("fsdd", str(tmp_path / "empty"))
    root = make_fsdd(tmp_path / "fsdd", per=1)
    with pytest.raises(DatasetError, match="must be some, not all"):
        load_dataset("fsdd", str(root), params={"test_speakers": ["zed"]})
    (root / "recordings" / "3_ann_0.wav").unlink()
    (root / "recordings" / "3_bob_0.wav").unlink()
    with pytest.raises(DatasetError, match="training split has no clips of class 3"):
        load_dataset("fsdd", str(root), params={"test_speakers": ["cy"]})
    write_wav(root / "recordings" / "3_ann_0.wav", tone(300.0, 8000, 0.3), 8000)
    bad = _float_wav(root / "recordings" / "4_ann_9.wav")
    with pytest.raises(DatasetError, match=f"{bad}: not a readable PCM WAV"):
        load_dataset("fsdd", str(root), params={"test_speakers": ["cy"]})


def make_speech_commands(root: Path, words: list[str], speakers: int = 2, rate: int = 16000) -> Path:
    """The Speech Commands layout with one clip per word and speaker (some shorter than 1 s), the
    split lists (speaker s1 tests, s2 validates, the rest train) and a background-noise folder."""
    test, val = [], []
    for w_i, word in enumerate(words):
        for s in range(speakers):
            name = f"{word}/s{s}_nohash_0.wav"
            write_wav(root / name, tone(150.0 + 40.0 * w_i, rate, 0.6 if s % 2 else 1.0), rate)
            (test if s == 1 else val if s == 2 else []).append(name)
    write_wav(root / "_background_noise_" / "noise.wav", tone(50.0, rate, 2.0), rate)
    (root / "testing_list.txt").write_text("\n".join([*test, "absent/s9_nohash_0.wav"]) + "\n")
    (root / "validation_list.txt").write_text("\n".join(val) + "\n")
    return root


def test_speech_commands_official_split_from_a_folder_or_archive(tmp_path: Path) -> None:
    root = make_speech_commands(tmp_path / "sc" / "speech_commands", SPEECH_COMMANDS_V1, speakers=4)
    params = {"version": 1, "n_mels": 16, "win_ms": 32.0, "hop_ms": 32.0}
    train, test = load_dataset("speech_commands", str(root), params=params)
    assert train.classes == SPEECH_COMMANDS_V1 and len(SPEECH_COMMANDS_V1) == 30
    assert len(train) == 60 and len(test) == 30 and train.sample_shape == (1, 16, 32)
    assert train.groups is not None and sorted(set(train.groups.tolist())) == [0, 2]  # s0, s3 (s2 validates)
    archive = tmp_path / "sc.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(root, arcname="speech_commands")
    train2, test2 = load_dataset("speech_commands", str(archive), params=params)
    assert torch.equal(train2.x, train.x) and torch.equal(test2.y, test.y)


def test_speech_commands_errors(tmp_path: Path) -> None:
    root = make_speech_commands(tmp_path / "sc", SPEECH_COMMANDS_V1)
    with pytest.raises(DatasetError, match=r"no clips of \['backward', 'follow'"):
        load_dataset("speech_commands", str(root), params={"version": 2})
    with pytest.raises(DatasetError, match="versions 1 and 2"):
        load_dataset("speech_commands", str(root), params={"version": 3})
    (root / "extra").mkdir()
    with pytest.raises(DatasetError, match=r"word folders \['extra'\] are not among"):
        load_dataset("speech_commands", str(root), params={"version": 1})
    (root / "extra").rmdir()
    write_wav(root / "yes" / "s5_nohash_0.wav", tone(100.0, 8000, 1.0), 8000)
    with pytest.raises(DatasetError, match="s5_nohash_0.wav: sample rate 8000 Hz"):
        load_dataset("speech_commands", str(root), params={"version": 1})
    (tmp_path / "nolists").mkdir()
    with pytest.raises(DatasetError, match="no testing_list.txt"):
        load_dataset("speech_commands", str(tmp_path / "nolists"))


def test_a_bad_clip_in_a_run_is_one_line_from_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from felix.cli import main

    root = make_fsdd(tmp_path / "fsdd", per=1)
    _float_wav(root / "recordings" / "4_ann_9.wav")
    argv = [
        "run",
        "--scenario",
        "felix-speech-cpu",
        "--preset",
        "felix",
        "--set",
        f"dataset.root={root}",
        "--out",
        str(tmp_path / "o"),
    ]
    assert main([*argv, "--set", "dataset.params.test_speakers=[cy]"]) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("felix: error")] == [
        f"felix: error: {root}/recordings/4_ann_9.wav: not a readable PCM WAV file (unknown format: 3)"
    ]


# ---------------------------------------------------------------------- partition
def test_speaker_partition_gives_each_client_one_or_a_few_speakers() -> None:
    groups = np.repeat(np.arange(3), 10)
    parts = speaker_partition(groups, 6, np.random.default_rng(0))
    assert [len(p) for p in parts] == [5] * 6
    assert all(len(set(groups[p])) == 1 for p in parts)
    assert sorted(np.concatenate(parts).tolist()) == list(range(30))
    many = np.repeat(np.arange(20), 3)
    parts = speaker_partition(many, 4, np.random.default_rng(1))
    assert [len(set(many[p])) for p in parts] == [5] * 4
    assert sorted(np.concatenate(parts).tolist()) == list(range(60))


def test_speaker_partition_needs_speakers() -> None:
    with pytest.raises(ConfigError, match="splits by speaker, but the dataset gives no speaker"):
        build_population(resolve_config(None, "felix", {"partition": {"kind": "speaker"}}))


# ---------------------------------------------------------------------- models
def test_resnet34_1d_has_the_authors_parameter_count() -> None:
    for norm in ("batch", "group"):
        net = make_model("resnet34_1d", (1, 16000), 35, params={"norm": norm})
        assert sum(p.numel() for p in net.parameters()) == 7_236_195  # about 7.2M, as theirs
    assert make_model("resnet34_1d", (1, 16, 32), 10)(torch.zeros(2, 1, 16, 32)).shape == (2, 10)
    with pytest.raises(ConfigError, match="resnet34_1d expects"):
        make_model("resnet34_1d", (3, 8, 8, 8), 10)
    with pytest.raises(ConfigError, match="kws_cnn expects a log-mel"):
        make_model("kws_cnn", (1, 16000), 10)


def test_kws_cnn_uses_the_stacked_kernel_and_resnet_with_group_norm_trains_in_cohorts() -> None:
    kws = make_model("kws_cnn", (1, 24, 32), 10)
    assert StackedChain.of(kws, masked_ce_grad, (1, 24, 32)) is not None
    assert cohort_blocker(make_model("resnet34_1d", (1, 16, 32), 10), None) is not None  # BatchNorm
    net = make_model("resnet34_1d", (1, 8, 16), 4, params={"norm": "group"})
    assert cohort_blocker(net, None) is None
    cfg = TrainConfig(lr=0.01, batch_size=4, epochs=1)
    rng = torch.Generator().manual_seed(0)
    datas = [ClientData(torch.randn(6, 1, 8, 16, generator=rng), torch.arange(6) % 4) for _ in range(2)]
    w0 = model_vector(net, "aggregate")
    seq = LocalTrainer(net, make_objective("ce"), cfg, 4)
    alone = [seq.train(w0, d, {}, {}, torch.Generator().manual_seed(k)) for k, d in enumerate(datas)]
    cohort = CohortTrainer(net, make_objective("ce"), cfg, 4)
    tasks = [CohortTask(w0, d, {}, {}, torch.Generator().manual_seed(k)) for k, d in enumerate(datas)]
    together = cohort.train(tasks)
    for a, b in zip(alone, together, strict=True):
        assert np.abs(a.delta - b.delta).max() < 1e-4 * max(1.0, np.abs(a.delta).max())


# ---------------------------------------------------------------------- scenarios
def test_felix_speech_cpu_runs_on_generated_clips(tmp_path: Path) -> None:
    root = make_fsdd(tmp_path / "fsdd", speakers=("ann", "bob", "cy", "dee"), per=3)
    sets = {
        "dataset": {"root": str(root), "params": {"test_speakers": ["dee"]}},
        "partition": {"num_clients": 6},
        "trace": {"kind": "always"},
        "run": {"max_aggregations": 3, "stop_at_target": False},
        "orchestrator": {"agg_goal": 2, "concurrency": 4},
    }
    res = run_config(resolve_config(None, "felix", sets, "felix-speech-cpu"), tmp_path / "out", plots=False)
    s = res.summary
    assert s["aggregations"] == 3 and s["diagnostics"]["rejected"] == 0, s
    assert (
        res.rows[-1].bytes_train > 0
        and res.rows[-1].bytes_train + res.rows[-1].bytes_eval <= res.rows[-1].bytes_total
    )


def test_felix_speech_first_aggregations_on_cpu(tmp_path: Path) -> None:
    """The GPU scenario (Speech Commands v2, ResNet34-1D on waveforms, Adam at the authors' rate)
    on a handful of generated clips: two aggregations on the CPU."""
    root = make_speech_commands(tmp_path / "sc", SPEECH_COMMANDS_V2, speakers=2)
    sets = {
        "dataset": {"root": str(root), "params": {"version": 2, "features": "waveform", "clip_s": 0.25}},
        "partition": {"num_clients": 4},
        "trace": {"kind": "always"},
        "client": {"batch_size": 4},
        "run": {"device": "cpu", "max_aggregations": 2, "stop_at_target": False},
        "orchestrator": {"agg_goal": 2, "concurrency": 2},
    }
    cfg = variant_config(load_comparison("felix-speech"), "felix", sets)
    assert (
        cfg.model == "resnet34_1d"
        and cfg.client.optimizer == "adam"
        and cfg.client.lr == pytest.approx(0.000195)
    )
    assert cfg.aggregator.server_lr == 1.0 and cfg.dataset.params["features"] == "waveform"
    res = run_config(cfg, tmp_path / "out", plots=False)
    assert res.summary["aggregations"] == 2 and res.summary["diagnostics"]["rejected"] == 0, res.summary
    assert res.summary["num_params"] > 7_000_000


def test_the_speech_comparisons_run_the_eight_strategies() -> None:
    eight = ["fedbuff", "oort", "oort*", "oort-async", "oort-async*", "refl*", "felix", "felix-plus"]
    cpu, gpu = load_comparison("felix-speech-cpu"), load_comparison("felix-speech")
    assert list(cpu.variants) == list(gpu.variants) == eight
    assert cpu.seeds == gpu.seeds == [0, 1, 2] and len(cpu.targets or []) >= 2 and len(gpu.targets or []) >= 2
    for v in eight:
        c = variant_config(cpu, v, {})
        assert (c.dataset.name, c.model, c.partition.kind, c.partition.num_clients) == (
            "fsdd",
            "kws_cnn",
            "speaker",
            100,
        )
        assert (c.trace.kind, c.trace.offset_s) == ("mobiperf", 300.0)
        g = variant_config(gpu, v, {})
        assert (g.dataset.name, g.model, g.partition.num_clients, g.aggregator.server_lr) == (
            "speech_commands",
            "resnet34_1d",
            100,
            1.0,
        )


# ---------------------------------------------------------------------- real clips
@pytest.mark.skipif(not (DATA and FSDD.exists()), reason=REAL_DATA_REASON.format("fsdd.tar.gz"))
def test_real_fsdd_loads_by_speaker() -> None:
    train, test = load_dataset("fsdd", str(FSDD), params={"n_mels": 24, "win_ms": 32.0, "hop_ms": 32.0})
    assert (len(train), len(test)) == (2500, 500) and (train.class_counts() == 250).all()
    assert train.groups is not None and len(set(train.groups.tolist())) == 5
    assert bool(torch.isfinite(train.x).all())


@pytest.mark.skipif(
    not (DATA and SC_SAMPLE.exists()), reason=REAL_DATA_REASON.format("speech-commands-sample.tar.gz")
)
def test_resnet34_1d_forward_on_a_real_clip() -> None:
    train, test = load_dataset(
        "speech_commands", str(SC_SAMPLE), params={"version": 1, "features": "waveform"}
    )
    assert train.sample_shape == (1, 16000) and train.num_classes == 30
    assert len(train) + len(test) <= 300 and len(test) > 0
    net = make_model("resnet34_1d", train.sample_shape, train.num_classes).eval()
    with torch.no_grad():
        out = net(train.x[:2])
    assert out.shape == (2, 30) and bool(torch.isfinite(out).all())
