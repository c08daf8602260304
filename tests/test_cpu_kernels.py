"""felix pins torch's AVX2 CPU kernels on x86-64 (felix.cpu_kernels): one result per seed on AVX2
and AVX-512 hosts."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from felix import cpu_kernels


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(cpu_kernels.ENV, raising=False)
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: {"sse2", "avx2", "fma", "avx512f"})
    monkeypatch.setattr(cpu_kernels, "_spinning", False)
    monkeypatch.setattr(cpu_kernels, "_warned_spinning", False)
    monkeypatch.setenv(cpu_kernels.WAIT_ENV, os.environ.get(cpu_kernels.WAIT_ENV, "PASSIVE"))
    return monkeypatch


def test_pin_asks_for_avx2_on_x86_with_avx2_and_fma(no_env: pytest.MonkeyPatch) -> None:
    cpu_kernels.pin()
    assert os.environ[cpu_kernels.ENV] == "avx2"


@pytest.mark.parametrize(
    "machine, flags, preset",
    [
        ("aarch64", {"avx2", "fma"}, None),  # not x86: torch's own choice
        ("x86_64", {"avx", "fma"}, None),  # no AVX2: asking for it could fault
        ("x86_64", set(), None),  # flags unreadable (no /proc/cpuinfo)
        ("x86_64", {"avx2", "fma"}, "avx512"),  # the user's setting wins
    ],
)
def test_pin_leaves_torch_alone_where_it_does_not_apply(
    no_env: pytest.MonkeyPatch, machine: str, flags: set[str], preset: str | None
) -> None:
    no_env.setattr(cpu_kernels.platform, "machine", lambda: machine)
    no_env.setattr(cpu_kernels, "_cpu_flags", lambda: flags)
    if preset is not None:
        no_env.setenv(cpu_kernels.ENV, preset)
    cpu_kernels.pin()
    assert os.environ.get(cpu_kernels.ENV) == preset


def test_check_warns_once_when_torch_chose_other_kernels(
    no_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    no_env.setenv(cpu_kernels.ENV, "avx2")
    no_env.setattr(cpu_kernels, "_warned", False)
    no_env.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    with caplog.at_level(logging.WARNING, logger="felix"):
        assert cpu_kernels.check() == "AVX512"
        assert cpu_kernels.check() == "AVX512"
    assert [r.getMessage().count("import felix first") for r in caplog.records] == [1]
    no_env.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    no_env.setattr(cpu_kernels, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="felix"):
        caplog.clear()
        assert cpu_kernels.check() == "AVX2"
    assert not caplog.records


@pytest.mark.skipif(
    not (
        cpu_kernels.platform.machine().lower() in ("x86_64", "amd64")
        and cpu_kernels._cpu_flags() >= {"avx2", "fma"}
    ),
    reason="needs an x86-64 CPU with AVX2 and FMA",
)
def test_importing_felix_gives_a_fresh_process_the_avx2_kernels() -> None:
    env = {k: v for k, v in os.environ.items() if k != cpu_kernels.ENV}
    code = "import felix, torch; print(torch.backends.cpu.get_cpu_capability())"
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "AVX2"


def test_importing_felix_makes_torchs_threads_wait_without_spinning() -> None:
    """OpenMP's threads spin 300,000 rounds between parallel regions by default; after ``import
    felix`` they do not (``GOMP_SPINCOUNT`` 0, as GNU OpenMP reports it), and a user's own
    ``OMP_WAIT_POLICY`` is kept."""
    code = "import felix, torch; torch.ones(4).sum()"
    for policy, spins in ((None, "0"), ("ACTIVE", None)):
        env = {k: v for k, v in os.environ.items() if k != cpu_kernels.WAIT_ENV}
        env["OMP_DISPLAY_ENV"] = "VERBOSE"
        if policy is not None:
            env[cpu_kernels.WAIT_ENV] = policy
        out = subprocess.run(
            [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        if "GOMP_SPINCOUNT" not in out.stderr:
            pytest.skip("torch's OpenMP runtime is not GNU OpenMP (it reports no GOMP_SPINCOUNT)")
        if spins is not None:
            assert f"GOMP_SPINCOUNT = '{spins}'" in out.stderr
        else:
            assert "OMP_WAIT_POLICY = 'ACTIVE'" in out.stderr


def test_check_warns_once_when_torch_was_loaded_before_felix_set_the_wait_policy(
    no_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    no_env.setenv(cpu_kernels.ENV, "avx2")
    no_env.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    no_env.delenv(cpu_kernels.WAIT_ENV)
    cpu_kernels.pin()  # torch is loaded in this process: its threads already spin
    assert os.environ[cpu_kernels.WAIT_ENV] == "PASSIVE"
    with caplog.at_level(logging.WARNING, logger="felix"):
        cpu_kernels.check()
        cpu_kernels.check()
    assert [r.getMessage().count("spin") for r in caplog.records] == [1]
