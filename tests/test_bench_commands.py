"""The benchmark commands the docs quote: each parses with its driver, each is in the command table of
docs/benchmarks.md, and each question of that table runs end to end at a toy size in some test.

Every driver (``benchmarks/<kind>/run.py``, ``benchmarks/gpu/fleet_figures.py``) has a module-level
``parse_args(argv)``: the command line a doc gives is fed to it as written, optional parts (in
brackets) left out and placeholders (``PATH``, ``N``) filled in, so a renamed flag or question fails
here rather than in a reader's shell.
"""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

ROOT = Path(__file__).parents[1]
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "benchmarks" / "README.md"]
TABLE = ROOT / "docs" / "benchmarks.md"
#: ``uv run [--group G] benchmarks/...py ARGS``, after an optional ``sudo`` and ``flock LOCK``.
COMMAND = re.compile(
    r"(?:sudo )?(?:flock \S+ )?uv run (?:--group \w+ )?(benchmarks/[\w/]+\.py)((?: [^`#\n]*)?)"
)
#: What a placeholder stands for when a command is parsed.
PLACEHOLDERS = {"PATH": "/tmp/out.json", "N": "2", "K": "10", "S": "0", "DIR": "/tmp"}


def quoted_commands() -> list[tuple[str, str, list[str]]]:
    """(doc, script, argv) of every benchmark command the docs quote, optional parts left out."""
    found = []
    for doc in DOCS:
        text = re.sub(r"\\\n\s*", " ", doc.read_text())  # a shell line continued
        text = re.sub(
            r"(?<!`)`[^`]+`(?!`)", lambda span: " ".join(span.group().split()), text
        )  # a wrapped one
        for match in COMMAND.finditer(text):
            args = match.group(2).replace("\\|", "|")
            while re.search(r"\[[^\[\]]*\]", args):  # optional parts, innermost first
                args = re.sub(r"\[[^\[\]]*\]", "", args)
            argv = [PLACEHOLDERS.get(word, word) for word in shlex.split(args)]
            if argv[:1] != ["QUESTION"]:  # the driver's form, not a command
                found.append((doc.name, match.group(1), argv))
    return found


def driver(script: str):
    return importlib.import_module(script.removesuffix(".py").replace("/", "."))


def question(argv: list[str]) -> str | None:
    return argv[0] if argv and not argv[0].startswith("-") else None


def table_entries() -> set[tuple[str, str | None]]:
    """(script, question) of each row of the command table (its first column)."""
    entries = set()
    for line in TABLE.read_text().splitlines():
        match = re.match(r"\| `(benchmarks/[\w/]+\.py)(?: ([\w-]+))?`", line)
        if match:
            entries.add((match.group(1), match.group(2)))
    return entries


COMMANDS = quoted_commands()


def test_the_docs_quote_benchmark_commands_from_every_driver() -> None:
    scripts = {script for _, script, _ in COMMANDS}
    drivers = {str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").glob("*/run.py")}
    assert drivers <= scripts, f"drivers no doc quotes: {sorted(drivers - scripts)}"


@pytest.mark.parametrize(
    ("doc", "script", "argv"), COMMANDS, ids=[f"{d}:{s} {' '.join(a)}" for d, s, a in COMMANDS]
)
def test_each_quoted_command_parses_with_its_driver(doc: str, script: str, argv: list[str]) -> None:
    module = driver(script)
    assert hasattr(module, "parse_args"), f"{script} (quoted in {doc}) has no parse_args(argv)"
    try:
        module.parse_args(argv)
    except SystemExit as exit_:
        pytest.fail(
            f"{doc} quotes `{script} {shlex.join(argv)}`, which its driver refuses (exit {exit_.code})"
        )


def test_every_quoted_question_is_in_the_command_table_of_the_benchmarks_page() -> None:
    table = table_entries()
    missing = {(s, question(a)) for _, s, a in COMMANDS if (s, question(a)) not in table}
    assert not missing, f"quoted but not in docs/benchmarks.md's table: {sorted(missing, key=str)}"


#: Where each row of the command table runs at a toy size: the driver's question end to end, or (the
#: emulated cluster's questions, whose cluster the ``speed`` test builds) the ranks it starts, on
#: loopback; results-only questions on committed results.
TOY_RUNS = {
    ("benchmarks/convergence/run.py", "classification"): (
        "test_bench_convergence.py::test_classification_adds_the_references_and_trains_paced_rounds"
    ),
    ("benchmarks/convergence/run.py", "lm"): (
        "test_bench_convergence.py::test_lm_trains_a_paced_method_by_rounds_and_evaluates_the_average"
    ),
    ("benchmarks/convergence/run.py", "adam_rules"): (
        "test_bench_convergence.py::test_adam_rules_with_one_replica_every_unfloored_rule_is_adam_and_gossip_mixes_late"
    ),
    ("benchmarks/convergence/run.py", "seeds"): (
        "test_bench_convergence.py::test_reuse_takes_a_result_of_the_same_flags_and_seeds_divide_by_each_runs_own_ddp"
    ),
    ("benchmarks/convergence/run.py", "attack"): (
        "test_bench_convergence.py::test_attack_reports_a_lost_plain_job_and_a_held_clipped_one"
    ),
    ("benchmarks/convergence/run.py", "accelerate"): (
        "test_bench_convergence.py::test_accelerate_trains_every_kind_of_method"
    ),
    **{
        ("benchmarks/costs/run.py", name): (
            "test_bench_costs.py::test_every_question_runs_end_to_end_and_reports_what_it_measures"
        )
        for name in ("overhead", "second_moment", "compression", "metrics", "status_records", "import_time")
    },
    ("benchmarks/cluster/run.py", "speed"): (
        "test_bench_cluster.py::test_speed_question_end_to_end_on_the_emulated_cluster"
    ),
    (
        "benchmarks/cluster/run.py",
        "low_comm",
    ): "test_bench_cluster.py::test_rank_times_every_kind_of_method_on_loopback",
    (
        "benchmarks/cluster/run.py",
        "accelerate",
    ): "test_bench_cluster.py::test_accelerate_and_fleet_ranks_on_loopback",
    (
        "benchmarks/cluster/run.py",
        "uneven",
    ): "test_bench_cluster.py::test_accelerate_and_fleet_ranks_on_loopback",
    (
        "benchmarks/cluster/run.py",
        "scaling",
    ): "test_bench_cluster.py::test_rank_times_every_kind_of_method_on_loopback",
    ("benchmarks/cluster/run.py", "report"): (
        "test_bench_cluster.py::test_report_replays_every_committed_scaling_run_within_15_percent"
    ),
    ("benchmarks/cluster/run.py", "link_sharing"): (
        "test_bench_cluster.py::test_link_sharing_fits_the_committed_run"
    ),
    ("benchmarks/cluster/run.py", "hsdp"): "test_bench_cluster.py::test_hsdp_memory_part_end_to_end",
    ("benchmarks/faults/run.py", "kills"): (
        "test_bench_faults.py::test_kills_one_short_run_survives_every_failure_without_corruption"
    ),
    ("benchmarks/faults/run.py", "rejoins"): (
        "test_bench_faults.py::test_rejoins_killed_workers_come_back_and_the_world_is_whole_again_without_corruption"
    ),
    ("benchmarks/faults/run.py", "joining"): (
        "test_bench_faults.py::test_joining_measures_the_pause_the_joiner_and_the_per_step_cost"
    ),
    (
        "benchmarks/faults/run.py",
        "lost-worker",
    ): "test_bench_faults.py::test_lost_worker_trains_both_arms_and_judges_them",
    ("benchmarks/faults/run.py", "grow-back"): (
        "test_bench_faults.py::test_grow_back_against_no_failure_and_a_restart_from_checkpoint"
    ),
    (
        "benchmarks/faults/run.py",
        "node-check",
    ): "test_bench_faults.py::test_node_check_runs_both_jobs_and_reports_the_check",
    **{
        ("benchmarks/time_to_loss/run.py", name): (
            "test_bench_time_to_loss.py::test_each_cluster_question_runs_end_to_end_at_a_toy_size"
        )
        for name in ("slow-link", "scale-model", "uneven")
    },
    ("benchmarks/time_to_loss/run.py", "lm"): (
        "test_bench_time_to_loss.py::test_lm_multiplies_steps_by_the_planners_step_time"
    ),
    (
        "benchmarks/gpu/fleet_figures.py",
        None,
    ): "test_gpu_figures_script.py::test_the_gpu_figures_script_runs_every_part_on_the_cpu",
}


def test_each_question_of_the_command_table_runs_at_a_toy_size_in_a_named_test() -> None:
    """Every row has its toy run, and that test exists and hands the driver the question."""
    table = table_entries()
    assert set(TOY_RUNS) == table, {
        "rows without a toy run": sorted(table - set(TOY_RUNS), key=str),
        "toy runs of no row": sorted(set(TOY_RUNS) - table, key=str),
    }
    for (script, name), test in TOY_RUNS.items():
        file, function = test.split("::")
        source = (ROOT / "tests" / file).read_text()
        body = re.search(rf"^def {function}\(.*?(?=^\S)", source + "\nEND", re.S | re.M)
        assert body, f"{test} (the toy run of {script} {name or ''}) does not exist"
        module = Path(script).stem if name is None else name
        assert module in body.group() or Path(script).parent.name in body.group(), (
            f"{test} does not name {script} {name or ''}"
        )
