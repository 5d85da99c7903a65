"""DDP with gradient accumulation using ``model.no_sync()``.

Shape: the standard accumulation loop -- each optimizer step consumes
``--accum`` micro-batches from the DataLoader; the first ``accum - 1``
backward passes run inside ``model.no_sync()`` (no gradient all-reduce) and
only the last micro-batch's backward triggers DDP's bucketed all-reduce.
Loss is divided by ``accum`` so the update equals a big-batch update.

Ranks: any world size >= 1 (tested with 2 and 4). Backend: gloo on CPU.
"""

import argparse
import gc
import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_data(n, seed, dim=24):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, generator=torch.Generator().manual_seed(7))
    y = ((x @ w + 0.5 * x[:, 0] * x[:, 1]) > 0).long()
    return TensorDataset(x, y)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--sleep", type=float, default=0.0)
    return p.parse_args()


def train(args):
    rank = dist.get_rank()
    torch.manual_seed(args.seed)

    ds = make_data(4096, args.seed)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.micro_batch, sampler=sampler, drop_last=True)

    model = DDP(nn.Sequential(nn.Linear(24, 96), nn.Tanh(), nn.Linear(96, 96), nn.Tanh(),
                              nn.Linear(96, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    step, micro, epoch = 0, 0, 0
    running, last_loss = 0.0, float("nan")
    opt.zero_grad(set_to_none=True)
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            micro += 1
            is_boundary = micro % args.accum == 0
            # Skip the gradient all-reduce on every micro-step but the last one.
            ctx = contextlib.nullcontext() if is_boundary else model.no_sync()
            with ctx:
                loss = loss_fn(model(x), y) / args.accum
                loss.backward()
            running += loss.item()
            if not is_boundary:
                continue

            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            last_loss, running = running, 0.0
            if rank == 0 and step % 15 == 0:
                print(f"step {step} loss {last_loss:.4f}", flush=True)
            if args.sleep:
                time.sleep(args.sleep)
            if step >= args.steps:
                break
        epoch += 1

    return step, last_loss


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
