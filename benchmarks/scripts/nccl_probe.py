"""One NCCL all_reduce across the ranks torchrun started, each on GPU
local_rank % GPUs (so ranks beyond the GPUs share them): does NCCL allow this
many ranks here? Prints one JSON line per rank; exit 0 when the sum is right.

    python -m torch.distributed.run --standalone --nproc-per-node N benchmarks/scripts/nccl_probe.py
"""

from __future__ import annotations

import json
import os
import signal
import time

import torch
import torch.distributed as dist

from trainwatch import procctl


def main() -> int:
    # torchrun starts each rank in a session of its own: should torchrun be killed
    # (gpu_check's time bound), a rank hung in NCCL must not outlive it on the GPU.
    procctl.die_with_parent(signal.SIGKILL, os.getppid())
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(device)
    t0 = time.monotonic()
    dist.init_process_group("nccl", device_id=device)
    x = torch.ones(1, device=device)
    dist.all_reduce(x)
    value = float(x)
    world = dist.get_world_size()
    print(json.dumps({"rank": dist.get_rank(), "device": str(device), "sum": value, "world": world,
                      "nccl": ".".join(map(str, torch.cuda.nccl.version())), "seconds": round(time.monotonic() - t0, 3)}),
          flush=True)
    dist.destroy_process_group()
    return 0 if value == world else 1


if __name__ == "__main__":
    raise SystemExit(main())
