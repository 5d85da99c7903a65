"""DDP where the validation pass runs inside the training step function.

Shape: a loop whose ``train_step()`` does forward and backward, then -- every
``--val-every`` steps, before ``optimizer.step()`` -- runs a validation pass
(``model.eval()`` + ``torch.no_grad()`` over a held-out loader, the summed
loss all-reduced), switches back with ``model.train()`` and only then steps
the optimizer. The step that contains the validation pass lasts as long as
the pass; no optimizer step happens during it.

Ranks: any world size (tested with 2). Backend: gloo on CPU.
"""

import argparse
import gc
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_data(n, seed, dim=24):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, 1, generator=torch.Generator().manual_seed(11))
    return TensorDataset(x, (x @ w > 0).float().squeeze(1).long())


def validate(model, loader, val_sleep):
    model.eval()
    total = torch.zeros(2)
    with torch.no_grad():
        for x, y in loader:
            logits = model(x)
            time.sleep(val_sleep)  # a bigger model's forward
            total[0] += nn.functional.cross_entropy(logits, y, reduction="sum")
            total[1] += len(y)
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--val-every", type=int, default=20)
    p.add_argument("--val-sleep", type=float, default=0.0, help="extra seconds per validation batch")
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    train = make_data(4096, args.seed)
    val = make_data(256, args.seed + 1)
    sampler = DistributedSampler(train, seed=args.seed)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    val_loader = DataLoader(val, batch_size=64, sampler=DistributedSampler(val, shuffle=False))
    model = DDP(nn.Sequential(nn.Linear(24, 64), nn.ReLU(), nn.Linear(64, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def train_step(step, x, y):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step % args.val_every == 0:
            val_loss = validate(model, val_loader, args.val_sleep)
            if rank == 0:
                print(f"step {step} val_loss {val_loss:.4f}", flush=True)
        opt.step()
        return loss.item()

    step, epoch, loss = 0, 0, float("nan")
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            step += 1
            loss = train_step(step, x, y)
            if args.sleep:
                time.sleep(args.sleep)
            if step >= args.steps:
                break
        epoch += 1
    if rank == 0:
        print(f"done: steps={step} final_loss={loss:.4f}", flush=True)
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
