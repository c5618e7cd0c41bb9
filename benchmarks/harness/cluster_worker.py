"""What every rank of the emulated cluster shares: the collective timeout, its result file, CPU counters.

The ranks (``benchmarks/cluster/rank.py``) write their results with
:func:`write_atomically`, so that a driver that kills them at its deadline never reads half a file.
"""

from __future__ import annotations

import json
import os
import resource
from datetime import timedelta

#: How long any collective may wait for a peer before raising (the drivers also kill at a deadline).
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


def write_atomically(path: str, result: object) -> None:
    """Replace ``path`` in one rename."""
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(result, f)
    os.replace(partial, path)


def busy_cpu_seconds() -> float:
    """Seconds all cores of the machine spent busy since boot (``/proc/stat``: all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds of this process, all its threads (gloo's included), user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
