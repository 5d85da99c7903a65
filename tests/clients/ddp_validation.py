"""Plain DDP regression training with a periodic validation pass.

Shape: the classic hand-written PyTorch loop -- DistributedSampler + DataLoader,
DDP-wrapped MLP, SGD with momentum, and every ``--val-every`` steps a
forward-only validation sweep (``model.eval()`` + ``torch.no_grad()``) whose
summed loss is combined across ranks with ``dist.all_reduce`` before rank 0
prints it.

Ranks: any world size >= 1 (tested with 2). Backend: gloo on CPU.
"""

import argparse
import gc
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_regression_data(n, seed, dim=32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    true_w = torch.randn(dim, 1, generator=torch.Generator().manual_seed(1234))
    y = torch.tanh(x @ true_w) + 0.05 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


@torch.no_grad()
def evaluate(model, loader, val_sleep=0.0):
    model.eval()
    total = torch.zeros(2)  # [sum of losses, number of samples]
    for x, y in loader:
        pred = model(x)
        time.sleep(val_sleep)  # a bigger model's forward
        total[0] += nn.functional.mse_loss(pred, y, reduction="sum")
        total[1] += x.shape[0]
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    model.train()
    return (total[0] / total[1]).item()


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--val-every", type=int, default=20)
    p.add_argument("--val-sleep", type=float, default=0.0, help="extra seconds per validation batch")
    p.add_argument("--sleep", type=float, default=0.0)
    return p.parse_args()


def train(args):
    rank = dist.get_rank()
    torch.manual_seed(args.seed)

    train_ds = make_regression_data(4096, args.seed)
    val_ds = make_regression_data(512, args.seed + 1)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler)
    val_loader = DataLoader(val_ds, batch_size=64,
                            sampler=DistributedSampler(val_ds, shuffle=False))

    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                              nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    step, epoch, loss = 0, 0, torch.tensor(float("nan"))
    while step < args.steps:
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if args.sleep:
                time.sleep(args.sleep)
            if step % args.val_every == 0 or step == args.steps:
                val_loss = evaluate(model, val_loader, args.val_sleep)
                if rank == 0:
                    print(f"step {step} train_loss {loss.item():.4f} val_loss {val_loss:.4f}",
                          flush=True)
            if step >= args.steps:
                break
        epoch += 1

    return step, loss.item()


def main():
    args = parse_args()
    dist.init_process_group("gloo")
    step, final_loss = train(args)
    if dist.get_rank() == 0:
        print(f"done: steps={step} final_loss={final_loss:.4f}", flush=True)
    # The DDP wrapper sits in a reference cycle, and its C++ reducer holds the
    # process group; collect it now so the group is torn down by
    # destroy_process_group() rather than later from inside the reducer.
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
