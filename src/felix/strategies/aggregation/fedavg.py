"""Sample-weighted FedAvg and staleness-weighted FedBuff, the classic sync and async aggregators."""

from __future__ import annotations

import numpy as np

from felix.core.aggregation import AGGREGATORS, Aggregator
from felix.core.registry import NoParams
from felix.core.run_facts import RunFacts
from felix.core.types import BufferedUpdate


class FedAvgAggregator(Aggregator):
    """McMahan et al.: weight by the number of local samples."""

    name = "fedavg"

    def weight(self, item: BufferedUpdate) -> float:
        return float(item.update.num_samples)


class FedBuffAggregator(Aggregator):
    """FedBuff / FedScale async: weight 1/sqrt(1 + staleness)."""

    name = "fedbuff"

    def weight(self, item: BufferedUpdate) -> float:
        return 1.0 / float(np.sqrt(1.0 + item.staleness))


@AGGREGATORS.register("fedavg", params=NoParams, reads_reports=False)
def _fedavg(params: NoParams, ctx: RunFacts) -> FedAvgAggregator:
    return FedAvgAggregator(ctx.server_lr, ctx.normalize, ctx.clip_norm)


@AGGREGATORS.register("fedbuff", params=NoParams, reads_reports=False)
def _fedbuff(params: NoParams, ctx: RunFacts) -> FedBuffAggregator:
    return FedBuffAggregator(ctx.server_lr, ctx.normalize, ctx.clip_norm)
