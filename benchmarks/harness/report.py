"""What every benchmark driver writes: markdown tables, printed and written to ``--table``, and the raw
results to ``--json``, both headed by the command that made them."""

import argparse
import json
import math
import shlex
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

Rows = Iterable[Sequence[object]]


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", help="write the raw results (and the command) here")
    parser.add_argument("--table", help="write the printed table (and the command) here")


def cell(value: object, spec: str = ".3f") -> str:
    """``value`` formatted with ``spec``; ``-`` for None or NaN (a figure that was not measured)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return value if isinstance(value, str) else format(value, spec)


def markdown_table(header: Sequence[str], rows: Rows, spec: str = ".3f") -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"a row has {len(row)} cells for a header of {len(header)}: {row!r}")
        lines.append("| " + " | ".join(cell(v, spec) for v in row) + " |")
    return "\n".join(lines)


def titled_table(title: str, header: Sequence[str], rows: Rows, spec: str = ".3f") -> str:
    return f"{title}\n\n{markdown_table(header, rows, spec)}"


def save(args: argparse.Namespace, results: Any, text: str) -> None:
    """Print ``text``; write it to ``args.table`` and ``results`` to ``args.json`` where given."""
    print(text, flush=True)
    command = "uv run " + shlex.join(sys.argv)  # as a user would type it from the repository root
    if getattr(args, "table", None):
        Path(args.table).write_text(f"$ {command}\n\n{text}\n")
    if getattr(args, "json", None):
        payload = {"command": command, "args": vars(args), "results": results}
        Path(args.json).write_text(json.dumps(payload, indent=1, default=str) + "\n")
