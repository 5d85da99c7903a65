"""DDP + torch.compile on CPU.

Shape: the nanoGPT-style recipe -- compile the bare module with
``torch.compile`` and then wrap the compiled module in DDP. The first step
pays the compile cost; later steps run the compiled graph. (On torch 2.13
``torch.compile(DDP(net))`` graph-breaks inside DDP's forward and ends up
compiling nothing, so the compile-then-wrap order is the one that actually
exercises Dynamo here.)

Backend: defaults to ``aot_eager`` (Dynamo capture + AOTAutograd, no code
generation). Inductor works on CPU, but a cold inductor compile of even this
tiny MLP (C++ codegen via gcc for forward + backward) took 42-47 s on a
loaded 2-core machine (~12 s with a warm inductor cache), too slow for a test
fixture; ``aot_eager`` compiles in a few seconds. Pass ``--backend inductor``
to exercise real codegen.

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


def make_blobs(n, seed, dim=20, classes=4):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, dim, generator=torch.Generator().manual_seed(99)) * 2
    y = torch.randint(0, classes, (n,), generator=g)
    x = centers[y] + torch.randn(n, dim, generator=g)
    return TensorDataset(x, y)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--backend", default="aot_eager",
                   help="torch.compile backend (inductor, aot_eager, eager)")
    p.add_argument("--sleep", type=float, default=0.0)
    return p.parse_args()


def train(args):
    rank = dist.get_rank()
    torch.manual_seed(args.seed)

    ds = make_blobs(4096, args.seed)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    net = nn.Sequential(nn.Linear(20, 64), nn.GELU(), nn.LayerNorm(64),
                        nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    t0 = time.time()
    try:
        net = torch.compile(net, backend=args.backend)
        compiled = True
    except Exception as exc:  # e.g. a Python build Dynamo does not support
        if rank == 0:
            print(f"torch.compile unavailable ({exc!r}); running eagerly", flush=True)
        compiled = False
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss_fn = nn.CrossEntropyLoss()

    step, epoch, loss = 0, 0, torch.tensor(float("nan"))
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step == 1 and rank == 0:
                mode = f"compiled ({args.backend})" if compiled else "eager"
                print(f"first step ({mode}) took {time.time() - t0:.1f}s", flush=True)
            if args.sleep:
                time.sleep(args.sleep)
            if rank == 0 and step % 20 == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
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
