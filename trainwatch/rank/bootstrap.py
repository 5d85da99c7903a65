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

Training health comes from the same hooks: the loss backward() ran on (before
a GradScaler scaled it), the first param group's LR at each optimizer step,
clip_grad_norm_'s total norm as the grad norm, a GradScaler's scale after each
update() (published with the next step), and the time each step spent in the
data, backward and optimizer phases. CPU values are read at once; GPU values
are copied to the host without a synchronisation and read when the copy has
finished (trainwatch.rank.deferred): a step later, so the slot's loss and
grad norm are usually the previous step's. The zero-gradient fraction stays
NaN here: no hook sees it for free.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
import traceback
import weakref
from time import monotonic as _monotonic

import trainwatch
from trainwatch.lines import print_line


def install_zero_code(tw) -> None:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from trainwatch.rank.deferred import DeferredScalar

    last_loss: list = [None]
    steps = [0]
    # GPU scalars are read a step late, never with a synchronisation (see deferred.py).
    loss_reader, norm_reader, scale_reader, lr_reader = (DeferredScalar() for _ in range(4))
    faults = tw.faults

    def on_step(optimizer, args, kwargs) -> None:
        tw.set_phase("compute")
        steps[0] += 1
        lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
        if lr.__class__ is float:
            tw._lr = lr
        elif isinstance(lr, torch.Tensor):
            if (value := lr_reader.take(lr)) is not None:
                tw._lr = value
        elif isinstance(lr, int):
            tw._lr = float(lr)
        if norm_reader.pending and (value := norm_reader.ready()) is not None:
            tw._grad_norm = value
        if scale_reader.pending and (value := scale_reader.ready()) is not None:
            tw._loss_scale = value
        if tw._explicit:
            return  # the script reports its own steps through the API
        loss = last_loss[0]
        last_loss[0] = None
        value = loss_reader.take(loss) if loss is not None else loss_reader.ready()
        tw._record(value, None, None, None)
        tw.fault_point("step_end")

    def on_pre_step(optimizer, args, kwargs) -> None:
        tw.fault_point("forward")
        tw.set_phase("optimizer")
        tw.fault_point("optimizer")
        faults.before_optimizer(tw, optimizer)

    register_optimizer_step_pre_hook(on_pre_step)
    register_optimizer_step_post_hook(on_step)

    def loss_seen(loss):
        loss = tw.perturb_loss(loss)
        last_loss[0] = loss.detach()
        return loss

    scaled: list = [_dead_ref]  # GradScaler.scale's last output (weakly): its loss was seen unscaled
    original_backward = torch.Tensor.backward
    dead_grad = faults.wants("dead_grad")

    def backward(self, *args, **kwargs):
        if self.dim() == 0:
            if scaled[0]() is self:
                scaled[0] = _dead_ref
            else:
                self = loss_seen(self)
        with tw.phase("backward"):
            tw.fault_point("backward")
            result = original_backward(self, *args, **kwargs)
        if dead_grad:
            faults.after_backward(tw, lambda root=self.grad_fn: _leaf_params(root))
        return result

    torch.Tensor.backward = backward  # type: ignore[method-assign]
    _wrap_clip_grad_norm(torch, tw, norm_reader)
    _wrap_grad_scaler(torch, tw, loss_seen, scaled, scale_reader, steps, on_pre_step, on_step)
    _wrap_save(torch, tw)

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


def _dead_ref() -> None:
    return None


def _leaf_params(root) -> list:
    """The leaf tensors (parameters) a backward from autograd node `root` reached."""
    seen, stack, out = set(), [root], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        if variable is not None:
            out.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return out


def _wrap_clip_grad_norm(torch, tw, reader) -> None:
    """clip_grad_norm_ returns the total gradient norm: published as grad_norm
    (read at once on CPU, a step late on GPU)."""
    import functools

    from torch.nn.utils import clip_grad

    original = torch.nn.utils.clip_grad_norm_

    @functools.wraps(original)
    def clip_grad_norm_(*args, **kwargs):
        total = original(*args, **kwargs)
        if isinstance(total, torch.Tensor) and total.numel() == 1:
            value = reader.take(total)
            if value is not None:
                tw._grad_norm = value
        return total

    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    if clip_grad.clip_grad_norm_ is original:
        clip_grad.clip_grad_norm_ = clip_grad_norm_


def _wrap_grad_scaler(torch, tw, loss_seen, scaled, reader, steps, on_pre_step, on_step) -> None:
    """fp16 mixed precision through torch.amp.GradScaler: the scale after each
    update() is published as loss_scale (at the next step); the loss is seen
    before it is scaled; a step the scaler skips (inf/NaN gradients, so no
    optimizer.step() and none of its hooks) is still a step; `scale_collapse`
    puts its overflow in the gradients just before the scaler checks them."""
    classes = [torch.amp.GradScaler]
    cuda_cls = getattr(torch.cuda.amp, "GradScaler", None)
    if cuda_cls is not None and cuda_cls is not torch.amp.GradScaler:
        classes.append(cuda_cls)
    for cls in classes:
        if "update" in cls.__dict__:
            cls.update = _after_update(cls.update, tw, reader)
    gs = torch.amp.GradScaler
    original_scale, original_step = gs.scale, gs.step

    def scale(self, outputs):
        if isinstance(outputs, torch.Tensor) and outputs.dim() == 0:
            result = original_scale(self, loss_seen(outputs))
            scaled[0] = weakref.ref(result)
            return result
        return original_scale(self, outputs)

    def step(self, optimizer, *args, **kwargs):
        before = steps[0]
        result = original_step(self, optimizer, *args, **kwargs)
        if steps[0] == before:  # skipped: the iteration is done all the same
            on_pre_step(optimizer, args, kwargs)
            on_step(optimizer, args, kwargs)
        return result

    gs.scale, gs.step = scale, step
    if tw.faults.wants("scale_collapse"):
        name = "_unscale_grads_" if hasattr(gs, "_unscale_grads_") else "unscale_"
        original_unscale = getattr(gs, name)

        def unscale(self, optimizer, *args, **kwargs):
            tw.faults.before_unscale(tw, lambda: [p for g in optimizer.param_groups for p in g["params"]])
            return original_unscale(self, optimizer, *args, **kwargs)

        setattr(gs, name, unscale)


def _after_update(original, tw, reader):
    def update(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        scale = getattr(self, "_scale", None)
        if scale is not None and self.is_enabled():
            value = reader.take(scale)
            if value is not None:
                tw._loss_scale = value
        return result

    return update


def _wrap_save(torch, tw) -> None:
    """torch.save is a checkpoint (rank 0's alone, often, while its peers wait
    in the next collective): the checkpoint phase, with its allowance."""
    original = torch.save

    def save(*args, **kwargs):
        if tw.phase_name == "checkpoint":
            return original(*args, **kwargs)
        with tw.phase("checkpoint"):
            return original(*args, **kwargs)

    functools.update_wrapper(save, original)
    torch.save = save
    torch.serialization.save = save


def _mark_on_exit(cls, tw) -> None:
    """A finished no_grad / inference_mode block is forward-only progress. The
    outermost block entered with gradients on is also timed (one float store):
    one that lasts (an RL rollout, a generate() call) is published as `eval`
    by the sampler (Telemetry.FORWARD_ONLY_S), so it is not taken for a hang."""
    original_enter = cls.__enter__
    original_exit = cls.__exit__
    grad_enabled = __import__("torch").is_grad_enabled

    def __enter__(self):
        if not tw._nograd_since and grad_enabled():
            tw._nograd_since = _monotonic()
        return original_enter(self)

    def __exit__(self, *exc):
        result = original_exit(self, *exc)
        if tw._nograd_since and grad_enabled():  # gradients back on: the outermost block ended
            tw.end_forward_only()
        tw.mark_active()
        return result

    cls.__enter__ = __enter__
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
        where = f":where={f.params['where']}" if "where" in f.params else ""
        print_line(f"[trainwatch] rank {tw.rank}: injected fault {f.kind}{where} (step {f.step}) never fired: "
                   f"the script never reached its trigger point (fault points are DataLoader batches, backward, "
                   f"optimizer steps, dist.all_reduce calls, DDP gradient all-reduces and, for scale_collapse, "
                   f"a GradScaler)", stderr=True)
    for f in tw.faults.not_replayed():
        print_line(f"[trainwatch] rank {tw.rank}: injected fault {f.kind} (step {f.step}) fired before the restart "
                   f"and was not replayed: this run did not train that data window again (skipped after the "
                   f"non-finite loss, or resumed past it)", stderr=True)


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
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # the user's program failed: say it as Python would, from its own frames
        report_failure(tw, e, argv)
        sys.exit(1)  # what `python script.py` exits with on an uncaught exception
    else:
        _warn_unfired(tw)


_OWN_FILES = (os.path.abspath(__file__), os.path.abspath(runpy.__file__))


def _library_dirs() -> tuple[str, ...]:
    """Where code that is not the user's lives: the standard library, the
    installed packages (torch, numpy...) and trainwatch itself (its hooks)."""
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    dirs = [paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    try:
        dirs += site.getsitepackages() + [site.getusersitepackages()]
    except AttributeError:  # an interpreter started without the site module's helpers
        pass
    dirs.append(os.path.dirname(os.path.abspath(trainwatch.__file__)))
    return tuple(os.path.join(os.path.abspath(d), "") for d in dirs if d)


def raising_frame(frames: list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost frame of the user's own code (what the agent compares to
    tell a replayed crash: a ValueError raised in torch from the user's line 40
    is the user's line 40); the innermost frame when all are library code."""
    library = _library_dirs()
    for f in reversed(frames):
        if not f.filename.startswith("<") and not os.path.abspath(f.filename).startswith(library):
            return f
    return frames[-1] if frames else None


def user_traceback(e: BaseException) -> tuple[str, str | None]:
    """(the traceback as Python prints it, without this bootstrap's and runpy's
    frames on top; the user's file:line it came from, or None)."""
    te = traceback.TracebackException.from_exception(e)
    frames = [f for f in te.stack if os.path.abspath(f.filename) not in _OWN_FILES
              and "<frozen runpy>" not in f.filename]
    te.stack = traceback.StackSummary.from_list(frames)
    where = None
    if isinstance(e, SyntaxError) and e.filename:
        where = f"{e.filename}:{e.lineno}"
    elif (frame := raising_frame(frames)) is not None:
        where = f"{frame.filename}:{frame.lineno}"
    return "".join(te.format()), where


def last_line(e: BaseException) -> str:
    """The exception's last line as Python prints it: 'ValueError: bad shape'."""
    lines = [line.strip() for line in "".join(traceback.format_exception_only(type(e), e)).splitlines()]
    # A SyntaxError prints its source line first; a message of several lines goes on after it.
    named = [line for line in lines if line.split(":", 1)[0].rpartition(".")[2] == type(e).__name__]
    return named[-1] if named else type(e).__name__


def report_failure(tw, e: BaseException, argv: list[str]) -> None:
    """Print the user's traceback (the rank's log keeps it whole) and record the
    failure for the agent, which decides whether a restart can fix it."""
    text, where = user_traceback(e)
    if isinstance(e, ImportError) and argv[:1] == ["-m"] and where is None:
        text = f"{sys.executable}: {e}\n"  # runpy could not find the module: as `python -m` says it
    print(text, end="", file=sys.stderr, flush=True)
    line = last_line(e)
    message = line.split(": ", 1)[1] if ": " in line else ""
    tw.record_failure(type(e).__name__, message, where)


if __name__ == "__main__":
    main()
