"""The Lightning, Hugging Face and Accelerate examples end to end, as a user runs them, on a short run each.

Each script starts its own processes (Lightning's launcher; torchrun for the Trainer; accelerate launch)
and runs in a process group of its own with a hard deadline, in a temporary directory (they write under
runs/).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import helpers
import pytest

pytestmark = pytest.mark.examples

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 150  # starting 2 processes that import torch and a framework (seconds each), then training


def run_script(cwd: Path, *argv: str) -> str:
    """What the script prints, run in ``cwd`` offline, with the deadline above."""
    return helpers.run_script(
        *argv, cwd=cwd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, deadline_s=DEADLINE_S
    )


@pytest.mark.timeout(DEADLINE_S + 30)
def test_lightning_example_trains_with_lightnings_launcher(tmp_path: Path) -> None:
    pytest.importorskip("lightning", reason="the [lightning] extra is not installed")
    results = tmp_path / "results.json"
    output = run_script(
        tmp_path, str(ROOT / "examples/lightning_mlp.py"), "--epochs", "1", "--json", str(results)
    )
    metrics = json.loads(results.read_text())
    assert metrics["val_acc"] > 0.3  # 10 classes: chance is 0.1
    assert "decentralized: val_loss" in output and "val_acc" in output
    assert list((tmp_path / "runs" / "lightning-decentralized").rglob("*.ckpt.rank1"))  # each rank's part


@pytest.mark.timeout(DEADLINE_S + 30)
def test_hf_example_trains_under_torchrun(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the [transformers] extra is not installed")
    results = tmp_path / "results.json"
    output = run_script(tmp_path, str(ROOT / "examples/hf_gpt2.py"), "--steps", "8", "--json", str(results))
    metrics = json.loads(results.read_text())
    assert metrics["eval_loss"] < metrics["train_loss"] + 1.0 and metrics["ms_per_step"] > 0
    assert "best possible loss" in output and "eval_loss" in output
    checkpoint = tmp_path / "runs" / "hf-decentralized" / "checkpoint-4"
    assert (checkpoint / "decent_rank0-of-2.pt").exists() and (checkpoint / "decent_rank1-of-2.pt").exists()


@pytest.mark.timeout(DEADLINE_S + 30)
def test_hsdp_example_trains_sharded_replicas_under_torchrun(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    output = run_script(tmp_path, str(ROOT / "examples/hsdp.py"), "--steps", "10", "--json", str(results))
    metrics = json.loads(results.read_text())
    # 2 replicas x 2 shards: a rank sends its shard, half of the model's 532k fp32 parameters (2.13 MB).
    assert metrics["trainer"] == "gossip" and 0 < metrics["bytes_sent_per_step"] < 1.5e6
    assert metrics["val_loss"] < 1.0 and "step 10: train loss" in output
    assert "Warning" not in output  # an example runs clean (FSDP2 warned of a model returning a view)


@pytest.mark.timeout(DEADLINE_S + 30)
def test_accelerate_example_trains_under_accelerate_launch(tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="the [accelerate] extra is not installed")
    results = tmp_path / "results.json"
    launch = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    script = [str(ROOT / "examples/accelerate_classifier.py"), "--epochs", "1", "--json", str(results)]
    output = run_script(tmp_path, *launch, *script)
    metrics = json.loads(results.read_text())
    assert metrics["method"] == "decentralized" and metrics["val_acc"] > 0.3  # 10 classes: chance is 0.1
    assert "decentralized: epoch 1: val_loss" in output
    state = tmp_path / "runs" / "accelerate-decentralized" / "state"
    assert (state / "decent_rank0-of-2.pt").exists() and (state / "decent_rank1-of-2.pt").exists()
