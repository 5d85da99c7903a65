"""Hugging Face Accelerate loop with gradient accumulation and periodic eval.

Shape: the canonical ``accelerate launch``-style script, here started by
torchrun -- ``Accelerator(gradient_accumulation_steps=2, cpu=True)``,
``accelerator.prepare(model, optimizer, train_dl, eval_dl, scheduler)``,
``with accelerator.accumulate(model):`` around every micro-batch,
``accelerator.backward(loss)``, and every ``--eval-every`` optimizer steps an
evaluation pass that collects predictions and labels from all ranks with
``accelerator.gather_for_metrics`` to compute a global accuracy.

Note on step counting: inside ``accumulate`` the script calls
``optimizer.step()`` on every micro-batch, as Accelerate intends; the
wrapped torch optimizer only really steps when ``accelerator.sync_gradients``
is true, i.e. once per 2 micro-batches. ``--steps`` counts those real steps.

Ranks: any world size (tested with 2). Backend: gloo on CPU (Accelerate picks
MULTI_CPU from the torchrun environment).
"""

import argparse
import gc
import time

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset


def make_data(n, seed, dim=12, classes=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, classes, generator=torch.Generator().manual_seed(21))
    y = (torch.tanh(x @ w) + 0.2 * torch.randn(n, classes, generator=g)).argmax(1)
    return TensorDataset(x, y)


def evaluate(accelerator, model, loader, val_sleep=0.0):
    model.eval()
    correct, total = 0, 0
    with torch.no_grad():
        for x, y in loader:
            preds = model(x).argmax(dim=1)
            time.sleep(val_sleep)  # a bigger model's forward
            preds, labels = accelerator.gather_for_metrics((preds, y))
            correct += (preds == labels).sum().item()
            total += labels.numel()
    model.train()
    return correct / total, total


def train(accelerator, args):
    set_seed(args.seed)
    train_dl = DataLoader(make_data(4096, args.seed), batch_size=args.batch_size, shuffle=True)
    eval_dl = DataLoader(make_data(500, args.seed + 1), batch_size=64)  # uneven on purpose

    model = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 10))  # short warmup
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, scheduler)
    loss_fn = nn.CrossEntropyLoss()

    step, loss = 0, torch.tensor(float("nan"))
    while step < args.steps:
        for x, y in train_dl:
            with accelerator.accumulate(model):
                loss = loss_fn(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            if args.sleep:
                time.sleep(args.sleep)
            if step % args.eval_every == 0:
                acc, n = evaluate(accelerator, model, eval_dl, args.val_sleep)
                accelerator.print(f"step {step} loss {loss.item():.4f} eval_acc {acc:.3f} "
                                  f"(on {n} samples)")
            if step >= args.steps:
                break
    return step, loss.item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32, help="per-rank micro-batch")
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--val-sleep", type=float, default=0.0, help="extra seconds per evaluation batch")
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    accelerator.print(f"{accelerator.distributed_type}, {accelerator.num_processes} processes")
    step, final_loss = train(accelerator, args)
    accelerator.print(f"done: steps={step} final_loss={final_loss:.4f}")
    accelerator.wait_for_everyone()
    # Release the prepared (DDP-wrapped) model before the process group goes away.
    accelerator.free_memory()
    gc.collect()
    accelerator.end_training()


if __name__ == "__main__":
    main()
