"""DDP classification with per-step metric all-reduce for logging.

Shape: a loop that, right after every ``optimizer.step()``, packs the batch
loss, number of correct predictions and sample count into one tensor and
``dist.all_reduce``s it so rank 0 can log global loss/accuracy -- a very
common "log the true global metric" pattern. The collective runs after the
optimizer step and before the next batch is fetched. Every 10 steps the
ranks also meet at a ``dist.barrier()`` (e.g. before a logging flush).

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


def make_spirals(n, seed, classes=3):
    """Noisy interleaved 2-D spirals, lifted to 8 features."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    r = torch.rand(n, generator=g)
    theta = r * 4.0 + y.float() * (2 * torch.pi / classes)
    pts = torch.stack([r * torch.cos(theta), r * torch.sin(theta)], dim=1)
    pts = pts + 0.03 * torch.randn(n, 2, generator=g)
    feats = torch.cat([pts, pts ** 2, pts.prod(dim=1, keepdim=True), torch.sin(3 * pts),
                       r.unsqueeze(1)], dim=1)
    return TensorDataset(feats, y)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--sleep", type=float, default=0.0)
    return p.parse_args()


def train(args):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    ds = make_spirals(6000, args.seed)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler)

    model = DDP(nn.Sequential(nn.Linear(8, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                              nn.Linear(128, 3)))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    loss_fn = nn.CrossEntropyLoss()

    step, epoch, global_loss = 0, 0, float("nan")
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            logits = model(x)
            loss = loss_fn(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1

            # Global metrics for logging: one collective after every step.
            with torch.no_grad():
                stats = torch.stack([loss.detach() * x.shape[0],
                                     (logits.argmax(1) == y).sum().float(),
                                     torch.tensor(float(x.shape[0]))])
            dist.all_reduce(stats, op=dist.ReduceOp.SUM)
            global_loss = (stats[0] / stats[2]).item()
            global_acc = (stats[1] / stats[2]).item()

            if step % 10 == 0:
                dist.barrier()
            if rank == 0 and step % args.log_every == 0:
                print(f"step {step} loss {global_loss:.4f} acc {global_acc:.3f} "
                      f"(world={world})", flush=True)
            if args.sleep:
                time.sleep(args.sleep)
            if step >= args.steps:
                break
        epoch += 1

    return step, global_loss


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
