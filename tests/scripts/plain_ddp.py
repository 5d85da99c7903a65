"""An unmodified DDP script: no trainwatch import. Used for zero-code telemetry tests.

--hang-at STEP --hang-rank R makes rank R sleep forever before step STEP on
every run (a deterministic bug, as in real code: restarting cannot fix it)."""

import argparse
import os
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=12)
p.add_argument("--sleep", type=float, default=0.02)
p.add_argument("--hang-at", type=int, default=0)
p.add_argument("--hang-rank", type=int, default=1)
args = p.parse_args()

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(256, 16)), batch_size=8)
it = iter(data)
for step in range(args.steps):
    if step + 1 == args.hang_at and dist.get_rank() == args.hang_rank:
        print(f"rank {dist.get_rank()}: hanging before step {step + 1} (pid {os.getpid()})", flush=True)
        while True:
            time.sleep(1)
    try:
        (x,) = next(it)
    except StopIteration:  # a new epoch
        it = iter(data)
        (x,) = next(it)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(args.sleep)
dist.destroy_process_group()
