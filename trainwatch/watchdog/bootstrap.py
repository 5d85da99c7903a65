"""Zero-code telemetry: `trainwatch launch` runs an unmodified script through here.

    python -u -m trainwatch.watchdog.bootstrap train.py ARGS...
    python -u -m trainwatch.watchdog.bootstrap -m package.module ARGS...

It attaches the rank to its slot, then runs the user's program as __main__.
Steps come from a global optimizer step post-hook; phases from light wrappers
around DataLoader iteration, Tensor.backward and the optimizer step, so a
hung rank shows where it is without a single line of user code changed.
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

    def next_batch(self):
        tw.fault_point("data")
        with tw.phase("data"):
            return original_next(self)

    dataloader._BaseDataLoaderIter.__next__ = next_batch  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m trainwatch.watchdog.bootstrap (SCRIPT | -m MODULE) [ARGS...]", file=sys.stderr)
        raise SystemExit(2)
    tw = trainwatch.init()
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


if __name__ == "__main__":
    main()
