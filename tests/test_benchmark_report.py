"""The benchmarks' shared report writing: tables, missing figures, the command in every result file."""

from __future__ import annotations

import argparse
import json
import math
import sys

import pytest

from benchmarks.harness.report import add_output_arguments, cell, markdown_table, save

pytestmark = pytest.mark.pure


def test_cells_show_missing_figures_as_a_dash() -> None:
    assert cell(None) == "-"
    assert cell(math.nan) == "-"
    assert cell(1.23456) == "1.235"
    assert cell(1234, ",d") == "1,234"
    assert cell("ring") == "ring"


def test_markdown_table_and_a_row_of_the_wrong_width() -> None:
    text = markdown_table(["method", "ratio"], [["ring", 1.0], ["ddp", None]])
    assert text.splitlines() == ["| method | ratio |", "| --- | --- |", "| ring | 1.000 |", "| ddp | - |"]
    with pytest.raises(ValueError, match="2 cells for a header of 3"):
        markdown_table(["a", "b", "c"], [[1, 2]])


def test_save_writes_the_command_beside_the_results(tmp_path, monkeypatch, capsys) -> None:
    parser = argparse.ArgumentParser()
    add_output_arguments(parser)
    out, table = tmp_path / "r.json", tmp_path / "r.txt"
    argv = ["benchmarks/x/run.py", "--json", str(out), "--table", str(table)]
    monkeypatch.setattr(sys, "argv", argv)
    save(parser.parse_args(argv[1:]), {"ring": 1.5}, "| a |")
    payload = json.loads(out.read_text())
    assert payload["command"].startswith("uv run benchmarks/x/run.py --json")
    assert payload["results"] == {"ring": 1.5}
    assert table.read_text().splitlines()[0] == "$ " + payload["command"]
    assert "| a |" in capsys.readouterr().out
