"""Store entries the job refuses because they do not carry its secret: logged and counted.

Whoever reaches the store can write to it (:mod:`~.sealing`); what such a process writes without the
job's secret is ignored: a forged application is refused before any agreement, a forged verdict,
fate, decision or report is passed over. Each refusal is logged at warning level, on by default as
survival's and the guard's logs are (an operator should see that someone writes into the job's
store), once per key and process, and counted by kind (:data:`REFUSALS`, read through the front-ends'
``guard_counts`` as ``forged_<kind>``).
"""

from __future__ import annotations

import threading
from collections import Counter

from loguru import logger

__all__ = ["REFUSALS", "Refusals"]


class Refusals:
    """This process's refused entries: a count per kind, each key logged once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the heartbeat thread refuses applications too
        self._seen: set[str] = set()
        self.counts: Counter[str] = Counter()

    def forged(self, kind: str, key: str, err: BaseException) -> None:
        """Note a forged ``kind`` ("application", "verdict", "fate", "decision", "report") at ``key``."""
        with self._lock:
            if key in self._seen:
                return
            self._seen.add(key)
            self.counts[f"forged_{kind}"] += 1
        logger.warning("a forged {} in the job's store is ignored (key {!r}): {}", kind, key, err)


#: The refusals of this process (one engine per process joins or holds a membership).
REFUSALS = Refusals()
