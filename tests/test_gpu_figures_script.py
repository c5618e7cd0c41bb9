"""``benchmarks/gpu/fleet_figures.py --smoke``: the GPU figures' script runs every part (on the CPU, at
toy sizes, staging forced), so that a GPU session spends its minutes measuring, not debugging."""

from __future__ import annotations

import json

import pytest
from helpers import ROOT, run_script

pytestmark = pytest.mark.examples


@pytest.mark.timeout(300)
def test_the_gpu_figures_script_runs_every_part_on_the_cpu(tmp_path):
    out, script = tmp_path / "figures.json", ROOT / "benchmarks" / "gpu" / "fleet_figures.py"
    printed = run_script(str(script), "--smoke", "--json", str(out), deadline_s=280)
    for part in ("(a)", "(b)", "(c)", "(d)", "on paper"):
        assert part in printed, printed
    results = json.loads(out.read_text())
    (model,) = results["staging"]["0"].values()
    for method in ("ring", "ring-local", "ring~h8"):
        assert model[method]["ms"] > 0 and model[method]["vs"] == "nocomm"
    assert set(results["adam"][str(results["args"]["step_params"][0])]) == {"foreach", "fused"}
    assert set(results["codecs"]) == {"int8", "topk:0.01:int4", "randk:0.01:int4"}
    paper = results["planned"]["slow_link_1b_16_nodes_100mbit"]
    # fewer bytes, more throughput: the planner's answer moves the right way with the wire format
    assert paper["ring~h8@int8"]["throughput_vs_nocomm"] > paper["ring~h8"]["throughput_vs_nocomm"]
    assert paper["ring~h8@int8"]["bytes_per_node_step"] < paper["ring~h8"]["bytes_per_node_step"]
