"""q-FFL / q-FedAvg (Li, Sanjabi, Beirami, Smith, ICLR 2020): fair aggregation by loss.

Clients whose loss at the current global model is high get a larger share of the step, with
``q`` dialling from FedAvg (``q = 0``) towards minimax fairness (large ``q``). With ``L`` the
Lipschitz estimate of the gradient (the reference code uses ``1 / client_lr``):

    Delta_k = L (w - w_k) = -L delta_k
    h_k     = q F_k^(q-1) ||Delta_k||^2 + L F_k^q
    w      <- w - sum_k F_k^q Delta_k / sum_k h_k

``F_k`` must be the client's loss at the *received* global model over its training data, as the
reference implementation computes it. The trainer's ``ClientUpdate.loss`` is the mean loss along
the local trajectory (lower than ``F_k`` and already partly optimised away), so the aggregator
reads ``update.aux[loss_key]`` when a client supplies it (e.g. the forward pass of
``LocalTrainer.probe`` at the received weights: ``client.probe_loss: true``) and only falls back
to ``update.loss`` otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict

from felix.core.aggregation import AGGREGATORS, Aggregator, reduce_aux
from felix.core.run_facts import RunFacts
from felix.core.types import BufferedUpdate
from felix.core.validation import AuxDecl

_MIN_LOSS = 1e-10  # F_k^(q-1) with q < 1 diverges at zero loss; a perfect client keeps a tiny share


class QFFLAggregator(Aggregator):
    name = "qffl"

    def __init__(self, q: float, lipschitz: float, loss_key: str = "qffl_loss") -> None:
        super().__init__()
        if not (q >= 0 and np.isfinite(q)):
            raise ValueError(f"q-FFL q must be a finite value >= 0, not {q}")
        if not (lipschitz > 0 and np.isfinite(lipschitz)):
            raise ValueError(
                f"q-FFL lipschitz (L, usually 1/client_lr) must be finite and > 0, not {lipschitz}"
            )
        self.q = float(q)
        self.lipschitz = float(lipschitz)
        self.loss_key = loss_key

    def declared_aux(self, num_params: int) -> dict[str, AuxDecl]:
        return {self.loss_key: AuxDecl((), "<f8")}

    def loss(self, item: BufferedUpdate) -> float:
        """F_k: the loss at the received model when the client sent it, else its mean training loss."""
        aux = item.update.aux
        f = float(np.asarray(aux[self.loss_key]).reshape(-1)[0]) if self.loss_key in aux else item.update.loss
        if not (np.isfinite(f) and f >= 0):
            raise ValueError(
                f"q-FFL: client {item.client_id} reported loss {f}; expected a finite value >= 0"
            )
        return max(f, _MIN_LOSS)

    def weight(self, item: BufferedUpdate) -> float:
        return self.loss(item) ** self.q

    def aggregate(
        self, theta: np.ndarray, buffer: Sequence[BufferedUpdate]
    ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """Return the q-FedAvg step, the ``F_k^q`` shares (normalised) and the reduced aux state."""
        if not buffer:
            raise ValueError("q-FFL: nothing to aggregate")
        L, q = self.lipschitz, self.q
        numer = np.zeros(theta.shape, dtype=np.float64)
        h_sum = 0.0
        fq = self.weights(buffer)
        for item, f_q in zip(buffer, fq):
            delta = item.update.delta
            assert delta is not None
            big_delta = -L * delta.astype(np.float64)
            f = self.loss(item)
            grad_term = q * f ** (q - 1.0) * float(big_delta @ big_delta) if q > 0 else 0.0
            h_sum += grad_term + L * f_q
            numer += f_q * big_delta
        new_theta = (theta.astype(np.float64) - numer / h_sum).astype(np.float32)
        norm_w = fq / fq.sum()
        aux = {k: v for k, v in reduce_aux(buffer, norm_w).items() if k != self.loss_key}
        return new_theta, norm_w, aux


class QFFLParams(BaseModel):
    """``aggregator.params`` of ``qffl``: ``lipschitz`` defaults to ``1 / client.lr``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    q: float
    lipschitz: float | None = None
    loss_key: str = "qffl_loss"


@AGGREGATORS.register(
    "qffl", params=QFFLParams, reads_aux=("qffl_loss",), own_step=True, reads_reports=True
)  # the reply's loss, without client.probe_loss
def _qffl(params: QFFLParams, ctx: RunFacts) -> QFFLAggregator:
    """q-FFL reads each client's loss at the received model from aux ``qffl_loss`` when a client
    sends it, else the mean local training loss (biased low; see QFFLAggregator)."""
    lipschitz = params.lipschitz if params.lipschitz is not None else 1.0 / ctx.client_lr
    return QFFLAggregator(params.q, lipschitz, params.loss_key)
