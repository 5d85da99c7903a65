"""Lightning ``Trainer`` + ``LightningModule`` with step-based validation.

Shape: the standard PyTorch Lightning project layout -- a LightningModule
with ``training_step`` / ``validation_step`` / ``configure_optimizers``,
metrics logged with ``self.log(..., sync_dist=True)``, and a
``Trainer(strategy="ddp", max_steps=..., val_check_interval=...,
limit_val_batches=...)`` that validates every N training batches (with
``check_val_every_n_epoch=None`` so the interval counts batches across
epoch boundaries). The model is a small 1-D conv net classifying synthetic
noisy waveforms (sine / square / sawtooth).

Under torchrun, Lightning detects the torchelastic environment and requires
``devices * num_nodes == WORLD_SIZE``; we pass ``devices=LOCAL_WORLD_SIZE``
and ``num_nodes=WORLD_SIZE // LOCAL_WORLD_SIZE``.

Ranks: any world size (tested with 2). Backend: gloo on CPU.
"""

import argparse
import gc
import os
import time

import lightning as L
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

LENGTH = 64


def make_waves(n, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    freq = 1.0 + 3.0 * torch.rand(n, 1, generator=g)
    phase = 2 * torch.pi * torch.rand(n, 1, generator=g)
    t = torch.linspace(0, 1, LENGTH).unsqueeze(0)
    arg = 2 * torch.pi * freq * t + phase
    frac = torch.remainder(arg / (2 * torch.pi), 1.0)
    waves = torch.stack([torch.sin(arg), torch.sign(torch.sin(arg)), 2 * frac - 1], dim=1)
    x = waves[torch.arange(n), y] + 0.3 * torch.randn(n, LENGTH, generator=g)
    return TensorDataset(x.unsqueeze(1), y)


class WaveClassifier(L.LightningModule):
    def __init__(self, lr=3e-3, sleep=0.0, val_sleep=0.0):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv1d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool1d(2),
            nn.Conv1d(16, 32, 5, padding=2), nn.ReLU(), nn.AdaptiveAvgPool1d(1),
            nn.Flatten(), nn.Linear(32, 3))
        self.loss_fn = nn.CrossEntropyLoss()
        self.last_train_loss = float("nan")

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        self.last_train_loss = loss.item()
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.hparams.sleep:  # runs right after the optimizer step
            time.sleep(self.hparams.sleep)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        time.sleep(self.hparams.val_sleep)  # a bigger model's forward
        self.log("val_loss", self.loss_fn(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def on_validation_epoch_end(self):
        m = self.trainer.callback_metrics
        if self.trainer.is_global_zero and "val_loss" in m:
            print(f"step {self.global_step} val_loss {m['val_loss']:.4f} "
                  f"val_acc {m['val_acc']:.3f}", flush=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--val-every", type=int, default=20)
    p.add_argument("--val-batches", type=int, default=10)
    p.add_argument("--val-sleep", type=float, default=0.0, help="extra seconds per validation batch")
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()

    L.seed_everything(args.seed, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))

    train_dl = DataLoader(make_waves(4096, args.seed), batch_size=args.batch_size, shuffle=True)
    val_dl = DataLoader(make_waves(1024, args.seed + 1), batch_size=args.batch_size)
    model = WaveClassifier(sleep=args.sleep, val_sleep=args.val_sleep)

    trainer = L.Trainer(
        accelerator="cpu", strategy="ddp", devices=local_world, num_nodes=world // local_world,
        max_steps=args.steps, val_check_interval=args.val_every, check_val_every_n_epoch=None,
        limit_val_batches=args.val_batches, num_sanity_val_steps=0, log_every_n_steps=10,
        enable_progress_bar=False, enable_model_summary=False, logger=False,
        enable_checkpointing=False, deterministic=True)
    trainer.fit(model, train_dl, val_dl)

    if trainer.is_global_zero:
        print(f"done: steps={trainer.global_step} final_loss={model.last_train_loss:.4f}",
              flush=True)
    # Lightning created the process group; tear it down once the DDP wrapper is gone.
    del trainer
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
