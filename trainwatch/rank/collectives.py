"""torch.distributed's Python collectives, counted and marked as waits.

Counting gives the end-of-step collective counts ranks compare (and the
fallback when the flight recorder is off); marking a blocking call, or a
`work.wait()`, as the `collective` phase makes a rank that waits on a peer a
victim, and the peer that never joins the culprit.
"""

from __future__ import annotations

import gc
import inspect
from typing import Any, Callable

COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_single",  # FSDP2's all-gather (torch >= 2.10)
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",  # FSDP2's reduce-scatter
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
)
# Point-to-point: a rank blocked in one waits on a peer (phase `collective`),
# but ranks issue different ones by design (pipeline stages), so they are
# never part of the counts ranks compare.
P2P = ("send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list")
_ASYNC_P2P = frozenset({"isend", "irecv", "batch_isend_irecv"})


def _group_arg_index(fn: Callable) -> int | None:
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return params.index("group") if "group" in params else None


def _wrap_work_wait(tw: Any, dist: Any) -> None:
    """`work.wait()` on an async collective or point-to-point op (isend/irecv,
    FSDP's all-gathers) blocks on peers just like a blocking call: mark it."""
    work = getattr(getattr(dist, "distributed_c10d", None), "Work", None)
    original = getattr(work, "wait", None)
    if original is None:
        return

    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        token = tw.begin_wait()  # None when the blocking call around it already marked it
        try:
            return original(self, *args, **kwargs)
        finally:
            tw.end_wait(token)

    try:
        work.wait = wait
    except (TypeError, AttributeError):
        pass  # a build whose Work type is closed: blocking calls are still marked


def install(tw: Any) -> None:
    """Wrap torch.distributed's Python collectives: count them (the fallback
    when the flight recorder is unavailable, and the end-of-step count ranks
    compare), and mark the rank as waiting in a collective while a blocking
    one runs, so a peer that never joins it is the one named."""
    try:
        import torch.distributed as dist
    except Exception:
        return
    if getattr(dist, "_trainwatch_wrapped", False):
        return
    spans_world: dict[int, bool] = {}

    def is_world(group: Any) -> bool:
        # Subgroup collectives (pipeline stages, tensor-parallel groups) differ
        # between ranks by design; only world-spanning groups must agree.
        if group is None:
            return True
        known = spans_world.get(id(group))
        if known is None:
            try:
                known = dist.get_world_size(group) == dist.get_world_size()
            except Exception:
                known = False
            spans_world[id(group)] = known
        return known

    def wrap(name: str, fn: Callable) -> Callable:
        skippable = name == "all_reduce"
        p2p = name in P2P
        always_async = name in _ASYNC_P2P
        at = _group_arg_index(fn)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if skippable and tw.faults.skip_collective(tw):
                return None  # an injected desync: this rank silently skips one all_reduce
            tw.py_collectives += 1
            if not p2p:
                group = kwargs.get("group") if "group" in kwargs or at is None else (
                    args[at] if len(args) > at else None)
                if is_world(group):
                    tw.world_collectives += 1
            tw.last_py_op = name
            if always_async or kwargs.get("async_op"):
                tw.publish_phase()
                return fn(*args, **kwargs)
            # Published before the call: a rank blocked inside it must show
            # that it entered one more collective than a peer that skipped it.
            token = tw.begin_wait()
            try:
                return fn(*args, **kwargs)
            finally:
                tw.end_wait(token)

        counted.__wrapped__ = fn  # type: ignore[attr-defined]
        counted.__name__ = fn.__name__
        counted.__doc__ = fn.__doc__
        return counted

    for name in COLLECTIVES + P2P:
        fn = getattr(dist, name, None)
        if fn is not None:
            setattr(dist, name, wrap(name, fn))
    _wrap_work_wait(tw, dist)

    destroy = dist.destroy_process_group

    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        try:  # last look at the flight recorder before the groups are gone
            tw.sample_now()
        except Exception:
            pass
        # A DDP module waiting for the cyclic collector may hold the last
        # reference to its process group; freed after the group is destroyed,
        # its destructor joins gloo's threads holding the GIL while a worker
        # needs the GIL to finish: a hang at exit. Free it while the group lives.
        gc.collect()
        tw.forget_group()  # the group's sequence counter goes with it
        spans_world.clear()
        return destroy(*args, **kwargs)

    dist.destroy_process_group = destroy_process_group
    dist._trainwatch_wrapped = True  # type: ignore[attr-defined]
