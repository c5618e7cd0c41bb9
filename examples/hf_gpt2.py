"""A Hugging Face Trainer run with gossip instead of DDP: one class changes.

    uv run examples/hf_gpt2.py                       # DecentralizedTrainer on 2 local CPU processes
    uv run examples/hf_gpt2.py --trainer ddp         # transformers.Trainer (DDP), the same seeds
    uv run examples/hf_gpt2.py --compare             # both, then a table: loss, eval loss, ms per step
    torchrun --nproc-per-node 2 examples/hf_gpt2.py --worker      # or start the processes yourself
    accelerate launch --multi_gpu --num_processes 2 examples/hf_gpt2.py --worker    # with 2 GPUs

Without ``--worker`` the script starts its processes with torchrun. A small GPT-2 (4 layers, width
128), randomly initialised from a config (no download), learns a synthetic language: token
sequences from a fixed random Markov chain over 128 tokens, so the best possible loss is the
chain's entropy rate, printed at the start. ``TrainingArguments`` are the same for both trainers;
evaluation runs on the exact global average, and ``save_model`` writes it.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers

from decent_optim_wrapper.integrations.transformers import DecentralizedTrainer

VOCAB, LENGTH, TRAIN_SEQUENCES, EVAL_SEQUENCES = 128, 64, 8192, 512


def markov_chain() -> torch.Tensor:
    """A sparse random transition matrix: from each token, 4 likely successors."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(VOCAB, VOCAB, generator=g) * 0.5
    favourites = torch.randint(0, VOCAB, (VOCAB, 4), generator=g)
    logits.scatter_add_(1, favourites, torch.full((VOCAB, 4), 4.0))
    return logits.softmax(dim=1)


def sequences(chain: torch.Tensor, count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.empty(count, LENGTH, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (count,), generator=g)
    for t in range(1, LENGTH):
        tokens[:, t] = torch.multinomial(chain[tokens[:, t - 1]], 1, generator=g).squeeze(1)
    return [{"input_ids": x, "labels": x} for x in tokens]


def entropy_rate(chain: torch.Tensor) -> float:
    """The lowest loss a model can reach (per predicted token, from the stationary distribution)."""
    stationary = torch.linalg.matrix_power(chain.double(), 200)[0]
    return float(-(stationary[:, None] * chain.double() * chain.double().log()).sum())


def train(kind: str, steps: int, topology: str, out: str | None) -> None:
    chain = markov_chain()
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=LENGTH, n_layer=4, n_embd=128, n_head=4, bos_token_id=0, eos_token_id=0
    )
    transformers.set_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(
        output_dir=f"runs/hf-{kind}",
        per_device_train_batch_size=16,
        learning_rate=1e-3,
        warmup_steps=steps // 10,
        max_steps=steps,
        eval_strategy="steps",
        eval_steps=max(1, steps // 4),
        save_steps=max(1, steps // 2),
        logging_steps=max(1, steps // 10),
        use_cpu=not torch.cuda.is_available(),
        report_to=[],
        seed=0,
    )
    trainer_class: Any = DecentralizedTrainer if kind == "decentralized" else transformers.Trainer
    options = {"topology": topology} if kind == "decentralized" else {}
    trainer = trainer_class(
        model=model,
        args=args,
        train_dataset=sequences(chain, TRAIN_SEQUENCES, seed=1),
        eval_dataset=sequences(chain, EVAL_SEQUENCES, seed=2),
        **options,
    )
    if trainer.is_world_process_zero():
        print(f"best possible loss (the chain's entropy rate): {entropy_rate(chain):.4f}")
    output = trainer.train()
    evaluation = trainer.evaluate()
    trainer.save_model()  # the averaged model: from_pretrained(f"runs/hf-{kind}") loads it
    if trainer.is_world_process_zero():
        ms_per_step = 1000 * output.metrics["train_runtime"] / steps
        result = {"train_loss": output.training_loss, "eval_loss": evaluation["eval_loss"]}
        result["perplexity"] = math.exp(evaluation["eval_loss"])
        result["ms_per_step"] = ms_per_step
        print(f"{kind}: " + "  ".join(f"{k} {v:.4f}" for k, v in result.items()))
        if out:
            Path(out).write_text(json.dumps(result))


def launch(args: argparse.Namespace, kind: str, out: str | None) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.processes)]
    command += [__file__, "--worker", "--trainer", kind, "--steps", str(args.steps)]
    command += ["--topology", args.topology]
    command += ["--json", out] if out else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the processes share the CPU cores
    subprocess.run(command, check=True, timeout=3600, env=env)


def compare(args: argparse.Namespace) -> None:
    results = {}
    for kind in ("decentralized", "ddp"):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
            out = handle.name
        launch(args, kind, out)
        results[kind] = json.loads(Path(out).read_text())
        os.unlink(out)
    print(f"\n{args.processes} CPU processes, {args.steps} steps, the same seeds:")
    print(f"{'trainer':<22}{'train_loss':>12}{'eval_loss':>11}{'ms/step':>9}")
    for kind, r in results.items():
        label = f"decentralized ({args.topology})" if kind == "decentralized" else "Trainer (DDP)"
        print(f"{label:<22}{r['train_loss']:>12.4f}{r['eval_loss']:>11.4f}{r['ms_per_step']:>9.1f}")


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--trainer", choices=("decentralized", "ddp"), default="decentralized")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--topology", default="ring")
    parser.add_argument("--compare", action="store_true", help="run both trainers and print a table")
    parser.add_argument("--worker", action="store_true", help="train in this process (started by a launcher)")
    parser.add_argument("--json", help="write the final metrics here (rank 0)")
    args = parser.parse_args()
    if args.worker:
        torch.set_num_threads(1)
        train(args.trainer, args.steps, args.topology, args.json)
    elif args.compare:
        compare(args)
    else:
        launch(args, args.trainer, args.json)


if __name__ == "__main__":
    main()
