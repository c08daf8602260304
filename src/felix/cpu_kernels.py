"""One set of torch CPU kernels on every x86-64 machine, so that a seed reproduces a run bit for
bit on AVX2 and AVX-512 hosts alike.

torch picks its vectorised CPU kernels (ATen's "CPU capability") by the host: AVX-512 where the
CPU has it, AVX2 otherwise. The two round some operations differently, and in a simulated FL run
float noise of that size moves discrete events (an Oort draw, the evaluation that crosses the
target): the same config and seed (felix-cpu-100, felix, 300 aggregations) gave 831 virtual s and
accuracy 0.815 with the AVX-512 kernels and 828 s / 0.8175 with the AVX2 ones, on one machine,
and the AVX2 figures are those of an AVX2-only host. So felix asks torch for its AVX2 kernels on
any x86-64 CPU that has AVX2 and FMA, unless ``ATEN_CPU_CAPABILITY`` is already set (the user's
choice wins: ``avx512`` or ``default`` opt out). BLAS (MKL) chooses its kernels by itself; it did
not move these runs. The AVX2 kernels cost no speed here: on the AVX-512 machine the
simulator was as fast or faster with them (torch's AVX-512 ``log_softmax`` over ten classes is 5x
slower than its AVX2 one), the bare training loop the same (docs/architecture.md).

torch reads the variable once, at its first CPU operation, so :func:`pin` runs when the ``felix``
package is imported; :func:`check` warns once when torch had already chosen other kernels
(operations ran before felix was imported).
"""

from __future__ import annotations

import logging
import os
import platform
from pathlib import Path

log = logging.getLogger("felix")

ENV = "ATEN_CPU_CAPABILITY"
PINNED = "avx2"
_warned = False


def pin() -> None:
    """Set ``ATEN_CPU_CAPABILITY=avx2`` for this process and its children where it applies."""
    if ENV in os.environ or platform.machine().lower() not in ("x86_64", "amd64"):
        return
    if _cpu_flags() >= {"avx2", "fma"}:
        os.environ[ENV] = PINNED


def _cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux); empty where they cannot be read, which leaves torch's choice."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def check() -> str:
    """The CPU capability torch uses; a warning (once) when felix pinned AVX2 and torch uses other
    kernels, since runs then differ in their last bits from those made with the AVX2 kernels."""
    import torch

    global _warned
    capability = str(torch.backends.cpu.get_cpu_capability())
    if os.environ.get(ENV) == PINNED and capability != "AVX2" and not _warned:
        _warned = True
        log.warning(
            "torch uses its %s CPU kernels, not the AVX2 ones felix pins for reproducibility: torch "
            "ran operations before felix was imported; import felix first, or set %s=avx2 in the "
            "environment",
            capability,
            ENV,
        )
    return capability
