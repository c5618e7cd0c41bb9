"""The HSDP benchmark's pieces that need no process group: arguments, tables, the planner's prediction.

``benchmarks/hsdp/hsdp.py`` must reject methods and configurations it cannot run before it starts any
process, turn the workers' results into per-rank bytes and ratios correctly (a node's link counter is
read by each of its ranks), and ask the planner for the shard at the per-rank share of the node's
link; ``benchmarks/hsdp/hsdp_worker.py`` must count a storage once however many views point into it.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.hsdp import hsdp, hsdp_worker

pytestmark = pytest.mark.pure


def test_defaults_run_every_method_and_configuration():
    args = hsdp.parse_args([])
    assert args.methods == list(hsdp.CLUSTER_METHODS) and args.memory_configs == list(hsdp.MEMORY_CONFIGS)
    assert (args.nodes, args.shards, args.bandwidth) == (4, 2, "40mbit")
    assert hsdp.worker_namespace(args).workers_per_node == 2
    assert hsdp.memory_world_size("whole", 2, 2) == 2 and hsdp.memory_world_size("torch-hsdp", 2, 2) == 4


@pytest.mark.parametrize(
    "argv",
    [
        ["--methods", "ring-module"],  # the module front-end is not benchmarked with FSDP2
        ["--methods", "ring@zip"],
        ["--memory-configs", "torch-hsdp@bf16"],
        ["--bandwidth", "fast"],
        ["--shards", "1"],
    ],
)
def test_rejects_what_it_cannot_run(argv, capsys):
    with pytest.raises(SystemExit):
        hsdp.parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_memory_table_reports_the_largest_rank_and_ratios_to_whole():
    def rank(total: int, growth: int) -> dict:
        held = dict.fromkeys(hsdp.HELD_COLUMNS, 0) | {"params": total, "total": total}
        return {"held": held, "rss_growth": growth, "peak_rss_growth": 2 * growth}

    rows = hsdp.memory_rows(
        {
            "whole": [rank(100, 10), rank(80, 8)],
            "gossip-hsdp": [rank(50, 6), rank(60, 5), rank(40, 4), rank(0, 0)],
        }
    )
    assert rows["whole"]["total"] == 100 and rows["gossip-hsdp"]["total"] == 60
    assert rows["gossip-hsdp"]["ranks"] == 4 and rows["gossip-hsdp"]["peak_rss_growth"] == 12
    header, whole, sharded = hsdp.memory_table(rows)
    assert header.split()[:3] == ["config", "ranks", "params"]
    assert whole.split()[8] == "1.000" and sharded.split()[8] == "0.600"  # tensors / whole
    assert sharded.split()[-1] == "0.600"  # peak RSS / whole's


def test_cluster_rows_count_each_node_link_once_per_rank():
    """Ranks 0, 1 share node 0's counter (read a moment apart), ranks 2, 3 node 1's."""
    sent = [
        {"counted": 1e6, "shard_bytes": 1e6, "link_tx_per_step": tx} for tx in (2.0e6, 2.2e6, 1.8e6, 1.8e6)
    ]
    runs = {
        "ring": {
            "median_s": 0.5,
            "mean_s": 0.52,
            "rank_means_s": [0.5] * 4,
            "round_medians_s": [0.5, 0.5],
            "bytes_sent_per_step": sent,
            "measured": {"cpu_s": [[0.4, 0.6]] * 4},
        }
    }
    row = hsdp.cluster_rows(runs, shards=2, iters=10)["ring"]
    assert row["link_bytes"] == pytest.approx((2.1e6 / 2 + 1.8e6 / 2) / 2)
    assert row["link_bytes_max"] == pytest.approx(2.1e6 / 2)
    assert row["cpu_ms"] == pytest.approx(50.0) and row["median_ms"] == 500.0
    lines = hsdp.cluster_table({"torch-hsdp": {**row, "median_ms": 1000.0}, "ring": row}, {"ring": 420.0}, {})
    assert lines[2].split()[:3] == ["ring", "500.0", "2.000"] and "420.0" in lines[2]


def test_planner_predicts_the_shard_at_each_rank_share_of_the_link():
    methods = ["fsdp", "torch-hsdp", "ring", "ring@bf16"]
    shard = 1e6
    predicted = hsdp.planner_predictions(methods, shard, 400.0, "40mbit", 4, 2, 1 / 3)
    assert predicted["fsdp"] == pytest.approx(400.0)  # the planner's no-comm step: the compute
    # one shard at 20 Mbit/s (two ranks share the 40 Mbit/s link) takes 400 ms: gossip overlaps it
    assert 400.0 <= predicted["ring"] <= 450.0 and predicted["ring@bf16"] <= predicted["ring"]
    # torch's HSDP as DDP on the shard: 1.5 shards after the last bucket is ready, not hidden
    assert predicted["torch-hsdp"] > 400.0 + 0.5 * 1.5 * 400.0
    with_overhead = hsdp.planner_predictions(methods, shard, 400.0, "40mbit", 4, 2, 1 / 3, overhead_ms=50.0)
    assert with_overhead["fsdp"] == pytest.approx(450.0)
    command = hsdp.planner_command(shard, hsdp.parse_args(["--methods", *methods]))
    assert "--model-bytes 1000000" in command and "--bandwidth 20mbit --nodes 4" in command


def test_worker_counts_a_storage_once_and_a_plain_optimizer_has_no_engine():
    base = torch.zeros(100)
    seen: set[int] = set()
    assert hsdp_worker.storage_bytes([base[:10], base[50:], None], seen) == 400
    assert hsdp_worker.storage_bytes([base], seen) == 0
    model = torch.nn.Linear(10, 10)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 10)).sum().backward()
    optimizer.step()
    held = hsdp_worker.held_tensor_bytes(model, optimizer)
    assert held["params"] == held["grads"] == 440 and held["engine_copy"] == held["gossip_buffers"] == 0
    assert held["optimizer_state"] >= 2 * 440 and held["total"] == sum(
        v for k, v in held.items() if k != "total"
    )


def test_worker_memory_configurations():
    assert hsdp_worker.memory_args(
        ["--config", "gossip-hsdp@bf16", "--rank", "0", "--world-size", "4", "--out", "x"]
    )
    with pytest.raises(SystemExit):
        hsdp_worker.memory_args(["--config", "ddp", "--rank", "0", "--world-size", "2", "--out", "x"])
