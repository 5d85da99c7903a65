"""Where a trainer process runs and how it computes: its place in the job, its
device, its precision's autocast context, deterministic kernels."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from trainwatch.trainer.config import UsageError

FP8_ERROR = "--precision fp8 needs a CUDA GPU and transformer-engine (pip install 'trainwatch[gpu]')"


@dataclass(slots=True)
class Runtime:
    """Where this process runs: its place in the job and its device."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    distributed: bool


def runtime_of(device_pref: str, environ: dict[str, str]) -> Runtime:
    launched = "RANK" in environ and "WORLD_SIZE" in environ
    if launched and not (environ.get("MASTER_ADDR") and environ.get("MASTER_PORT")):
        raise UsageError(
            "RANK and WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are not; "
            "start the trainer with trainwatch launch or torchrun, or unset RANK and WORLD_SIZE"
        )
    rank = int(environ.get("RANK", "0")) if launched else 0
    world = int(environ.get("WORLD_SIZE", "1")) if launched else 1
    local_rank = int(environ.get("LOCAL_RANK", "0")) if launched else 0
    if device_pref == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda needs a CUDA GPU and a CUDA build of torch; use --device cpu or auto")
    use_cuda = device_pref == "cuda" or (device_pref == "auto" and torch.cuda.is_available())
    # More ranks than GPUs share them in turn (NCCL refuses two ranks of one
    # communicator on one GPU, and says so; gloo over CUDA tensors does not).
    device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count())) if use_cuda else torch.device("cpu")
    return Runtime(rank=rank, local_rank=local_rank, world_size=world, device=device, distributed=launched)


def check_fp8(rt: Runtime) -> None:
    if rt.device.type != "cuda":
        raise UsageError(FP8_ERROR)
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        raise UsageError(FP8_ERROR) from None


def precision_context(precision: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    if precision == "fp32":
        return contextlib.nullcontext
    if precision == "fp16" and device.type == "cuda":
        return lambda: torch.autocast(device.type, dtype=torch.float16)
    if precision in ("bf16", "fp16"):
        # fp16 on CPU: torch's fp16 CPU kernels are an order of magnitude slower;
        # bf16 compute, with fp16's GradScaler all the same (see _scaler).
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling

    recipe = DelayedScaling()

    @contextlib.contextmanager
    def fp8() -> Iterator[None]:
        # TE's Linear layers run their matmuls in fp8; the rest stays in bf16.
        with torch.autocast(device.type, dtype=torch.bfloat16), te.fp8_autocast(enabled=True, fp8_recipe=recipe):
            yield

    return fp8


def use_deterministic(rt: Runtime) -> None:
    """Deterministic kernels only. On CUDA: cuBLAS's fixed-size workspace (read when
    its first handle is made, so set before the first matmul) and torch's own
    attention kernels (the fused ones' backward may sum in a varying order)."""
    if rt.device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
            torch.backends.cuda.enable_cudnn_sdp(False)
    # warn_only: an op without a deterministic kernel says so and the run goes on.
    torch.use_deterministic_algorithms(True, warn_only=True)
