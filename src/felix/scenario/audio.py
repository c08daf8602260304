"""Speech datasets: PCM WAV clips read with the standard ``wave`` module, turned into features once
per dataset and cached.

Two registered datasets (``felix.scenario.datasets.DATASETS``):

- ``fsdd``, the Free Spoken Digit Dataset (``recordings/{digit}_{speaker}_{i}.wav``, 8 kHz, 10
  digits, 6 speakers): real speech small enough for CPU runs. The test set is held-out speakers
  (``test_speakers``), so accuracy measures words spoken by voices the federation never heard.
- ``speech_commands``, Google Speech Commands in its own layout (one folder per word,
  ``validation_list.txt`` / ``testing_list.txt`` for the official split, ``_background_noise_``
  ignored), v1 (30 words) or v2 (35 words), from a folder or the official ``.tar.gz``.

Every clip is padded with zeros or cut to ``clip_s`` seconds. Features (``features``):

- ``logmel``: a log-mel spectrogram, ``1 x n_mels x frames`` per clip, from a Hann-windowed STFT
  of ``win_ms`` windows every ``hop_ms`` (:func:`log_mel`), standardised per mel band with the
  training set's mean and spread;
- ``waveform``: the samples themselves, ``1 x samples`` (what the FeLiX authors' ResNet34-1D reads).

Each sample carries its speaker as a group id (``ArrayDataset.groups``), which the ``speaker``
partitioner (felix.scenario.partition) splits by. Features are computed in batches (one STFT and
one matrix product per chunk of clips) and cached under ``FELIX_CACHE`` keyed by the files and
the feature settings, so a comparison's runs and later runs read them back instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import wave
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from felix.scenario.datasets import DATASETS, ArrayDataset, DatasetError, _unpack_if_archive, cache_dir

log = logging.getLogger("felix")

FSDD_RATE = 8000
SPEECH_COMMANDS_RATE = 16000
SPEECH_COMMANDS_V1 = sorted(
    [
        "bed",
        "bird",
        "cat",
        "dog",
        "down",
        "eight",
        "five",
        "four",
        "go",
        "happy",
        "house",
        "left",
        "marvin",
        "nine",
        "no",
        "off",
        "on",
        "one",
        "right",
        "seven",
        "sheila",
        "six",
        "stop",
        "three",
        "tree",
        "two",
        "up",
        "wow",
        "yes",
        "zero",
    ]
)
SPEECH_COMMANDS_V2 = sorted([*SPEECH_COMMANDS_V1, "backward", "follow", "forward", "learn", "visual"])
FSDD_NAME = re.compile(r"^(\d)_([A-Za-z]+)_(\d+)\.wav$")
_CHUNK = 1024  # clips per feature batch: bounds the STFT's memory on the full Speech Commands


@dataclass(frozen=True)
class Features:
    """How clips become samples; the values are the config's ``dataset.params`` of the same names."""

    kind: str = "logmel"  # "logmel" | "waveform"
    n_mels: int = 40
    win_ms: float = 25.0
    hop_ms: float = 10.0
    f_min: float = 20.0
    f_max: float | None = None  # None: half the sample rate

    def __post_init__(self) -> None:
        if self.kind not in ("logmel", "waveform"):
            raise DatasetError(f"dataset.params.features: {self.kind!r} is neither 'logmel' nor 'waveform'")
        if self.n_mels < 1 or self.win_ms <= 0 or self.hop_ms <= 0:
            raise DatasetError("dataset.params: n_mels, win_ms and hop_ms must be positive")

    def frames(self, rate: int) -> tuple[int, int, int]:
        """(window, hop, FFT size) in samples at ``rate`` Hz; the FFT is the next power of two."""
        win = round(self.win_ms * rate / 1000)
        hop = round(self.hop_ms * rate / 1000)
        if win < 2 or hop < 1:
            raise DatasetError(f"dataset.params: win_ms / hop_ms give {win} / {hop} samples at {rate} Hz")
        return win, hop, 1 << (win - 1).bit_length()


# ---------------------------------------------------------------------- WAV files
def read_wav(path: Path, rate: int) -> np.ndarray:
    """A PCM WAV file as float32 samples in [-1, 1) (channels averaged); a ``DatasetError`` naming
    the file when it is not a PCM WAV (``wave`` reads only PCM) or not at ``rate`` Hz."""
    try:
        with wave.open(str(path), "rb") as w:
            channels, width, got, n = w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()
            raw = w.readframes(n)
    except (wave.Error, EOFError, OSError) as exc:
        raise DatasetError(f"{path}: not a readable PCM WAV file ({exc})") from None
    if got != rate:
        raise DatasetError(f"{path}: sample rate {got} Hz, the dataset's is {rate} Hz")
    if width not in (1, 2, 3, 4) or channels < 1:
        raise DatasetError(
            f"{path}: {width}-byte samples in {channels} channels is not a PCM layout read here"
        )
    if len(raw) != n * width * channels:
        raise DatasetError(f"{path}: truncated ({len(raw)} bytes of {n * width * channels} declared)")
    if width == 1:  # 8-bit WAV is unsigned
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 3:  # 24-bit little-endian: widen to int32 by a zero low byte
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3)
        wide = np.zeros((len(b), 4), np.uint8)
        wide[:, 1:] = b
        x = wide.view("<i4").ravel().astype(np.float32) / 2.0**31
    else:
        dtype = "<i2" if width == 2 else "<i4"
        x = np.frombuffer(raw, dtype).astype(np.float32) / float(2 ** (8 * width - 1))
    return x.reshape(-1, channels).mean(axis=1) if channels > 1 else x


def fixed_length(clips: list[np.ndarray], length: int) -> np.ndarray:
    """Clips padded at the end with zeros or cut to ``length`` samples, as one N x length array."""
    out = np.zeros((len(clips), length), np.float32)
    for i, c in enumerate(clips):
        n = min(len(c), length)
        out[i, :n] = c[:n]
    return out


# ---------------------------------------------------------------------- log-mel
def hz_to_mel(f: torch.Tensor) -> torch.Tensor:
    """The HTK mel scale: 2595 log10(1 + f / 700)."""
    return 2595.0 * torch.log10(1.0 + f / 700.0)


def mel_to_hz(m: torch.Tensor) -> torch.Tensor:
    return 700.0 * (10.0 ** (m / 2595.0) - 1.0)


def mel_filterbank(rate: int, n_fft: int, n_mels: int, f_min: float, f_max: float) -> torch.Tensor:
    """``(n_fft // 2 + 1) x n_mels`` triangular filters (HTK mel scale, peak 1, no area
    normalisation). Filter m rises linearly from the (m)th to the (m+1)th of ``n_mels + 2`` points
    equally spaced in mel between ``f_min`` and ``f_max`` and falls to the (m+2)th; each FFT bin's
    weight is the triangle's height at the bin's frequency."""
    if not 0 <= f_min < f_max <= rate / 2:
        raise DatasetError(f"dataset.params: need 0 <= f_min < f_max <= {rate / 2} Hz, got {f_min}, {f_max}")
    freqs = torch.linspace(0.0, rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    lo, hi = (
        hz_to_mel(torch.tensor(f_min, dtype=torch.float64)),
        hz_to_mel(torch.tensor(f_max, dtype=torch.float64)),
    )
    pts = mel_to_hz(torch.linspace(float(lo), float(hi), n_mels + 2, dtype=torch.float64))
    rise = (freqs[:, None] - pts[None, :-2]) / (pts[1:-1] - pts[:-2])
    fall = (pts[None, 2:] - freqs[:, None]) / (pts[2:] - pts[1:-1])
    return torch.clamp(torch.minimum(rise, fall), min=0.0).float()


def log_mel(wave_batch: torch.Tensor, rate: int, feats: Features) -> torch.Tensor:
    """``N x samples`` waveforms to ``N x n_mels x frames`` natural-log mel energies: a Hann window
    of ``win_ms`` every ``hop_ms`` (frames centred, the clip zero-padded by half an FFT at both
    ends), the power spectrum, the mel filterbank, log(energy + 1e-6)."""
    win, hop, n_fft = feats.frames(rate)
    window = torch.hann_window(win, periodic=True, dtype=wave_batch.dtype)
    spec = torch.stft(
        wave_batch,
        n_fft,
        hop_length=hop,
        win_length=win,
        window=window,
        center=True,
        pad_mode="constant",
        return_complex=True,
    )
    power = spec.real.square() + spec.imag.square()  # N x (n_fft/2 + 1) x frames
    fb = mel_filterbank(rate, n_fft, feats.n_mels, feats.f_min, feats.f_max or rate / 2)
    return torch.log(torch.einsum("fm,nft->nmt", fb, power) + 1e-6)


def _features(waves: np.ndarray, rate: int, feats: Features) -> np.ndarray:
    """All clips' features, chunk by chunk (float32 log-mel, or int16 waveforms to keep the cache small)."""
    if feats.kind == "waveform":
        return np.clip(np.round(waves * 32768.0), -32768, 32767).astype(np.int16)[:, None]
    out = [
        log_mel(torch.from_numpy(waves[s : s + _CHUNK]), rate, feats).numpy()
        for s in range(0, len(waves), _CHUNK)
    ]
    return np.concatenate(out)[:, None]


@dataclass
class Clip:
    """One WAV file of a dataset: its class and who spoke it."""

    path: Path
    label: int
    speaker: str


def clips_dataset(
    where: Path,
    train: list[Clip],
    test: list[Clip],
    classes: list[str],
    rate: int,
    clip_s: float,
    feats: Features,
) -> tuple[ArrayDataset, ArrayDataset]:
    """The train and test sets of these clips (from the folder ``where``, named in errors): read,
    padded or cut to ``clip_s``, featurised (from the cache when the same files and settings were
    seen before), log-mel standardised per band by the training set; groups are speaker ids,
    numbered over both splits."""
    counts = np.bincount([c.label for c in train], minlength=len(classes))
    if (counts == 0).any():
        empty = [classes[k] for k in np.flatnonzero(counts == 0)]
        raise DatasetError(f"{where}: the training split has no clips of class {', '.join(empty)}")
    if not test:
        raise DatasetError(f"{where}: the test split has no clips")
    length = round(clip_s * rate)
    if length < 1:
        raise DatasetError(f"dataset.params.clip_s: {clip_s} s is not a clip length")
    everything = train + test
    key_text = json.dumps(
        [[str(c.path), c.path.stat().st_size] for c in everything] + [rate, length, asdict(feats)]
    )
    cached = cache_dir() / f"audio-{hashlib.sha1(key_text.encode()).hexdigest()[:16]}.npz"
    x = _read_cached(cached, len(everything))
    if x is None:
        waves = fixed_length([read_wav(c.path, rate) for c in everything], length)
        x = _features(waves, rate, feats)
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.parent / f"{cached.stem}.{os.getpid()}.tmp.npz"  # runs in parallel write their own
        np.savez(tmp, x=x)
        tmp.replace(cached)
    # One layout whether computed or read back, so that the statistics below sum in the same order.
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    if x.dtype == np.int16:
        xt /= 32768.0
    if feats.kind == "logmel":
        part = xt[: len(train)]
        mean = part.mean(dim=(0, 1, 3), keepdim=True)
        std = part.std(dim=(0, 1, 3), keepdim=True).clamp_min(1e-5)
        xt = (xt - mean) / std
    y = torch.tensor([c.label for c in everything], dtype=torch.int64)
    names = sorted({c.speaker for c in everything})
    g = torch.tensor([names.index(c.speaker) for c in everything], dtype=torch.int64)
    n = len(train)
    return (
        ArrayDataset(xt[:n].contiguous(), y[:n], classes, g[:n]),
        ArrayDataset(xt[n:].contiguous(), y[n:], classes, g[n:]),
    )


def _read_cached(path: Path, n: int) -> np.ndarray | None:
    """Cached features, or None when absent or damaged (they are computed again)."""
    if not path.exists():
        return None
    try:
        with np.load(path) as z:
            x = z["x"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        log.warning("audio feature cache %s unreadable (%s): computing the features again", path, exc)
        return None
    return x if len(x) == n else None


def _folder(root: str | None, name: str, where: str) -> Path:
    if root is None:
        raise DatasetError(f"{name} needs dataset.root: a folder or .tar.gz archive ({where})")
    return _unpack_if_archive(Path(root))


# ---------------------------------------------------------------------- FSDD
@DATASETS.register("fsdd")
def load_fsdd(
    root: str | None,
    download: bool,
    test_speakers: str | list[str] | tuple[str, ...] = ("theo",),
    clip_s: float = 1.0,
    features: str = "logmel",
    n_mels: int = 40,
    win_ms: float = 25.0,
    hop_ms: float = 10.0,
    f_min: float = 20.0,
    f_max: float | None = None,
) -> tuple[ArrayDataset, ArrayDataset]:
    """The Free Spoken Digit Dataset from a folder or archive holding ``recordings/*.wav`` (the
    repository's layout, github.com/Jakobovski/free-spoken-digit-dataset); the clips of
    ``test_speakers`` are the test set."""
    feats = Features(features, n_mels, win_ms, hop_ms, f_min, f_max)
    where = "the free-spoken-digit-dataset repository, github.com/Jakobovski/free-spoken-digit-dataset"
    base = _folder(root, "fsdd", where)
    folder = next(
        (p for p in (base / "recordings", base / "fsdd" / "recordings", base) if any(p.glob("*.wav"))), None
    )
    if folder is None:
        raise DatasetError(f"{base}: no recordings/*.wav (the Free Spoken Digit Dataset's layout)")
    clips = []
    for p in sorted(folder.glob("*.wav")):
        m = FSDD_NAME.match(p.name)
        if m is None:
            raise DatasetError(f"{p}: not named {{digit}}_{{speaker}}_{{index}}.wav")
        clips.append(Clip(p, int(m.group(1)), m.group(2)))
    if isinstance(test_speakers, str):  # one name given without a list
        test_speakers = [test_speakers]
    speakers = {c.speaker for c in clips}
    unknown = sorted(set(test_speakers) - speakers)
    if unknown or set(test_speakers) >= speakers:
        raise DatasetError(
            f"dataset.params.test_speakers {list(test_speakers)}: must be some, not all, of the "
            f"speakers in {folder} ({', '.join(sorted(speakers))})"
        )
    held = set(test_speakers)
    return clips_dataset(
        folder,
        [c for c in clips if c.speaker not in held],
        [c for c in clips if c.speaker in held],
        [str(d) for d in range(10)],
        FSDD_RATE,
        clip_s,
        feats,
    )


# ---------------------------------------------------------------------- Speech Commands
@DATASETS.register("speech_commands")
def load_speech_commands(
    root: str | None,
    download: bool,
    version: int = 2,
    clip_s: float = 1.0,
    features: str = "logmel",
    n_mels: int = 40,
    win_ms: float = 25.0,
    hop_ms: float = 10.0,
    f_min: float = 20.0,
    f_max: float | None = None,
) -> tuple[ArrayDataset, ArrayDataset]:
    """Google Speech Commands v1 or v2 in the dataset's own layout; the clips in
    ``testing_list.txt`` are the test set, those in ``validation_list.txt`` are left out, the rest
    train (the official split; list entries whose file is absent are skipped, so a subset of the
    clips works). ``_background_noise_`` is ignored."""
    if version not in (1, 2):
        raise DatasetError(f"dataset.params.version: Speech Commands has versions 1 and 2, not {version!r}")
    feats = Features(features, n_mels, win_ms, hop_ms, f_min, f_max)
    url = f"download.tensorflow.org/data/speech_commands_v0.0{version}.tar.gz"
    base = _folder(root, "speech_commands", url)
    if not (base / "testing_list.txt").exists():
        inner = [p for p in base.iterdir() if p.is_dir() and (p / "testing_list.txt").exists()]
        if len(inner) != 1:
            raise DatasetError(f"{base}: no testing_list.txt (the Speech Commands layout, {url})")
        base = inner[0]
    words = SPEECH_COMMANDS_V2 if version == 2 else SPEECH_COMMANDS_V1
    found = sorted(p.name for p in base.iterdir() if p.is_dir() and not p.name.startswith("_"))
    extra = sorted(set(found) - set(words))
    if extra:
        raise DatasetError(f"{base}: word folders {extra} are not among Speech Commands v{version}'s words")
    missing = sorted(set(words) - set(found))
    if missing:
        raise DatasetError(
            f"{base}: no clips of {missing} (Speech Commands v{version} has {len(words)} words)"
        )
    lists = {}
    for name in ("testing_list.txt", "validation_list.txt"):
        try:
            lists[name] = set((base / name).read_text().split())
        except (OSError, UnicodeDecodeError) as exc:
            raise DatasetError(f"{base / name}: unreadable ({exc})") from None
    train: list[Clip] = []
    test: list[Clip] = []
    for label, word in enumerate(words):
        for p in sorted((base / word).glob("*.wav")):
            rel = f"{word}/{p.name}"
            if rel in lists["validation_list.txt"]:
                continue
            clip = Clip(p, label, p.name.split("_nohash_")[0])
            (test if rel in lists["testing_list.txt"] else train).append(clip)
    if not train:
        raise DatasetError(f"{base}: no training clips")
    return clips_dataset(base, train, test, words, SPEECH_COMMANDS_RATE, clip_s, feats)
