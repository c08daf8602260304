"""Per-login download budget: what the server sends a login and it does not answer, bounded by
what that login sent, whatever the spacing of its messages.

Counting tasks is not enough. A login that flips its tier slowly (under the flap limit) and never
answers takes a download per task it is given; the orchestrator's drop budget (a few tasks, one
more per ten config minutes) bounds their number per window of time, so the slower it flips, the
fewer bytes it sends per download: with SCAFFOLD's model-sized control variate, 218 flips (35 KB
up) still brought 4-6x their bytes down. Here the currency is bytes. Each login has a balance:

- every message of it the server admits credits ``ratio`` times its payload bytes;
- every task or cancel sent to it debits the bytes it costs the login to receive: the message,
  and with ``--model-http`` the model it names unless it names the one the login was sent last
  (a client keeps the last model it fetched);
- a result for one of its tasks refunds that task's debit (an answered task is work done, not
  amplification);
- a debt is forgiven at the login's own largest debit per ``forgive_s`` wall seconds, so that an
  honest client that left its first task before answering anything is not shut out for good.
  (The unit is the login's own: the run's largest task, a model with every aux array, was five
  times the slow flipper's and let it through early.)

A login whose balance is below zero is held: the orchestrator does not select it
(``felix.core.admission.Admission.hold``) until the balance is back at zero. A task is sent only
to a login not in debt, so over any interval the bytes a login is sent and leaves unanswered are
at most ``ratio`` times what it sent, plus one task, plus what was forgiven. An honest client's
results are model-sized, so answering keeps it far from the line.

Sans-I/O: the wall clock is passed in. Not checkpointed: a resumed server starts every login at
zero (a server restart forgives; a login cannot cause one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

OPEN_TASKS_KEPT = 4  # debits remembered per login for a refund (older ones are never refunded)


@dataclass(slots=True)
class _Login:
    balance: float = 0.0  # bytes of credit (below zero: in debt)
    at: float = 0.0  # wall time the balance was last brought up to date
    held: bool = False
    largest: float = 0.0  # its largest debit: the unit of forgiveness
    model: str = ""  # the hash of the last model it was sent (--model-http)
    open: dict[int, float] | None = None  # task id -> bytes debited for it, until answered or cancelled


@dataclass(slots=True)
class DownloadStats:
    held: int = 0  # times a login went into debt and was held
    bytes_debited: int = 0
    bytes_refunded: int = 0


class DownloadBudget:
    """The balances of every login that was ever sent a task; ``hold(cid, held)`` tells the
    orchestrator whom not to select."""

    def __init__(self, ratio: float, forgive_s: float, hold: Callable[[int, bool], None]) -> None:
        if not ratio > 0 or not forgive_s > 0:
            raise ValueError(
                f"download budget: ratio and forgive_s must be positive, not {ratio}, {forgive_s}"
            )
        self.ratio = ratio
        self.forgive_s = forgive_s
        self._hold = hold
        self._logins: dict[int, _Login] = {}
        self.stats = DownloadStats()

    def received(self, cid: int, nbytes: int, wall: float) -> None:
        """An admitted message of ``nbytes`` from ``cid``: its credit."""
        rec = self._logins.get(cid)
        if rec is not None:  # a login never sent a task owes nothing: no state kept for it
            self._settle(cid, rec, wall, self.ratio * nbytes)

    def sent(
        self, cid: int, task: int, nbytes: int, model: str | None, model_bytes: int, wall: float
    ) -> None:
        """A task (or a cancel, ``task`` < 0: nothing to refund) of ``nbytes`` went to ``cid``; it
        names model ``model`` of ``model_bytes`` (None: the model travels inside)."""
        rec = self._logins.get(cid)
        if rec is None:
            rec = self._logins[cid] = _Login(at=wall)
        cost = float(nbytes)
        if model is not None and model != rec.model:
            cost += model_bytes
            rec.model = model
        rec.largest = max(rec.largest, cost)
        self.stats.bytes_debited += int(cost)
        if task >= 0:
            if rec.open is None:
                rec.open = {}
            rec.open[task] = cost
            while len(rec.open) > OPEN_TASKS_KEPT:
                del rec.open[next(iter(rec.open))]
        self._settle(cid, rec, wall, -cost)

    def closed(self, cid: int, task: int, answered: bool, wall: float) -> None:
        """``cid``'s task ``task`` is over: answered (its debit refunded) or cancelled."""
        rec = self._logins.get(cid)
        if rec is None or rec.open is None:
            return
        cost = rec.open.pop(task, None)
        if cost is not None and answered:
            self.stats.bytes_refunded += int(cost)
            self._settle(cid, rec, wall, cost)

    def sweep(self, wall: float) -> None:
        """Bring the held logins' balances up to ``wall`` (forgiveness), releasing those out of debt."""
        for cid, rec in self._logins.items():
            if rec.held:
                self._settle(cid, rec, wall, 0.0)

    def is_held(self, cid: int) -> bool:
        rec = self._logins.get(cid)
        return rec is not None and rec.held

    def balance(self, cid: int) -> float:
        rec = self._logins.get(cid)
        return 0.0 if rec is None else rec.balance

    def _settle(self, cid: int, rec: _Login, wall: float, delta: float) -> None:
        if rec.balance < 0.0:  # forgiveness pays debt only, never builds credit
            forgiven = max(0.0, wall - rec.at) * rec.largest / self.forgive_s
            rec.balance = min(0.0, rec.balance + forgiven)
        rec.at = max(rec.at, wall)
        rec.balance += delta
        held = rec.balance < 0.0
        if held != rec.held:
            rec.held = held
            if held:
                self.stats.held += 1
            self._hold(cid, held)
