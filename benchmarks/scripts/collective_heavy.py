"""A plain DDP script with 10 collectives per step (DDP's gradient all-reduce
and nine metric all-reduces), timing its own steps: the zero-code overhead row
of benchmarks/overhead.py runs it under torchrun and under `trainwatch launch`.

    torchrun --nproc-per-node 2 collective_heavy.py --steps 400 --out /tmp/times

Each rank writes OUT.rank<N>.json: its step times after warm-up, the CPU
time (all threads of the process) those steps took, and the part of it spent
in threads named trainwatch-* (the launcher's rank-side sampler; 0 under
torchrun). `--pin` puts rank N on CPU N: on a small machine the scheduler's
placement of two spinning gloo ranks otherwise varies a run's speed by half.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import threading

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def trainwatch_threads_cpu_s() -> float:
    """CPU time so far of this process's threads named trainwatch-* (Linux)."""
    total = 0
    for t in threading.enumerate():
        if t.name.startswith("trainwatch") and t.native_id is not None:
            try:
                with open(f"/proc/self/task/{t.native_id}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass
    return total / 1e9


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--out", required=True)
    p.add_argument("--pin", action="store_true", help="pin rank N to CPU N mod the CPUs it may use")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.pin and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(args.width, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    metric = torch.zeros(4)
    gen = torch.Generator().manual_seed(rank)
    times, cpu0, tw0 = [], 0.0, 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            cpu0, tw0 = time.process_time(), trainwatch_threads_cpu_s()
        t0 = time.perf_counter()
        x = torch.randn(64, args.width, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()  # one gradient all-reduce
        opt.step()
        for _ in range(9):  # metrics: nine small all-reduces
            metric.fill_(float(step))
            dist.all_reduce(metric)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    cpu, tw_cpu = time.process_time() - cpu0, trainwatch_threads_cpu_s() - tw0
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump({"step_s": times, "cpu_s": cpu, "trainwatch_cpu_s": tw_cpu}, f)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(f"done: {args.steps} steps")


if __name__ == "__main__":
    main()
