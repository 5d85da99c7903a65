"""A two-stage pipeline whose last stage broadcasts the loss at the end of every step.

Shape: the hand-rolled model-parallel loop -- stage 0 runs the first half of
an MLP and ``send``s its activations, stage 1 runs the second half, computes
the loss and ``send``s the activation gradients back; each stage steps its
own optimizer; then every rank joins ``dist.broadcast(loss, src=last)`` so
all of them can log it (and decide, say, on early stopping). Stage 0 waits
for the gradients before its backward, so it always reaches the broadcast
last, by the last stage's head time (``--head-s``) after its peer: by
design, not a straggler.

Ranks: 2 (one per stage). Backend: gloo on CPU.
"""

import argparse
import gc
import time

import torch
import torch.distributed as dist
import torch.nn as nn

DIM, BATCH = 64, 32


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stage-work", type=int, default=3, help="extra matmuls per stage (compute per step)")
    p.add_argument("--head-s", type=float, default=0.1, help="seconds of the last stage's heavier head per step")
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit("pipeline_broadcast.py runs on exactly 2 ranks (one per stage)")
    torch.manual_seed(args.seed + rank)
    stage = nn.Sequential(*[m for _ in range(args.stage_work) for m in (nn.Linear(DIM, DIM), nn.Tanh())])
    head = nn.Linear(DIM, 1) if rank == 1 else None
    params = list(stage.parameters()) + (list(head.parameters()) if head is not None else [])
    opt = torch.optim.SGD(params, lr=1e-2)
    g = torch.Generator().manual_seed(args.seed)
    w = torch.randn(DIM, 1, generator=torch.Generator().manual_seed(5))
    loss_value = torch.zeros(1)
    for step in range(1, args.steps + 1):
        x = torch.randn(BATCH, DIM, generator=g)  # both stages draw the same batch
        y = torch.tanh(x @ w)
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            act = stage(x)
            dist.send(act.detach(), dst=1)
            grad = torch.empty_like(act)
            dist.recv(grad, src=1)
            act.backward(grad)
        else:
            inp = torch.empty(BATCH, DIM)
            dist.recv(inp, src=0)
            inp.requires_grad_(True)
            loss = nn.functional.mse_loss(head(stage(inp)), y)
            time.sleep(args.head_s)  # the heavier loss head (a vocabulary projection, say)
            loss.backward()
            dist.send(inp.grad, dst=0)
            loss_value.fill_(loss.item())
        opt.step()
        dist.broadcast(loss_value, src=1)  # every rank logs the loss
        if args.sleep:
            time.sleep(args.sleep)
        if rank == 0 and step % 20 == 0:
            print(f"step {step} loss {loss_value.item():.4f}", flush=True)
    if rank == 0:
        print(f"done: steps={args.steps} final_loss={loss_value.item():.4f}", flush=True)
    del stage, head, opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
