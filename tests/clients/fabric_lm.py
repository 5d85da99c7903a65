"""Lightning Fabric: tiny next-token language model with periodic validation.

Shape: the "bring your own loop" Fabric recipe -- ``Fabric(strategy="ddp")``,
``fabric.launch()``, ``fabric.setup(model, optimizer)``,
``fabric.setup_dataloaders(train, val)`` (Fabric injects DistributedSamplers),
``fabric.backward(loss)``, and every ``--val-every`` steps a forward-only
validation sweep over ``--val-batches`` batches under ``torch.no_grad()``
whose mean loss is combined with ``fabric.all_reduce``.

The model is a character-level GRU language model trained on synthetic token
streams sampled from a fixed, peaked random bigram (Markov) table, so the
loss has something real to learn and drops well below log(vocab).

Under torchrun, Fabric detects the torchelastic environment and requires
``devices * num_nodes == WORLD_SIZE``; we pass ``devices=LOCAL_WORLD_SIZE``
and ``num_nodes=WORLD_SIZE // LOCAL_WORLD_SIZE`` (``devices="auto"`` resolves
to 1 on CPU and would be rejected). Run directly with ``python`` it falls
back to a single process.

Ranks: any world size (tested with 2). Backend: gloo on CPU.
"""

import argparse
import gc
import math
import os
import time

import torch
import torch.nn as nn
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEQ = 32, 32


def make_corpus(n_seqs, seed):
    """Sample token sequences from a fixed sparse-ish bigram chain."""
    table_gen = torch.Generator().manual_seed(12345)  # same "language" for every split
    logits = torch.randn(VOCAB, VOCAB, generator=table_gen) * 3.0
    probs = torch.softmax(logits, dim=1)
    g = torch.Generator().manual_seed(seed)
    seqs = torch.empty(n_seqs, SEQ + 1, dtype=torch.long)
    seqs[:, 0] = torch.randint(0, VOCAB, (n_seqs,), generator=g)
    for t in range(SEQ):
        seqs[:, t + 1] = torch.multinomial(probs[seqs[:, t]], 1, generator=g).squeeze(1)
    return TensorDataset(seqs[:, :-1], seqs[:, 1:])


class CharLM(nn.Module):
    def __init__(self, dim=48, hidden=64):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.rnn = nn.GRU(dim, hidden, batch_first=True)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, tokens):
        out, _ = self.rnn(self.embed(tokens))
        return self.head(out)


def lm_loss(model, inputs, targets):
    logits = model(inputs)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def train(fabric, args):
    fabric.seed_everything(args.seed)

    train_ds = make_corpus(2048, args.seed)
    val_ds = make_corpus(args.val_batches * args.batch_size * fabric.world_size, args.seed + 1)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size)
    train_loader, val_loader = fabric.setup_dataloaders(train_loader, val_loader)

    model = CharLM()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, opt = fabric.setup(model, opt)

    def validate():
        model.eval()
        total, count = torch.zeros(()), 0
        with torch.no_grad():
            for inputs, targets in val_loader:
                total += lm_loss(model, inputs, targets)
                time.sleep(args.val_sleep)  # a bigger model's forward
                count += 1
                if count == args.val_batches:
                    break
        model.train()
        return fabric.all_reduce(total / max(count, 1), reduce_op="mean").item()

    step, epoch, loss = 0, 0, torch.tensor(float("nan"))
    while step < args.steps:
        train_loader.sampler.set_epoch(epoch)
        for inputs, targets in train_loader:
            loss = lm_loss(model, inputs, targets)
            opt.zero_grad(set_to_none=True)
            fabric.backward(loss)
            opt.step()
            step += 1
            if args.sleep:
                time.sleep(args.sleep)
            if step % args.val_every == 0:
                val = validate()
                fabric.print(f"step {step} train_loss {loss.item():.4f} val_loss {val:.4f} "
                             f"(uniform would be {math.log(VOCAB):.3f})")
            if step >= args.steps:
                break
        epoch += 1

    return step, loss.item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--val-every", type=int, default=20)
    p.add_argument("--val-batches", type=int, default=50)
    p.add_argument("--val-sleep", type=float, default=0.0, help="extra seconds per validation batch")
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", 1))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=local_world,
                    num_nodes=world // local_world)
    fabric.launch()
    step, final_loss = train(fabric, args)
    fabric.print(f"done: steps={step} final_loss={final_loss:.4f}")
    # Fabric created the process group but (on gloo) never destroys it. Drop the
    # DDP-wrapped model first: its C++ reducer holds a reference to the group.
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
