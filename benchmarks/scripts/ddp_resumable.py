"""A plain DDP/gloo training script (no trainwatch import) that keeps its own
checkpoint: the workload of `benchmarks/recovery.py --script`.

Rank 0 saves model + optimizer (+ NVRx client state) to --ckpt-dir every
--ckpt-every steps; every rank resumes from it when it starts. Each step's data
is drawn from a generator seeded by (step, rank), so a resumed run ends with
the same weights, bit for bit, as an uninterrupted one (--out, rank 0; see the
warm-up backward below for why that holds on more than 2 ranks).

--hang-at STEP --hang-rank R: rank R sleeps forever before step STEP (1-based,
so STEP-1 steps are done). With --hang-marker FILE it hangs only if FILE does
not exist yet (it creates it), i.e. once per job, not again after a restart.

--log-dir DIR: one JSON line per event per rank in DIR/rank<R>.jsonl, with wall
(time.time) and CLOCK_MONOTONIC timestamps: start (pid, restart count, step
resumed from), every completed step, the hang, the end.

--fault-dir DIR: faults asked for from outside while the job runs (the chaos
goodput benchmark, benchmarks/goodput.py): before each step rank R takes the
file DIR/rank<R>.hang (it sleeps forever) or DIR/rank<R>.skip (it runs the
step without DDP's gradient all-reduce, `no_sync`: its peers' all-reduces then
pair with its next step's, a collective desync); each file acts once, in the
first process that removes it.

--nvrx: heartbeats to NVIDIA Resiliency Extension's rank monitor (ft_launcher)
after every step; with --nvrx-learn-at N the heartbeat timeouts are learnt
(calculate_and_set_hb_timeouts) after step N and kept in the checkpoint.
nvidia_resiliency_ext is imported only then.

A script given to `recovery.py --script PATH` must accept these flags.
"""

import argparse
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=200)
p.add_argument("--sleep", type=float, default=0.02, help="seconds of simulated work per step")
p.add_argument("--ckpt-dir", required=True)
p.add_argument("--ckpt-every", type=int, default=10)
p.add_argument("--log-dir")
p.add_argument("--hang-at", type=int, default=0)
p.add_argument("--hang-rank", type=int, default=1)
p.add_argument("--hang-marker")
p.add_argument("--out")
p.add_argument("--fault-dir")
p.add_argument("--nvrx", action="store_true")
p.add_argument("--nvrx-learn-at", type=int, default=0)
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
logf = None
if args.log_dir:
    os.makedirs(args.log_dir, exist_ok=True)
    logf = open(os.path.join(args.log_dir, f"rank{rank}.jsonl"), "a", buffering=1)


def note(ev, **kw):
    if logf is not None:
        logf.write(json.dumps({"ev": ev, "rank": rank, "pid": os.getpid(), "restart": restart,
                               "wall": time.time(), "mono": time.monotonic(), **kw}) + "\n")


torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
ckpt_path = os.path.join(args.ckpt_dir, "ckpt.pt")
start = 0
ckpt = None
if os.path.exists(ckpt_path):
    ckpt = torch.load(ckpt_path, weights_only=False)
    net.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    start = ckpt["step"]
model = torch.nn.parallel.DistributedDataParallel(net)
# DDP rebuilds its gradient buckets after the first backward; with more than 2
# ranks gloo's summation order follows the bucket layout, so a resumed run's first
# step would differ in the last bit from the uninterrupted run's. One discarded
# backward first gives every step, fresh or resumed, the same layout.
model(torch.zeros(1, 32)).sum().backward()
opt.zero_grad(set_to_none=True)

ft = None
if args.nvrx:
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

    ft = RankMonitorClient()
    if ckpt is not None and ckpt.get("nvrx"):
        ft.load_state_dict(ckpt["nvrx"])
    ft.init_workload_monitoring()


def nvrx_timeouts():
    t = ft.hb_timeouts
    return {"initial": t.initial, "subsequent": t.subsequent, "calculated": t.were_calculated}


note("start", resumed_from=start, world=world, **({"nvrx_timeouts": nvrx_timeouts()} if ft is not None else {}))

def take_fault(kind: str) -> bool:
    """True once for DIR/rank<R>.<kind>: whoever removes the file acts on it."""
    try:
        os.unlink(os.path.join(args.fault_dir, f"rank{rank}.{kind}"))
    except OSError:
        return False
    note(kind, step=step)
    return True


for step in range(start + 1, args.steps + 1):
    if args.fault_dir and take_fault("hang"):
        print(f"rank {rank}: hanging before step {step} (pid {os.getpid()})", flush=True)
        while True:
            time.sleep(1)
    skip = bool(args.fault_dir) and take_fault("skip")
    if step == args.hang_at and rank == args.hang_rank:
        first = True
        if args.hang_marker:
            try:
                os.close(os.open(args.hang_marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            except FileExistsError:
                first = False
        if first:
            note("hang", step=step)
            print(f"rank {rank}: hanging before step {step} (pid {os.getpid()})", flush=True)
            while True:
                time.sleep(1)
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(16, 32, generator=g)
    y = x[:, :1].sin()
    # skip: this rank runs the step without its gradient all-reduce (DDP reads the flag in forward)
    with model.no_sync() if skip else contextlib.nullcontext():
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
    opt.step()
    time.sleep(args.sleep)
    if ft is not None:
        ft.send_heartbeat()
        if step == args.nvrx_learn_at:
            ft.calculate_and_set_hb_timeouts()
            note("nvrx_learnt", step=step, nvrx_timeouts=nvrx_timeouts())
    note("step", step=step)
    if step % args.ckpt_every == 0 and rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        tmp = ckpt_path + ".tmp"
        torch.save({"step": step, "model": net.state_dict(), "opt": opt.state_dict(),
                    "nvrx": ft.state_dict() if ft is not None else None}, tmp)
        os.replace(tmp, ckpt_path)

if args.out and rank == 0:
    torch.save(net.state_dict(), args.out)
note("end", step=args.steps)
if ft is not None:
    ft.shutdown_workload_monitoring()
dist.destroy_process_group()
