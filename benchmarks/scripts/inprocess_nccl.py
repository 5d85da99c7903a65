"""In-process recovery on NCCL, the parts one GPU can show (benchmarks/gpu_check.py,
check nccl_in_process): a one-rank NCCL group works; the sidecar's request (written
into the rank's slot here) makes the sampler's poll abort the rank's NCCL
communicators; the next collective fails; InProcessRecovery.recover destroys the
group, forms it again on NCCL under a new store prefix, agrees on the newest staged
step with a device all-gather, and the group works again. Prints one JSON line.

    python inprocess_nccl.py PORT SEGMENT
"""

import datetime
import json
import sys
import time

import torch
import torch.distributed as dist

from trainwatch import slots
from trainwatch.rank.inprocess import InProcessRecovery, reform_group
from trainwatch.rank.slotwriter import SlotWriter
from trainwatch.watchdog.inprocess import answer, ask

port, seg_path = int(sys.argv[1]), sys.argv[2]
torch.cuda.set_device(0)
store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=30))
dist.init_process_group("nccl", store=dist.PrefixStore("first", store), rank=0, world_size=1)
segment = slots.Segment(seg_path)
writer = SlotWriter(segment, 0, pid=0, rank=0, world_size=1, restart=0)
recovery = InProcessRecovery(writer, store_ports={port}, rank=0)
t = torch.ones(4, device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
ask(segment, 0, 7)  # what the sidecar writes
t0 = time.monotonic()
recovery.poll()  # the sampler's round: aborts the communicators
abort_s = time.monotonic() - t0
error = None
try:
    dist.all_reduce(t)
    torch.cuda.synchronize()
except Exception as e:  # noqa: BLE001 - any error type: the point is that it fails
    error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
breaking = recovery.breaking()
t0 = time.monotonic()
restored = []
step = recovery.recover(reform_group("nccl", 0, 1, store), lambda: [12, 11], restored.append)
recover_s = time.monotonic() - t0
t = torch.full((2,), 3.0, device="cuda")
dist.all_reduce(t)
done = answer(segment, 0)
print(json.dumps({"error": error, "breaking": breaking, "step": step, "restored": restored,
                  "sum": t.tolist(), "abort_s": round(abort_s, 3), "recover_s": round(recover_s, 3),
                  "done": [done[1], done[2]], "backend": dist.get_backend()}), flush=True)
dist.destroy_process_group()
