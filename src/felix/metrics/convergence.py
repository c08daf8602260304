"""The DAFL paper's convergence rule: "training is considered to have converged when the
difference in training loss over five consecutive rounds is less than 0.001".

Read here as: the round-to-round change of the training loss, ``|L_r - L_(r-1)|``, stays below
the threshold for ``patience`` consecutive rounds; the run has converged at the last of them.
The loss of a round is the clients' training loss behind that aggregation
(``Recorder.train_losses``), and the convergence time is the virtual time of that aggregation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["convergence_round"]


def convergence_round(losses: Sequence[float], threshold: float = 1e-3, patience: int = 5) -> int | None:
    """The 1-based round at which ``losses`` (one per round, in order) first meets the rule, or
    None. Needs ``patience + 1`` rounds at least; a non-finite loss breaks a streak."""
    if not (threshold > 0 and math.isfinite(threshold)):
        raise ValueError(f"threshold must be a finite number > 0, got {threshold!r}")
    if patience < 1:
        raise ValueError(f"patience must be >= 1, got {patience}")
    streak = 0
    for r in range(1, len(losses)):
        change = abs(losses[r] - losses[r - 1])
        streak = streak + 1 if change < threshold else 0  # NaN compares False: resets
        if streak >= patience:
            return r + 1
    return None
