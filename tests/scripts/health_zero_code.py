"""An unmodified training script for the zero-code health-signal tests: run it
through `python -m trainwatch.rank.bootstrap` with TRAINWATCH_SLOTS set.

It trains a tiny model on one fixed batch (the same every step, so with frozen
weights the loss is the same every step) and, after each iteration, reads its
own slot (what the sidecar would read) next to the values it computed itself.
The last stdout line is a JSON list: one record per iteration.

--scaler: a real torch.amp.GradScaler("cpu"); --clip: clip_grad_norm_;
--scheduler: a LambdaLR halving the LR every step; --lr: SGD's learning rate.
"""

import argparse
import io
import json
import os

import torch

from trainwatch import slots

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--scaler", action="store_true")
p.add_argument("--clip", action="store_true")
p.add_argument("--scheduler", action="store_true")
p.add_argument("--lr", type=float, default=0.1)
p.add_argument("--save", action="store_true", help="torch.save the model after each step (the phase is recorded)")
args = p.parse_args()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=args.lr)
# closed form (base LR x 0.5^epoch): it writes its own value back whatever the LR was
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5 ** epoch) if args.scheduler else None
scaler = torch.amp.GradScaler("cpu") if args.scaler else None
x = torch.randn(32, 8)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=32)
segment = slots.Segment(os.environ["TRAINWATCH_SLOTS"])
FIELDS = ("step", "loss", "grad_norm", "lr", "loss_scale", "zero_grad_frac", "data_s", "backward_s", "optimizer_s",
          "peak_step_s", "peak_step_s_step", "peak_data_s", "peak_backward_s", "peak_optimizer_s")
records = []


class PhaseProbe(io.BytesIO):
    """A file torch.save writes to: notes the slot's phase while it writes."""

    seen: set = set()

    def write(self, b):
        PhaseProbe.seen.add(int(segment.read_table()[0]["phase"]))
        return super().write(b)


for i in range(args.steps):
    (batch,) = next(iter(data))
    loss = model(batch).pow(2).mean()
    own_loss = float(loss)
    lr_used = opt.param_groups[0]["lr"]
    opt.zero_grad()
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
    else:
        loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)) if args.clip else None
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    if sched is not None:
        sched.step()
    row = segment.read_table()[0]
    rec = {k: row[k].item() for k in FIELDS}
    rec.update(own_loss=own_loss, own_norm=norm, own_lr=lr_used, own_lr_after=opt.param_groups[0]["lr"],
               own_scale=scaler.get_scale() if scaler is not None else None,
               weights=float(sum(q.detach().abs().sum() for q in model.parameters())))
    if args.save:
        PhaseProbe.seen = set()
        torch.save(model.state_dict(), PhaseProbe())
        rec.update(save_phases=sorted(PhaseProbe.seen), phase_after_save=int(segment.read_table()[0]["phase"]))
    records.append(rec)
print(json.dumps(records))
