"""A run's privacy budget: epsilon after each aggregation, the stop when ``target_epsilon`` would
be exceeded, and the summary's ``privacy`` section. Held by the run controller (both shells)."""

from __future__ import annotations

from typing import Any

from felix.config.base import ConfigError
from felix.privacy.accountant import Accountant


class PrivacyBudget:
    """Accounts every aggregation of the run (``step``). With ``target_epsilon``, ``spent`` turns
    true after the last aggregation whose epsilon stays within the target, so the run stops with
    its epsilon at most the target. A target that a single aggregation already exceeds is refused
    at build time (``ConfigError``, naming the noise multiplier it would need)."""

    def __init__(self, cfg: Any, mechanism: Any) -> None:
        p = cfg.privacy
        self.cfg = p
        self.mechanism = mechanism
        self.accountant = Accountant(
            p.mechanism,
            p.noise_multiplier,
            p.delta,
            kind=p.accountant,
            max_participations=p.max_participations,
            noise=p.local_noise,
            reports=None if p.reports is None else (p.reports.noise_multiplier, p.reports.max_per_client),
            bands=p.bands,
        )
        self.max_steps: int | None = None
        # seeded (a simulation) or os_csprng (a deployment: felix.privacy.setup.use_os_noise)
        self.noise_source = "seeded"
        if p.target_epsilon is not None:
            alone = self.accountant.epsilon_after(0)  # what the reports spend whatever the updates
            if alone > p.target_epsilon:
                raise ConfigError(
                    f"privacy.target_epsilon {p.target_epsilon:g} is exceeded by the reports alone "
                    f"(epsilon {alone:.3g}): raise privacy.reports.noise_multiplier or lower max_per_client"
                )
            self.max_steps = self._steps_within(p.target_epsilon)
            if self.max_steps == 0:
                raise ConfigError(
                    f"privacy.target_epsilon {p.target_epsilon:g} is exceeded by one aggregation at "
                    f"noise_multiplier {p.noise_multiplier:g}: it needs noise_multiplier >= "
                    f"{self._sigma_for_one_step(p.target_epsilon):.3g}"
                )

    @property
    def epsilon(self) -> float:
        return self.accountant.epsilon

    @property
    def spent(self) -> bool:
        return self.max_steps is not None and self.accountant.steps >= self.max_steps

    def step(self) -> None:
        """One aggregation more."""
        self.accountant.step()

    def summary(self) -> dict[str, Any]:
        p = self.cfg
        out: dict[str, Any] = {
            "mechanism": p.mechanism,
            "epsilon": self.epsilon,
            "delta": p.delta,
            "noise_multiplier": p.noise_multiplier,
            "clip_norm": p.clip_norm,
            "aggregations": self.accountant.steps,
            "accountant": self.accountant.name,
            "amplification": "none",
            "noise_source": self.noise_source,
            "target_epsilon": p.target_epsilon,
            "max_participations": p.max_participations,
        }
        m = self.mechanism
        if m is not None and hasattr(m, "denominator"):  # the server's mechanism
            out["denominator"] = m.denominator
            out["max_contribution_norm"] = m.max_contribution_norm
            if p.adaptive_clip is not None:
                out["final_clip_norm"] = m.clip_norm
                out["update_noise_multiplier"] = m.update_noise_multiplier
        if p.mechanism == "local":
            out["local_noise"] = p.local_noise
        if p.mechanism == "banded_mf":
            out["bands"] = p.bands
        if p.reports is not None:
            out["reports"] = p.reports.model_dump()
        return out

    def _steps_within(self, target: float) -> int:
        """The most aggregations whose epsilon stays within ``target`` (epsilon grows with the
        steps: doubling, then bisection; about 2 log2(steps) library calls, once per run)."""
        eps = self.accountant.epsilon_after
        if eps(1) > target:
            return 0
        hi = 1
        while eps(2 * hi) <= target:
            hi *= 2
            if hi >= 2**40:
                return hi
        lo, hi = hi, 2 * hi  # eps(lo) <= target < eps(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if eps(mid) <= target else (lo, mid)
        return lo

    def _sigma_for_one_step(self, target: float) -> float:
        """The smallest noise multiplier (to 1%) at which one aggregation stays within ``target``."""
        sigma = self.cfg.noise_multiplier
        while self.accountant.with_noise(sigma).epsilon_after(1) > target:
            sigma *= 1.01
        return sigma


__all__ = ["PrivacyBudget"]
