"""Zero-code telemetry: `trainwatch launch` runs an unmodified script through here.

    python -u -m trainwatch.rank.bootstrap train.py ARGS...
    python -u -m trainwatch.rank.bootstrap -m package.module ARGS...

(the launcher routes every Python worker through it; nobody types this).

It attaches the rank to its slot, then runs the user's program as __main__.
Steps come from a global optimizer step post-hook; phases from light wrappers
around DataLoader iteration, Tensor.backward and the optimizer step, so a
hung rank shows where it is without a single line of user code changed.

Progress is more than optimizer steps: a fetched batch and a finished
no_grad/inference_mode block count too, and a module put in eval mode (or a
batch fetched with gradients off) puts the rank in the `eval` phase, so a
validation pass with no optimizer step is never taken for a hang.
"""

from __future__ import annotations

import os
import runpy
import sys

import trainwatch


def install_zero_code(tw) -> None:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    last_loss: list = [None]

    def on_step(optimizer, args, kwargs) -> None:
        tw.set_phase("compute")
        if tw._explicit:
            return  # the script reports its own steps through the API
        loss = last_loss[0]
        last_loss[0] = None
        value = None
        if loss is not None and loss.device.type == "cpu":
            value = float(loss)  # on CPU this is a read; on GPU it would wait for the device
        tw._record(value, None, None, None)
        tw.fault_point("step_end")

    def on_pre_step(optimizer, args, kwargs) -> None:
        tw.fault_point("forward")
        tw.set_phase("optimizer")

    register_optimizer_step_pre_hook(on_pre_step)
    register_optimizer_step_post_hook(on_step)

    original_backward = torch.Tensor.backward

    def backward(self, *args, **kwargs):
        if self.dim() == 0:
            self = tw.perturb_loss(self)
            last_loss[0] = self.detach()
        with tw.phase("backward"):
            return original_backward(self, *args, **kwargs)

    torch.Tensor.backward = backward  # type: ignore[method-assign]

    from torch.utils.data import dataloader

    original_next = dataloader._BaseDataLoaderIter.__next__
    grad_enabled = torch.is_grad_enabled

    def next_batch(self):
        tw.fault_point("data")
        if not grad_enabled() or tw.phase_name == "eval":
            # An evaluation batch: the whole pass (fetch and forward) is `eval`.
            tw.set_phase("eval")
            batch = original_next(self)
        else:
            with tw.phase("data"):
                batch = original_next(self)
        tw.count_batch()
        return batch

    dataloader._BaseDataLoaderIter.__next__ = next_batch  # type: ignore[method-assign]

    original_train = torch.nn.Module.train

    def train(self, mode: bool = True):
        # model.eval() / model.train(): the evaluation pass begins or ends. The
        # call recurses into children; only a change of phase writes the slot.
        if not mode and tw.phase_name in ("compute", "init", "data"):
            tw.set_phase("eval")
        elif mode and tw.phase_name == "eval":
            tw.set_phase("compute")
        return original_train(self, mode)

    torch.nn.Module.train = train  # type: ignore[method-assign]

    for cls in (torch.no_grad, torch.inference_mode):
        _mark_on_exit(cls, tw)

    if tw.faults.wants("hang", "collective_skip"):
        _skip_ddp_allreduce(tw)


def _mark_on_exit(cls, tw) -> None:
    """A finished no_grad / inference_mode block is forward-only progress."""
    original_exit = cls.__exit__

    def __exit__(self, *exc):
        result = original_exit(self, *exc)
        tw.mark_active()
        return result

    cls.__exit__ = __exit__


def _skip_ddp_allreduce(tw) -> None:
    """`--inject hang:where=collective_skip` on an unmodified DDP script: DDP's
    gradient all-reduce never passes through Python's dist.all_reduce, so the
    fault goes in as a DDP communication hook that really skips one bucket's
    all-reduce on this rank, and all-reduces every other bucket as DDP would."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    original_init = DistributedDataParallel.__init__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)

        def hook(group, bucket):
            buffer = bucket.buffer()
            if tw.skip_collective():
                skipped = torch.futures.Future()
                skipped.set_result(buffer)
                return skipped
            # DDP's own all-reduce (mean over ranks), straight on the process
            # group: not through Python's dist.all_reduce, as DDP does it.
            pg = group if group is not None else dist.distributed_c10d._get_default_group()
            buffer.div_(pg.size())
            return pg.allreduce([buffer]).get_future().then(lambda fut: fut.value()[0])

        self.register_comm_hook(self.process_group, hook)

    DistributedDataParallel.__init__ = __init__


def _warn_unfired(tw) -> None:
    """An armed fault that never fired is said, never silently dropped."""
    for f in tw.faults.unfired():
        where = f":where={f.params['where']}" if f.kind == "hang" else ""
        print(f"[trainwatch] rank {tw.rank}: injected fault {f.kind}{where} (step {f.step}) never fired: "
              f"the script never reached its trigger point (fault points are DataLoader batches, "
              f"optimizer steps, dist.all_reduce calls and DDP gradient all-reduces)", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("error: python -m trainwatch.rank.bootstrap needs SCRIPT or -m MODULE (trainwatch launch runs it)",
              file=sys.stderr)
        raise SystemExit(2)
    tw = trainwatch.init()
    try:
        if argv[0] == "-m":
            module, rest = argv[1], argv[2:]
            if not module.startswith("trainwatch.trainer"):
                install_zero_code(tw)
            sys.argv = [module] + rest
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            script, rest = argv[0], argv[1:]
            install_zero_code(tw)
            sys.argv = [script] + rest
            sys.path[0] = os.path.dirname(os.path.abspath(script))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code in (None, 0):
            _warn_unfired(tw)
        raise
    else:
        _warn_unfired(tw)


if __name__ == "__main__":
    main()
