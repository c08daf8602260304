"""Client objectives: what a local step minimises.

One contract (:mod:`felix.strategies.objectives.base`): an objective writes its hooks once, on
stacked tensors, and the sequential and cohort trainers both call them. The built-in objectives
register in ``OBJECTIVES`` next to their classes (:mod:`~felix.strategies.objectives.baselines`,
:mod:`~felix.strategies.objectives.federage`); a run config picks one by name, or gives an import
path to an ``Objective`` subclass, and ``client.objective_params`` is validated by the objective's
own typed parameters (``Objective.params()``).
"""

from __future__ import annotations

from felix.strategies.objectives.base import (
    HOOKS,
    OBJECTIVES,
    Objective,
    OneClient,
    TaskContext,
    make_objective,
    masked_mean,
    objective_class,
    objective_params_model,
    stacked_views,
)
from felix.strategies.objectives.baselines import (
    FedProx,
    FocalLoss,
    Scaffold,
    ScaffoldParams,
    WeightedCE,
    inverse_frequency_weights,
)
from felix.strategies.objectives.federage import (
    FEDERAGE_STEP_RULES,
    FedeRage,
    balanced_low_weight,
    beta_step,
    max_risk_weight,
    risk_weight,
)

__all__ = [
    "FEDERAGE_STEP_RULES",
    "HOOKS",
    "OBJECTIVES",
    "FedProx",
    "FedeRage",
    "FocalLoss",
    "Objective",
    "OneClient",
    "Scaffold",
    "ScaffoldParams",
    "TaskContext",
    "WeightedCE",
    "balanced_low_weight",
    "beta_step",
    "inverse_frequency_weights",
    "make_objective",
    "masked_mean",
    "max_risk_weight",
    "objective_class",
    "objective_params_model",
    "risk_weight",
    "stacked_views",
]
