"""Hand-rolled 2-stage GPipe pipeline with point-to-point send/recv.

Shape: manual pipeline parallelism as written before torch.distributed.pipelining
existed. The model is cut into two stages; each global batch is split into
``--micro`` micro-batches. Stage 0 runs all forwards and ``isend``s each
activation to stage 1; stage 1 ``recv``s, finishes the forward, computes the
loss, then runs the backwards in reverse order and ``isend``s the activation
gradients back; stage 0 ``recv``s them and back-propagates (GPipe schedule:
all forwards, then all backwards). Each stage owns its own optimizer.

Layout: ``stage = rank % 2``, ``replica = rank // 2``. With 2 ranks rank 0 is
stage 0 and rank 1 is stage 1. With 4 ranks there are two pipelines
(0->1 and 2->3) acting as data-parallel replicas; gradients are all-reduced
within each stage's group (``dist.new_group([0, 2])`` / ``[1, 3]``) before the
optimizer step.

Ranks: even world sizes (tested with 2 and 4). Backend: gloo on CPU.
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

HIDDEN = 64


def make_data(n, seed, dim=16, classes=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    proj = torch.randn(dim, classes, generator=torch.Generator().manual_seed(3))
    y = (x @ proj + 0.3 * torch.randn(n, classes, generator=g)).argmax(1)
    return TensorDataset(x, y)


def build_stage(stage):
    torch.manual_seed(1000 + stage)  # same init on every replica of a stage
    if stage == 0:
        return nn.Sequential(nn.Linear(16, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU())
    return nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 4))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()
    assert args.batch_size % args.micro == 0

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % 2:
        raise SystemExit("pipeline_microbatch.py needs an even number of ranks")
    stage, replica, dp = rank % 2, rank // 2, world // 2
    peer = rank + 1 if stage == 0 else rank - 1

    # Every rank must create every group, in the same order.
    stage_groups = [dist.new_group(list(range(s, world, 2))) for s in range(2)]
    dp_group = stage_groups[stage]

    model = build_stage(stage)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()

    # Both stages of a pipeline read the same shard: stage 0 uses the inputs,
    # stage 1 the labels.
    ds = make_data(4096, args.seed)
    sampler = DistributedSampler(ds, num_replicas=dp, rank=replica, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    mb = args.batch_size // args.micro

    step, epoch, last_loss = 0, 0, float("nan")
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            if stage == 0:
                outs, sends = [], []
                for xm in x.split(mb):
                    out = model(xm)
                    outs.append(out)
                    sends.append(dist.isend(out.detach(), dst=peer))
                for req in sends:
                    req.wait()
                for out in reversed(outs):
                    grad = torch.empty_like(out)
                    dist.recv(grad, src=peer)
                    out.backward(grad)
            else:
                inputs, losses = [], []
                for ym in y.split(mb):
                    act = torch.empty(mb, HIDDEN)
                    dist.recv(act, src=peer)
                    act.requires_grad_(True)
                    inputs.append(act)
                    losses.append(loss_fn(model(act), ym) / args.micro)
                sends = []
                for act, loss in zip(reversed(inputs), reversed(losses)):
                    loss.backward()
                    sends.append(dist.isend(act.grad, dst=peer))
                for req in sends:
                    req.wait()
                last_loss = sum(l.item() for l in losses)

            if dp > 1:  # data parallel across pipeline replicas
                for prm in model.parameters():
                    dist.all_reduce(prm.grad, group=dp_group)
                    prm.grad.div_(dp)
            opt.step()
            step += 1
            if stage == 1 and replica == 0 and step % 20 == 0:
                print(f"[last stage] step {step} loss {last_loss:.4f}", flush=True)
            if args.sleep:
                time.sleep(args.sleep)
            if step >= args.steps:
                break
        epoch += 1

    # The loss lives on the last stage; hand it to rank 0 for the summary line.
    if rank in (0, 1):
        buf = torch.tensor([last_loss])
        if rank == 1:
            dist.send(buf, dst=0)
        else:
            dist.recv(buf, src=1)
            print(f"done: steps={step} final_loss={buf.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
