"""An unmodified DDP script (no trainwatch import) that keeps its own checkpoint
and resumes from it, and raises the same ValueError at the same step of its
own count on every run: a bad batch that no restart can fix.

Rank 0 saves the state every --ckpt-every steps; a new run loads the latest
and goes on from the step after it. trainwatch's zero-code step count starts
at 0 in every process, so after the resume it is not the script's step.
The message carries the pid, which differs on every run."""

import argparse
import os

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--ckpt", required=True, help="directory of the script's own checkpoint")
p.add_argument("--ckpt-every", type=int, default=4)
p.add_argument("--fail-at", type=int, default=6)
p.add_argument("--steps", type=int, default=20)
args = p.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
path = os.path.join(args.ckpt, "state.pt")
start = 0
if os.path.exists(path):
    saved = torch.load(path, weights_only=True)
    model.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    start = saved["step"]
    print(f"rank {rank}: resumed from its own checkpoint at step {start}", flush=True)
for step in range(start + 1, args.steps + 1):
    if step == args.fail_at:
        raise ValueError(f"the batch of step {step} holds a bad value (worker pid {os.getpid()})")
    loss = model(torch.randn(8, 16)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % args.ckpt_every == 0 and rank == 0:
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}, path + ".tmp")
        os.replace(path + ".tmp", path)
dist.destroy_process_group()
