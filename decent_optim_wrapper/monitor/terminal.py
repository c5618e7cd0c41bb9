"""The terminal view: one row per worker, the job's events below, redrawn every refresh."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["render"]

_COLUMNS = (
    ("member", "member"),
    ("state", "state"),
    ("rank", "rank"),
    ("host", "host"),
    ("pid", "pid"),
    ("step", "step"),
    ("steps/s", "steps_per_s"),
    ("world", "world_size"),
    ("gen", "generation"),
    ("sent", "bytes_sent"),
    ("wait s", "wait_s"),
    ("joins", "joins"),
    ("losses", "losses"),
    ("guard", "guard"),
    ("consensus", "consensus"),
    ("age s", "age_s"),
)


def _bytes(value: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(value) < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


def _cell(field: str, value: Any) -> str:
    if value is None:
        return "-"
    if field == "bytes_sent":
        return _bytes(float(value))
    if field == "guard":
        return ",".join(f"{k}={v}" for k, v in sorted(value.items()) if v) or "0"
    if field == "consensus":
        return f"{float(value):.3g}"
    if isinstance(value, float):
        return f"{value:.2f}" if field != "age_s" else f"{value:.0f}"
    return str(value)


def _event(event: dict[str, Any]) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(float(event.get("time", 0.0))))
    members = ", ".join(str(m) for m in event.get("members", []))
    if event.get("kind") == "joined":
        donors = ", ".join(str(d) for d in event.get("donors", []))
        what = f"member(s) {members} joined (donor(s) {donors})"
    elif event.get("kind") == "lost":
        what = f"member(s) {members} lost"
    else:
        what = f"{event.get('kind')}: {members}"
    return (
        f"{when}  step {event.get('step', '-')}  generation {event.get('generation', '-')}  {what}; "
        f"world size {event.get('world_size', '-')}"
    )


def render(view: dict[str, Any], width: int = 200) -> str:
    """``view`` (:func:`~.view.fleet_view`) as text: a header, a table of workers, the events."""
    lines = [
        f"job {view['job']!r} at {view['store']}: {view['world_size']} member(s), generation "
        f"{view['generation']}  ({time.strftime('%H:%M:%S', time.localtime(view['time']))})",
        "",
    ]
    table = [[title for title, _ in _COLUMNS]]
    for row in view["members"]:
        table.append([_cell(field, row.get(field)) for _, field in _COLUMNS])
    widths = [max(len(r[i]) for r in table) for i in range(len(_COLUMNS))]
    for cells in table:
        pairs = enumerate(zip(cells, widths, strict=True))
        padded = (c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in pairs)
        lines.append("  ".join(padded))
    lines += ["", "events:" if view["events"] else "events: none yet"]
    lines += [f"  {_event(e)}" for e in view["events"]]
    for member, why in view.get("refused", {}).items():
        lines.append(f"  member {member}'s record does not verify: {why}")
    return "\n".join(line[:width] for line in lines)
