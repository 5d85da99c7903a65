"""Two real gloo ranks for tests/test_in_process.py: both blocked in
collectives their peer never joins (rank 0 in an all_reduce, rank 1 in a
broadcast); the sidecar's request (written into both slots by the test
harness below) makes each rank's poll cut its connections, both collectives
fail at once, and InProcessRecovery.recover re-forms the group on the same
store and agrees on the newest step both staged. Prints one JSON line.

    python inprocess_gloo.py RANK PORT SEGMENT
"""

import datetime
import json
import sys
import threading
import time

import torch
import torch.distributed as dist

from trainwatch import slots
from trainwatch.rank.inprocess import InProcessRecovery, abort_nccl_groups, reform_gloo
from trainwatch.rank.slotwriter import SlotWriter
from trainwatch.watchdog.inprocess import answer, ask

rank, port, seg_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
dist.init_process_group("gloo", store=dist.PrefixStore("first", store), rank=rank, world_size=2)
segment = slots.Segment(seg_path)
writer = SlotWriter(segment, rank, pid=0, rank=rank, world_size=2, restart=0)
recovery = InProcessRecovery(writer, store_ports={port}, rank=rank)
t = torch.ones(4)
nccl_aborted = abort_nccl_groups()  # a gloo group has no NCCL communicator to abort
dist.all_reduce(t)  # the group works
breaking_before = recovery.breaking()
store.set(f"ready{rank}", "1")
store.wait(["ready0", "ready1"])
if rank == 0:
    ask(segment, 0, 7)  # what the sidecar writes
    ask(segment, 1, 7)


def sampler():
    while not recovery.pending:
        recovery.poll()
        time.sleep(0.05)


threading.Thread(target=sampler, daemon=True).start()
t0 = time.monotonic()
try:
    dist.all_reduce(t) if rank == 0 else dist.broadcast(t, 0)
    error = None
except RuntimeError as e:
    error = str(e).split("\n")[0][:200]
broke_s = time.monotonic() - t0
breaking_during = recovery.breaking()
restored = []
step = recovery.recover(reform_gloo(rank, 2, store), lambda: [12, 11] if rank == 0 else [11, 10], restored.append)
t = torch.full((2,), float(rank + 1))
dist.all_reduce(t)
done = answer(segment, rank)
print(json.dumps({"rank": rank, "error": error, "broke_s": broke_s, "step": step, "restored": restored,
                  "sum": t.tolist(), "wanted": recovery.wanted(), "done": [done[1], done[2]], "nccl_aborted": nccl_aborted,
                  "breaking": [breaking_before, breaking_during, recovery.breaking()]}), flush=True)
dist.destroy_process_group()
