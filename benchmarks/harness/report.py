"""What every benchmark driver writes: a markdown table, the raw results as JSON, the command.

A driver builds its table with :func:`markdown_table` (cells through :func:`cell`, so a missing
figure prints ``-``), then calls :func:`save`, which prints the table and writes it to ``--table``
and the results to ``--json``, both headed by the command that made them: a result file in
``benchmarks/results/`` says how to make it again.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--json PATH`` and ``--table PATH``, the two outputs :func:`save` writes."""
    parser.add_argument("--json", help="write the raw results (and the command) here")
    parser.add_argument("--table", help="write the printed table (and the command) here")


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that ran this driver, as a user would type it from the repository root."""
    args = list(sys.argv if argv is None else argv)
    return "uv run " + " ".join(shlex.quote(a) for a in args)


def cell(value: object, spec: str = ".3f") -> str:
    """``value`` formatted with ``spec``; ``-`` for None or NaN (a figure that was not measured)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, str):
        return value
    return format(value, spec)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]], spec: str = ".3f") -> str:
    """A markdown table: ``header``, then one line per row, numbers formatted with ``spec``."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"a row has {len(row)} cells for a header of {len(header)}: {row!r}")
        lines.append("| " + " | ".join(cell(v, spec) for v in row) + " |")
    return "\n".join(lines)


def titled_table(
    title: str, header: Sequence[str], rows: Iterable[Sequence[object]], spec: str = ".3f"
) -> str:
    """One section of a report: ``title``, a blank line, then the rows' :func:`markdown_table`."""
    return f"{title}\n\n{markdown_table(header, rows, spec)}"


def save(args: argparse.Namespace, results: Any, text: str) -> None:
    """Print ``text``; write it to ``args.table`` and ``results`` to ``args.json`` where given.

    Both files start from the command line, so each result in ``benchmarks/results/`` names the
    command that made it (the JSON under ``"command"``, beside ``"args"`` and ``"results"``).
    """
    print(text, flush=True)
    command = command_line()
    if getattr(args, "table", None):
        Path(args.table).write_text(f"$ {command}\n\n{text}\n")
    if getattr(args, "json", None):
        payload = {"command": command, "args": vars(args), "results": results}
        Path(args.json).write_text(json.dumps(payload, indent=1, default=str) + "\n")
