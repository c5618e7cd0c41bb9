"""A Hugging Face Accelerate loop with gossip instead of DDP: the line that builds the accelerator changes.

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_classifier.py        # gossip
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_classifier.py --ddp  # DDP

``accelerate launch --multi_gpu`` starts the processes with torchrun; without a GPU the script asks
for the CPU (``cpu=True``) and the processes form a gloo group. A small MLP (32-128-128-10) learns a
synthetic task (10 overlapping Gaussian clusters in 32 dimensions, from a fixed seed) with the loop of
Accelerate's docs: ``prepare``, ``accumulate``, ``backward``, ``clip_grad_norm_``, a prepared LR
scheduler, ``gather_for_metrics`` and ``save_state``. Evaluation runs on the exact global average of
the replicas (``with accelerator.averaged():``); training then continues from each rank's own replica.
"""

import argparse
import contextlib
import json
import math
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from decent_optim_wrapper.integrations.accelerate import DecentralizedAccelerator

FEATURES, CLASSES, TRAIN_POINTS, VAL_POINTS = 32, 10, 16384, 4096


def make_data() -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(CLASSES, FEATURES, generator=g) * 0.5
    labels = torch.randint(0, CLASSES, (TRAIN_POINTS + VAL_POINTS,), generator=g)
    points = centers[labels] + torch.randn(TRAIN_POINTS + VAL_POINTS, FEATURES, generator=g)
    return (
        TensorDataset(points[:TRAIN_POINTS], labels[:TRAIN_POINTS]),
        TensorDataset(points[TRAIN_POINTS:], labels[TRAIN_POINTS:]),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ddp", action="store_true", help="Accelerate's own DDP instead of gossip")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="per process and accumulated step")
    parser.add_argument("--accumulation", type=int, default=2, help="gradient_accumulation_steps")
    parser.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    parser.add_argument("--out", default="runs", help="where save_state writes")
    parser.add_argument("--json", help="write the final metrics here (rank 0)")
    args = parser.parse_args()

    options = {
        "cpu": not torch.cuda.is_available(),
        "gradient_accumulation_steps": args.accumulation,
        "mixed_precision": args.mixed_precision,
    }
    # The one line that changes:
    accelerator = Accelerator(**options) if args.ddp else DecentralizedAccelerator(**options, topology="ring")
    method = "ddp" if args.ddp else "decentralized"

    set_seed(0)
    train, val = make_data()
    model = nn.Sequential(
        nn.Linear(FEATURES, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, CLASSES)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    micro_batch = args.batch_size // args.accumulation
    train_loader = DataLoader(train, batch_size=micro_batch, shuffle=True)
    val_loader = DataLoader(val, batch_size=256)
    steps = args.epochs * math.ceil(len(train) / accelerator.num_processes / args.batch_size)
    # a prepared scheduler steps once per process per optimizer step (Accelerate's rule)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=3e-3, total_steps=steps * accelerator.num_processes + 1
    )
    model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, val_loader, scheduler
    )

    def evaluate() -> dict[str, float]:
        # gossip: the exact global average of the replicas; DDP's replicas are equal already
        averaged = contextlib.nullcontext() if args.ddp else accelerator.averaged()
        model.eval()
        losses, correct, seen = 0.0, 0, 0
        with averaged, torch.no_grad():
            for x, y in val_loader:
                logits, y = accelerator.gather_for_metrics((model(x), y))
                losses += float(nn.functional.cross_entropy(logits.float(), y, reduction="sum"))
                correct += int((logits.argmax(-1) == y).sum())
                seen += len(y)
        model.train()
        return {"val_loss": losses / seen, "val_acc": correct / seen}

    start, optimizer_steps = time.perf_counter(), 0
    for epoch in range(args.epochs):
        for x, y in train_loader:
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer_steps += 1
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        metrics = evaluate()
        loss, accuracy = metrics["val_loss"], metrics["val_acc"]
        accelerator.print(f"{method}: epoch {epoch + 1}: val_loss {loss:.4f} val_acc {accuracy:.4f}")
    ms_per_step = 1000 * (time.perf_counter() - start) / max(optimizer_steps, 1)
    state = Path(args.out) / f"accelerate-{method}" / "state"
    accelerator.save_state(str(state))  # gossip: each rank's part beside Accelerate's files
    accelerator.print(f"{method}: {optimizer_steps} steps, {ms_per_step:.1f} ms per step; saved {state}")
    if args.json and accelerator.is_main_process:
        Path(args.json).write_text(json.dumps({**metrics, "ms_per_step": ms_per_step, "method": method}))
    accelerator.end_training()


if __name__ == "__main__":
    main()
