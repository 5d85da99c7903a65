"""FSDP2 (``fully_shard``) training of a small transformer-ish stack on CPU.

Shape: the modern FSDP2 recipe -- build a 1-D CPU ``DeviceMesh``, call
``fully_shard`` on every block and then on the root module, and optimize the
resulting DTensor parameters with AdamW. Each block's parameters are sharded
across ranks; forward/backward all-gather them per block and reduce-scatter
the gradients.

Why FSDP2 and not FSDP1: on torch 2.13 ``fully_shard`` works on CPU with the
gloo backend out of the box (``init_device_mesh("cpu", ...)``; gloo
implements the all-gather / reduce-scatter it needs), so no fallback to the
legacy ``FullyShardedDataParallel`` wrapper is needed. The collectives are
issued by FSDP2 as ``dist.all_gather_single`` / ``dist.reduce_scatter_single``
(the 2.13 names; ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` are now
deprecated aliases of them).

Ranks: any world size >= 1 (tested with 2). Backend: gloo on CPU.
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

DIM, SEQ, VOCAB = 32, 16, 24


class Block(nn.Module):
    """Pre-norm residual block: token-mixing MLP + channel MLP (MLP-Mixer-like)."""

    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.mix = nn.Linear(SEQ, SEQ)
        self.norm2 = nn.LayerNorm(DIM)
        self.ff = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, h):
        h = h + self.mix(self.norm1(h).transpose(1, 2)).transpose(1, 2)
        return h + self.ff(self.norm2(h))


class Net(nn.Module):
    def __init__(self, depth=3):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(DIM, 2)

    def forward(self, tokens):
        h = self.embed(tokens)
        for blk in self.blocks:
            h = blk(h)
        return self.head(h.mean(dim=1))


def make_data(n, seed):
    """Label = does token 3 appear more often than token 7 in the sequence?"""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    y = ((tokens == 3).sum(1) > (tokens == 7).sum(1)).long()
    return TensorDataset(tokens, y)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(args.seed)

    model = Net()
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    loss_fn = nn.CrossEntropyLoss()

    ds = make_data(4096, args.seed)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    step, epoch, loss = 0, 0, torch.tensor(float("nan"))
    while step < args.steps:
        sampler.set_epoch(epoch)
        for tokens, y in loader:
            loss = loss_fn(model(tokens), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if rank == 0 and step % 20 == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
            if args.sleep:
                time.sleep(args.sleep)
            if step >= args.steps:
                break
        epoch += 1

    if rank == 0:
        n_local = sum(p.to_local().numel() for p in model.parameters())
        n_total = sum(p.numel() for p in model.parameters())
        print(f"params: {n_total} total, {n_local} on this rank", flush=True)
        print(f"done: steps={step} final_loss={loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
