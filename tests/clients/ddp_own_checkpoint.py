"""DDP training that manages its own checkpoints and auto-resumes.

Shape: the "homegrown fault tolerance" loop found in many research repos.
Every ``--ckpt-every`` steps rank 0 writes ``torch.save({model, optimizer,
step})`` to ``<ckpt-dir>/ckpt_<step>.pt`` atomically (write to a temp file,
then ``os.replace``), and all ranks meet at ``dist.barrier()`` so nobody runs
ahead of a half-written checkpoint. On start-up every rank looks for the
newest checkpoint, loads it with ``torch.load(..., weights_only=True)`` and
prints ``resumed from step N``. Data comes from a DataLoader with a
DistributedSampler; ``sampler.set_epoch`` is derived from the global step so
a resumed run continues with the right shuffle.

Checkpoint directory: ``--ckpt-dir``, else env ``CKPT_DIR``, else a fresh temp
directory (which makes resume a no-op and is deleted at exit).

Ranks: any world size >= 1 (tested with 2). Backend: gloo on CPU.
"""

import argparse
import gc
import glob
import os
import re
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_data(n, seed, dim=16):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, dim, generator=g) * 2 - 1
    y = (torch.sin(2 * x[:, :4]).sum(1, keepdim=True) + x[:, 4:8].pow(2).sum(1, keepdim=True))
    return TensorDataset(x, y)


def newest_checkpoint(ckpt_dir):
    found = []
    for path in glob.glob(os.path.join(ckpt_dir, "ckpt_*.pt")):
        m = re.search(r"ckpt_(\d+)\.pt$", path)
        if m:
            found.append((int(m.group(1)), path))
    return max(found)[1] if found else None


def save_checkpoint(ckpt_dir, step, model, opt):
    state = {"model": model.module.state_dict(), "optimizer": opt.state_dict(), "step": step}
    final = os.path.join(ckpt_dir, f"ckpt_{step:06d}.pt")
    fd, tmp = tempfile.mkstemp(dir=ckpt_dir, prefix=".ckpt_", suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=90)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--ckpt-every", type=int, default=30)
    p.add_argument("--ckpt-dir", default=os.environ.get("CKPT_DIR"))
    p.add_argument("--sleep", type=float, default=0.0)
    return p.parse_args()


def train(args, ckpt_dir):
    rank = dist.get_rank()
    torch.manual_seed(args.seed)

    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU(),
                              nn.Linear(64, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    step = 0
    latest = newest_checkpoint(ckpt_dir)
    if latest is not None:
        state = torch.load(latest, map_location="cpu", weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = int(state["step"])
        if rank == 0:
            print(f"resumed from step {step}", flush=True)
    dist.barrier()  # nobody starts before everybody has read the checkpoint

    ds = make_data(4096, args.seed)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    steps_per_epoch = len(loader)

    loss = torch.tensor(float("nan"))
    while step < args.steps:
        epoch, skip = divmod(step, steps_per_epoch)
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if i < skip:  # fast-forward inside the epoch we resumed in
                continue
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if args.sleep:
                time.sleep(args.sleep)
            if step % args.ckpt_every == 0 or step == args.steps:
                if rank == 0:
                    save_checkpoint(ckpt_dir, step, model, opt)
                    print(f"step {step} loss {loss.item():.4f} saved checkpoint", flush=True)
                dist.barrier()
            if step >= args.steps:
                break

    return step, loss.item()


def main():
    args = parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    ckpt_dir, scratch_dir = args.ckpt_dir, False
    if ckpt_dir is None:  # every rank must agree on the same temp dir
        holder = [tempfile.mkdtemp(prefix="ddp_ckpt_") if rank == 0 else None]
        dist.broadcast_object_list(holder, src=0)
        ckpt_dir, scratch_dir = holder[0], True
    os.makedirs(ckpt_dir, exist_ok=True)

    step, final_loss = train(args, ckpt_dir)
    if rank == 0:
        print(f"done: steps={step} final_loss={final_loss:.4f}", flush=True)
    if scratch_dir:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
    # The DDP wrapper sits in a reference cycle, and its C++ reducer holds the
    # process group; collect it now so the group is torn down by
    # destroy_process_group() rather than later from inside the reducer.
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
