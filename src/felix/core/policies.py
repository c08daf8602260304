"""One import for the base class and registry of every strategy axis.

Each axis has a module of its own (the round policy in ``felix.core.rounds``, availability in
``felix.core.availability``, the data plan in ``felix.core.dataplan``, training selection in
``felix.core.selection``, eval selection in ``felix.core.eval_selection``, aggregation in
``felix.core.aggregation``); this module gathers their public names for code that plugs in
policies of several axes at once, and keeps the import path that user code has long used for the
selectors and aggregators.
"""

from __future__ import annotations

from felix.core.aggregation import AGGREGATORS, Aggregator, reduce_aux
from felix.core.availability import AVAILABILITY, AvailabilityPolicy
from felix.core.dataplan import DATA_PLANS, DataPlanPolicy
from felix.core.eval_selection import EVAL_SELECTORS, EvalSelector
from felix.core.rounds import ROUND_POLICIES, RoundPolicy
from felix.core.selection import TRAIN_SELECTORS, AvailabilityOracle, SelectionContext, TrainSelector

__all__ = [
    "AGGREGATORS",
    "AVAILABILITY",
    "DATA_PLANS",
    "EVAL_SELECTORS",
    "ROUND_POLICIES",
    "TRAIN_SELECTORS",
    "Aggregator",
    "AvailabilityOracle",
    "AvailabilityPolicy",
    "DataPlanPolicy",
    "EvalSelector",
    "RoundPolicy",
    "SelectionContext",
    "TrainSelector",
    "reduce_aux",
]
