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

:func:`pin` also makes torch's worker threads wait passively (``OMP_WAIT_POLICY=PASSIVE``, unless
set): by default GNU OpenMP's threads spin between parallel regions, and a run on ``run.threads=2``
whose cores other work also uses spent its time spinning against that work (the engine benchmark's
ratio to the bare loop went from 0.47 on a quiet machine to 8.45). Waiting passively costs a
wake-up per parallel region on a quiet machine (docs/architecture.md has both figures). OpenMP
reads the variable when torch loads it, so this too must happen before ``import torch``.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
from pathlib import Path

log = logging.getLogger("felix")

ENV = "ATEN_CPU_CAPABILITY"
PINNED = "avx2"
WAIT_ENV = "OMP_WAIT_POLICY"
_warned = False
_spinning = False  # torch (and its OpenMP runtime) was loaded before felix set the wait policy
_warned_spinning = False


def pin() -> None:
    """Set ``ATEN_CPU_CAPABILITY=avx2`` for this process and its children where it applies, and
    ``OMP_WAIT_POLICY=PASSIVE`` unless the environment says otherwise."""
    global _spinning
    _spinning = WAIT_ENV not in os.environ and "torch" in sys.modules
    os.environ.setdefault(WAIT_ENV, "PASSIVE")
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
    kernels, since runs then differ in their last bits from those made with the AVX2 kernels, and
    one (once) when torch was loaded before felix could make its threads wait passively."""
    import torch

    global _warned, _warned_spinning
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
    if _spinning and not _warned_spinning:
        _warned_spinning = True
        log.warning(
            "torch was imported before felix, so its worker threads spin between operations and "
            "slow a run on several threads when other work shares the cores: import felix first, "
            "or set %s=PASSIVE in the environment",
            WAIT_ENV,
        )
    return capability
