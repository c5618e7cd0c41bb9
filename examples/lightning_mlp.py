"""A PyTorch Lightning run with gossip instead of DDP: one argument changes.

    uv run examples/lightning_mlp.py                     # DecentralizedStrategy on 2 local CPU processes
    uv run examples/lightning_mlp.py --strategy ddp      # Lightning's own DDP, the same seeds
    uv run examples/lightning_mlp.py --compare           # both, then a table: loss, accuracy, ms per step
    torchrun --nproc-per-node 2 examples/lightning_mlp.py    # or let torchrun start the processes

Lightning starts the processes itself (``devices=N`` on CPU). A small MLP (32-128-128-10) learns a
synthetic task (10 overlapping Gaussian clusters in 32 dimensions, from a fixed seed). The model,
the data and the Trainer are plain Lightning; only ``strategy=`` differs between the two runs.
Validation runs on the exact global average of the replicas; ModelCheckpoint keeps the best model
by validation accuracy (the average, loadable with ``Classifier.load_from_checkpoint``).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from decent_optim_wrapper.integrations.lightning import DecentralizedStrategy

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


class Classifier(pl.LightningModule):
    """An ordinary LightningModule: nothing in it knows about gossip."""

    def __init__(self, lr: float = 0.05, epochs: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(FEATURES, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, CLASSES)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), prog_bar=True, sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.hparams.epochs)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


class StepTimer(pl.Callback):
    """Wall time of each training step (forward, backward, optimizer step with its communication)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)


def train(strategy_name: str, devices: int, epochs: int, topology: str, out: str | None) -> None:
    pl.seed_everything(0, verbose=False)
    train_set, val_set = make_data()
    strategy: Any = DecentralizedStrategy(topology=topology) if strategy_name == "decentralized" else "ddp"
    timer = StepTimer()
    root = Path("runs") / f"lightning-{strategy_name}"
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=epochs,
        default_root_dir=root,
        callbacks=[
            timer,
            pl.callbacks.ModelCheckpoint(monitor="val_acc", mode="max"),
            pl.callbacks.LearningRateMonitor(),
        ],
        logger=pl.loggers.CSVLogger(root),
        enable_model_summary=False,
    )
    model = Classifier(epochs=epochs)
    trainer.fit(
        model,
        DataLoader(train_set, batch_size=64, shuffle=True),
        DataLoader(val_set, batch_size=256),
    )
    metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}
    steady = timer.times[len(timer.times) // 10 :]  # leave out the first steps (lazy initialisation)
    ms_per_step = 1000 * sum(steady) / len(steady)
    if trainer.is_global_zero:
        print(
            f"{strategy_name}: val_loss {metrics['val_loss']:.4f}  val_acc {metrics['val_acc']:.4f}  "
            f"{ms_per_step:.2f} ms/step  best checkpoint: {trainer.checkpoint_callback.best_model_path}"
        )
        if out:
            Path(out).write_text(json.dumps({**metrics, "ms_per_step": ms_per_step}))


def compare(args: argparse.Namespace) -> None:
    results = {}
    for name in ("decentralized", "ddp"):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
            out = handle.name
        command = [sys.executable, __file__, "--strategy", name, "--devices", str(args.devices)]
        command += ["--epochs", str(args.epochs), "--topology", args.topology, "--json", out]
        subprocess.run(command, check=True, timeout=1800)
        results[name] = json.loads(Path(out).read_text())
        os.unlink(out)
    print(f"\n{args.devices} CPU processes, {args.epochs} epochs, the same seeds:")
    print(f"{'strategy':<22}{'train_loss':>12}{'val_loss':>10}{'val_acc':>9}{'ms/step':>9}")
    for name, r in results.items():
        label = f"{name} ({args.topology})" if name == "decentralized" else name
        print(
            f"{label:<22}{r['train_loss']:>12.4f}{r['val_loss']:>10.4f}{r['val_acc']:>9.4f}{r['ms_per_step']:>9.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--strategy", choices=("decentralized", "ddp"), default="decentralized")
    parser.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 2)))
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--topology", default="ring")
    parser.add_argument("--compare", action="store_true", help="run both strategies and print a table")
    parser.add_argument("--json", help="write the final metrics here (rank 0)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread per process: the processes share the CPU cores
    if args.compare:
        compare(args)
    else:
        train(args.strategy, args.devices, args.epochs, args.topology, args.json)


if __name__ == "__main__":
    main()
