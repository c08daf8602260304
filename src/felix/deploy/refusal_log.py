"""The server's refusal log, bounded: every refused message is counted (the summary's
``rejected_by_reason`` and ``rejected_by_kind``), but only a client's first ``REFUSALS_LOGGED``
and then every ``REFUSALS_LOG_EVERY``-th are logged, so one client publishing refused messages as
fast as it can cannot fill the server's disk with log lines. Nor can many clients (a
population's worth of credentials, or made-up ids on a broker without ACLs): once
``REFUSALS_LOGGED_TOTAL`` lines have been logged in all, only every ``REFUSALS_LOG_EVERY``-th
refusal of the whole server is. Ids outside the population share one count, so a count per
made-up id cannot grow either.
"""

from __future__ import annotations

import logging

from felix.deploy.protocol import Refused

log = logging.getLogger("felix.deploy.server")  # the server's lines, under the server's logger

REFUSALS_LOGGED = 20
REFUSALS_LOGGED_TOTAL = 500
REFUSALS_LOG_EVERY = 1000


class RefusalLog:
    """Per-client refusal counts and the lines logged so far, for a population of ``num_clients``."""

    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients
        self.refused: dict[int, int] = {}  # client id (-1: none, or outside the population) -> refused
        self.logged = 0  # refusal lines logged in all, within REFUSALS_LOGGED_TOTAL

    def log(self, r: Refused, total: int, error: bool = False) -> None:
        """Log ``r`` (counted already: ``total`` refusals in all) within the per-client and the
        server-wide limits (``error``: with the traceback of the exception being handled)."""
        key = r.client if 0 <= r.client < self.num_clients else -1
        n = self.refused[key] = self.refused.get(key, 0) + 1
        if (n <= REFUSALS_LOGGED or n % REFUSALS_LOG_EVERY == 0) and self.logged < REFUSALS_LOGGED_TOTAL:
            self.logged += 1
            if self.logged == REFUSALS_LOGGED_TOTAL:
                note = f" [{total} refused in all; from now on every {REFUSALS_LOG_EVERY}th of the server's is logged]"
            elif n >= REFUSALS_LOGGED:
                note = f" [{n} refused from this client; from now on every {REFUSALS_LOG_EVERY}th is logged]"
            else:
                note = ""
        elif total % REFUSALS_LOG_EVERY == 0:
            note = f" [{total} refused in all, {n} from this client; every {REFUSALS_LOG_EVERY}th is logged]"
        else:
            return
        log.warning(
            "rejected message from client %d (task %d): %s%s%s",
            r.client,
            r.task,
            r.reason,
            f" ({r.detail})" if r.detail else "",
            note,
            exc_info=error,
        )
