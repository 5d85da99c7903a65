"""Where a run starts from: the checkpoint per --resume, one step that every
rank of every node agrees on, and which ranks write checkpoints.

Checkpoint directories are either shared by every node (a network
filesystem: global rank 0 writes, everyone reads the same files) or local to
each node (the default `$TRAINWATCH_HOME/jobs/<job>/checkpoints` on separate
machines: each node's local rank 0 writes a full copy, data parallel ranks
hold the same state). Which one it is is found out, not configured: rank 0
drops a probe file in its directory and each node looks for it.

A restarted multi-node job resumes from the newest step any rank has a
checkpoint of, agreed with one all-gather; a node that lost its disk, or
joined new (a replacement node, an elastic `--nnodes MIN:MAX` rejoin), gets
that step's state from a rank that holds it, over the job's own process group,
and keeps a copy: it never trains on from another step than its peers.

A checkpoint holding NaN/inf is never resumed from. A run stopped by a
non-finite loss leaves a marker (`nonfinite.json`: the step) in its
--ckpt-dir; the next start rolls back to the newest checkpoint before that
step, and checkpoints of that step or later (the broken timeline) are moved
aside into `rolled-back/`.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from trainwatch import checkpoint as ckpt
from trainwatch import env
from trainwatch import state as statefiles
from trainwatch.trainer.config import MODEL_PRESETS, TrainConfig
from trainwatch.trainer.model import GPT
from trainwatch.lines import print_line


@dataclass
class Resume:
    """The state to start from (None: from scratch) and every step this rank could resume from."""

    state: dict | None = None
    where: str | None = None
    step: int = 0
    available: dict[int, str] = field(default_factory=dict)
    """step -> checkpoint directory of every checkpoint here that verifies."""
    explicit: bool = False
    rollback: int | None = None
    """The step whose loss was non-finite (from the marker): only checkpoints before it were candidates."""

NONFINITE_MARKER = "nonfinite.json"
ROLLED_BACK = "rolled-back"


def write_nonfinite_marker(ckpt_dir: str, step: int, what: str) -> None:
    """Say in ckpt_dir that the run went non-finite at `step` (the next start rolls back before it)."""
    statefiles.write_json_atomic(Path(ckpt_dir) / NONFINITE_MARKER, {"step": int(step), "what": what,
                                                                      "time": time.time()})


def read_nonfinite_marker(ckpt_dir: str, warn=lambda msg: None) -> int | None:
    """The step of the marker, or None; a marker that does not parse is said and ignored."""
    path = Path(ckpt_dir) / NONFINITE_MARKER
    try:
        raw = path.read_bytes()[:65536]
    except OSError:
        return None
    try:
        step = json.loads(raw).get("step")
        if isinstance(step, int) and not isinstance(step, bool) and step >= 1:
            return step
    except (ValueError, AttributeError, RecursionError):
        pass
    warn(f"warning: ignoring {path}: not a non-finite marker written by the trainer")
    return None


def finish_rollback(ckpt_dir: str, step: int, say) -> None:
    """After every rank chose its checkpoint: move checkpoints of `step` or later
    aside (they belong to the run that went non-finite) and remove the marker."""
    root = Path(ckpt_dir)
    aside = root / ROLLED_BACK
    for info in ckpt.valid_checkpoints(root, warn=lambda msg: None):
        if info.step >= step:
            try:
                aside.mkdir(exist_ok=True)
                shutil.move(str(info.path), str(aside / f"{info.path.name}-{int(time.time())}"))
                say(f"moved {info.path.name} (step {info.step}, after the non-finite step {step}) to {aside}")
            except OSError:
                pass
    try:
        os.unlink(root / NONFINITE_MARKER)
    except OSError:
        pass


def find_resume(cfg: TrainConfig, rank: int) -> Resume:
    """The checkpoint to start from per --resume (before the process group exists,
    so a bad --resume fails fast); raises CheckpointError."""
    if cfg.resume == "never":
        return Resume()
    if cfg.resume != "auto":
        try:
            state = ckpt.load_checkpoint(cfg.resume)
            problem = misfit(state, cfg)
            if problem:
                raise ckpt.CheckpointError(problem)
            return Resume(state, cfg.resume, int(state["step"]), explicit=True)
        except ckpt.CheckpointError as e:
            raise ckpt.CheckpointError(
                f"--resume: {e}; pass a valid checkpoint directory, or --resume auto or never"
            ) from None
    if not cfg.ckpt_dir:
        return Resume()
    warn = (lambda msg: print(msg, file=sys.stderr, flush=True)) if rank == 0 else (lambda msg: None)
    # The newest checkpoint that verifies, fits this model and holds finite
    # values; an older one when the newest cannot be loaded (another model
    # size, a torn file, NaN weights). After a non-finite loss, only one from
    # before that step.
    out = Resume(rollback=read_nonfinite_marker(cfg.ckpt_dir, warn))
    for info in ckpt.valid_checkpoints(cfg.ckpt_dir, warn=warn):
        if out.rollback is not None and info.step >= out.rollback:
            continue
        if out.state is not None:
            out.available.setdefault(info.step, str(info.path))
            continue
        try:
            state = ckpt.load_checkpoint(info)
            problem = misfit(state, cfg) or ckpt.nonfinite_problem(state)
        except ckpt.CheckpointError as e:
            problem = str(e)
        if problem is None:
            out.state, out.where, out.step = state, str(info.path), info.step
            out.available[info.step] = str(info.path)
        else:
            warn(f"warning: skipping checkpoint {info.path}: {problem}; trying the next older one")
    return out


def agree(resume: Resume, cfg: TrainConfig, say) -> Resume:
    """The newest step any rank can resume from (one all-gather), loaded; ranks
    that do not hold it (a new or replacement node, node-local checkpoints)
    receive it from a rank that does and keep a copy in their --ckpt-dir."""
    if resume.explicit or cfg.resume == "never":
        return resume
    mine = sorted(s for s in resume.available if s <= resume.step) if resume.state is not None else []
    steps: list = [None] * dist.get_world_size()
    dist.all_gather_object(steps, mine)
    if not any(steps):
        return Resume(rollback=resume.rollback)
    step = max(max(s) for s in steps if s)
    lacking = [r for r, s in enumerate(steps) if step not in (s or ())]
    if lacking:
        return _receive(resume, cfg, step, min(r for r, s in enumerate(steps) if step in (s or ())), lacking)
    if resume.state is not None and resume.step == step:
        return resume
    where = resume.available[step]
    state = ckpt.load_checkpoint(where)
    if (problem := ckpt.nonfinite_problem(state)):
        raise ckpt.CheckpointError(f"checkpoint {where}, the newest step every rank holds, {problem}; "
                                   "start over with --resume never")
    say(f"resuming every node from step {step}, the newest all of them hold (this node had {resume.step})")
    return Resume(state, where, step, resume.available, rollback=resume.rollback)


def _receive(resume: Resume, cfg: TrainConfig, step: int, src: int, lacking: list[int]) -> Resume:
    """Send the state of `step` from rank `src` to every rank (one broadcast of
    its torch.save bytes, over gloo whatever the training backend); the ranks in
    `lacking` load it with weights_only and save it as their own checkpoint."""
    import io

    rank = dist.get_rank()
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    payload = torch.empty(0, dtype=torch.uint8)
    if rank == src:
        state = resume.state if resume.step == step else ckpt.load_checkpoint(resume.available[step])
        buf = io.BytesIO()
        torch.save(state, buf)
        payload = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    if rank != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=src, group=group)
    if rank not in lacking:
        if resume.step == step:
            return resume
        return Resume(ckpt.load_checkpoint(resume.available[step]), resume.available[step], step, resume.available,
                      rollback=resume.rollback)
    state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True, map_location="cpu")
    if not isinstance(state, dict) or (problem := ckpt.nonfinite_problem(state)):
        raise ckpt.CheckpointError(f"the state of step {step} received from rank {src} is not a usable checkpoint; "
                                   "start over with --resume never")
    where = f"rank {src}"
    if cfg.ckpt_dir:
        where = str(ckpt.save_checkpoint(cfg.ckpt_dir, step, state, kind="emergency", rank=rank, keep=None,
                                         world_size=dist.get_world_size()))
    node = os.environ.get(env.NODE_SCOPE) or socket.gethostname()
    print_line(f"node {node}: rank {rank} had no checkpoint of step {step} (the newest the job holds; it had "
               f"{resume.step if resume.state is not None else 'none'}); received it from rank {src}, saved as {where}")
    return Resume(state, where, step, {**resume.available, step: where}, rollback=resume.rollback)


def checkpoint_writer(cfg: TrainConfig, rank: int, local_rank: int) -> bool:
    """Whether this rank writes periodic checkpoints: global rank 0, and each
    node's local rank 0 whose --ckpt-dir is not the directory rank 0 writes to."""
    if not cfg.ckpt_dir:
        return False
    name = [f".shared-probe-{uuid.uuid4().hex}" if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    probe = Path(cfg.ckpt_dir) / str(name[0])
    if rank == 0:
        probe.touch()
    dist.barrier()
    shared = probe.exists()
    dist.barrier()
    if rank == 0:
        try:
            os.unlink(probe)
        except OSError:
            pass
    return rank == 0 or (local_rank == 0 and not shared)


def misfit(state: dict, cfg: TrainConfig) -> str | None:
    """Why a checkpoint's state cannot be loaded into this config's model and
    optimizer (None when it can): checked on shapes alone, with no weights allocated."""
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict) or "step" not in state:
        return "it is not a trainer checkpoint (no model state or step)"
    saved = state.get("config") if isinstance(state.get("config"), dict) else {}
    with torch.device("meta"):
        expected = GPT(MODEL_PRESETS[cfg.model_size]).state_dict()
    got = state["model"]
    if set(got) != set(expected) or any(
            not isinstance(got[k], torch.Tensor) or got[k].shape != v.shape for k, v in expected.items()):
        size = saved.get("model_size")
        hint = f"pass --model-size {size}" if size and size != cfg.model_size else "pass the flags it was saved with"
        return f"it was saved for another model (its weights do not fit --model-size {cfg.model_size}); {hint}"
    groups = (state.get("optimizer") or {}).get("param_groups") if isinstance(state.get("optimizer"), dict) else None
    if not isinstance(groups, list) or len(groups) != 2:
        return "its optimizer state does not fit this trainer's optimizer"
    return None
