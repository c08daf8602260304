"""The run facts a strategy factory reads. ``factory(params, ctx)`` of a selector, eval selector,
aggregator or server optimiser gets a :class:`RunFacts` as ``ctx``, not the whole run config: a
component depends on the few facts it really reads, and can be built without a config (a test,
a user's script). The builder (``felix.engine.components.run_facts``) fills it from the config.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RunFacts:
    num_clients: int  # partition.num_clients
    seed: int  # the run's seed
    agg_goal: int  # orchestrator.agg_goal: updates per aggregation (TierSelect's eval budget)
    client_lr: float  # client.lr (q-FFL's default Lipschitz constant is 1 / lr)
    batch_size: int  # client.batch_size
    max_steps: int | None  # client.max_steps (Oort's reward cap is max_steps x batch_size)
    server_lr: float  # aggregator.server_lr
    normalize: str  # aggregator.normalize: "weights" or "count"
    clip_norm: float | None  # aggregator.clip_norm


__all__ = ["RunFacts"]
