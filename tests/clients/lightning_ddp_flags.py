"""Lightning ``Trainer`` whose strategy, accelerator and devices come from flags.

Shape: the "configure from the command line" Lightning project --
``--strategy ddp --accelerator cpu --devices auto`` passed straight to
``L.Trainer``, an MLP regressor LightningModule with ``self.log(...,
sync_dist=True)`` on every training step (two collectives a step on top of
DDP's gradient all-reduce), validation every ``--val-every`` batches, and
``trainer.validate`` once more after ``fit``.

Under torchrun Lightning detects the torchelastic environment; ``--devices
auto`` resolves to ``LOCAL_WORLD_SIZE`` and ``--num-nodes`` defaults to
``WORLD_SIZE // LOCAL_WORLD_SIZE``.

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


def make_data(n, seed, dim=16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, 1, generator=torch.Generator().manual_seed(99))
    return TensorDataset(x, torch.sin(x @ w) + 0.05 * torch.randn(n, 1, generator=g))


class Regressor(L.LightningModule):
    def __init__(self, lr=1e-2, sleep=0.0, val_sleep=0.0):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
        self.last_loss = float("nan")

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, on_step=True)
        self.log("train_rmse", loss.detach().sqrt(), sync_dist=True, on_step=True)
        self.last_loss = loss.item()
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.hparams.sleep:
            time.sleep(self.hparams.sleep)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        time.sleep(self.hparams.val_sleep)
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", default="auto")
    p.add_argument("--num-nodes", type=int, default=None)
    p.add_argument("--val-every", type=int, default=25)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--val-sleep", type=float, default=0.0, help="extra seconds per validation batch")
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()

    L.seed_everything(args.seed, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    devices = local_world if args.devices == "auto" else int(args.devices)
    num_nodes = args.num_nodes or max(1, world // local_world)

    train_dl = DataLoader(make_data(4096, args.seed), batch_size=args.batch_size, shuffle=True)
    val_dl = DataLoader(make_data(512, args.seed + 1), batch_size=args.batch_size)
    model = Regressor(sleep=args.sleep, val_sleep=args.val_sleep)
    trainer = L.Trainer(
        accelerator=args.accelerator, strategy=args.strategy, devices=devices, num_nodes=num_nodes,
        max_steps=args.steps, val_check_interval=args.val_every, check_val_every_n_epoch=None,
        limit_val_batches=args.val_batches, num_sanity_val_steps=0, enable_progress_bar=False,
        enable_model_summary=False, logger=False, enable_checkpointing=False)
    trainer.fit(model, train_dl, val_dl)
    trainer.validate(model, val_dl, verbose=False)
    if trainer.is_global_zero:
        print(f"done: steps={trainer.global_step} final_loss={model.last_loss:.4f}", flush=True)
    del trainer
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
