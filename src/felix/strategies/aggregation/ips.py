"""FedAvg with known participation probabilities: the inverse-probability (IPS) oracle.

Under the Random Access Model client ``i`` joins a round with probability ``p_i``, so agnostic
FedAvg's expected step weights client ``i`` by ``p_i n_i`` and its objective drifts towards
frequent clients. Weighting each update by ``n_i / p_i`` removes that bias: in expectation over
the draw every client counts by ``n_i`` again, the full-participation FedAvg objective. The
weights are self-normalised over the round (the base class's ``normalize="weights"``, a Hajek
estimator), which trades a small bias for far less variance than dividing by the population's
total. No real server knows the ``p_i``; this is the oracle reference that FedeRage, which never
forms them, is compared against.
"""

from __future__ import annotations

from collections.abc import Mapping

from felix.core.aggregation import Aggregator
from felix.core.types import BufferedUpdate


class IPSAggregator(Aggregator):
    name = "ips"

    def __init__(self, probabilities: Mapping[int, float], server_lr: float = 1.0) -> None:
        super().__init__(server_lr=server_lr, normalize="weights")
        bad = {c: p for c, p in probabilities.items() if not (0.0 < p <= 1.0)}
        if bad:
            raise ValueError(
                f"participation probabilities must lie in (0, 1]; got {dict(list(bad.items())[:5])}"
            )
        self.probabilities = {int(c): float(p) for c, p in probabilities.items()}

    def weight(self, item: BufferedUpdate) -> float:
        try:
            p = self.probabilities[item.client_id]
        except KeyError:
            raise ValueError(f"IPS: no participation probability for client {item.client_id}") from None
        return float(item.update.num_samples) / p
