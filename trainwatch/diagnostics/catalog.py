"""The hang-pattern catalog: one table that names where a stuck rank waits.

Each `Pattern` says which frames reveal it (regexes over function names and
files), which stack category it belongs to and which runbook to follow. The
table is ordered: the first pattern that matches a thread wins, so specific
patterns (an all-gather under a checkpoint save, a GC pass, a build lock) sit
above the generic "waiting in a collective" one, and "busy in Python" is last.

A process has many threads. `interesting_thread` looks at all of them: a thread
waiting in a collective, an autograd worker blocked on gradient reduction or
any catalog match beats an idle helper thread, whatever its name.

Adding a pattern: add one entry to PATTERNS, one runbook under
trainwatch/runbooks/, and one test in tests/test_catalog.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trainwatch.diagnostics.frame_rules import (  # noqa: F401 - re-exported for the catalog's readers
    BARRIER_RULES,
    CHECKPOINT_RULES,
    COLLECTIVE_RULES,
    DATA_MODULE_RULE,
    DATALOADER_RULES,
    DATALOADER_WORKER_RULES,
    DIST_FILE,
    QUEUE_WAIT_RULES,
    USER_CODE,
    FrameRule,
    _rx,
)
from trainwatch.diagnostics.stacks import Frame, ProcessStack, ThreadStack, is_address

CATEGORIES = ("collective_wait", "moe_all_to_all", "barrier", "gc_collect", "dataloader", "checkpoint_io",
              "compile_lock", "cuda_sync", "other")
"""Stack categories from DESIGN.md; every pattern belongs to exactly one."""


@dataclass(frozen=True, slots=True)
class Signature:
    """One way a pattern shows in a thread: every rule must be met (all-of)."""

    all_of: tuple[FrameRule, ...]
    """Rules that must each be met by some frame; the first one's frame is the evidence."""
    exception: str | None = None
    """Regex the thread's exception line must match (tracebacks); None: not checked."""
    innermost_only: bool = False
    """Check the rules against the innermost named frame only."""
    innermost_python: bool = False
    """Check the rules against the innermost Python (.py) frame only: native frames inside it
    (py-spy --native, gdb) are how that Python call waits, not a different place."""
    innermost_raw: bool = False
    """Check the rules against the innermost frame as printed, unnamed or not: a driver frame
    gdb could not name (`?? () from libcuda.so.1`) still names its library."""
    busy: bool = False
    """The thread must not be known idle and must not end in an exception."""


@dataclass(frozen=True, slots=True)
class Pattern:
    """A known place where training processes get stuck."""

    id: str
    """Stable identifier, used in verdicts and tests."""
    category: str
    """One of CATEGORIES."""
    title: str
    """One-line name shown to the operator."""
    signatures: tuple[Signature, ...]
    """Ways the pattern shows in a stack; any one suffices (any-of)."""
    meaning: str
    """What a rank stuck here is waiting for, in a sentence or two."""
    runbook: str
    """Id of the runbook (trainwatch/runbooks/<id>.md) to follow."""


@dataclass(frozen=True, slots=True)
class PatternMatch:
    """A pattern found in one thread of a process."""

    pattern: Pattern
    """The pattern that matched."""
    thread: ThreadStack
    """The thread it matched in."""
    frame: Frame | None
    """The frame that revealed it (evidence); None only for frameless threads."""


def _any(*rules: FrameRule, **flags) -> tuple[Signature, ...]:
    """One single-rule signature per rule: any of these frames reveals the pattern."""
    return tuple(Signature((rule,), **flags) for rule in rules)


def _both(first: tuple[FrameRule, ...], second: tuple[FrameRule, ...]) -> tuple[Signature, ...]:
    """A frame from `first` AND a frame from `second` (every combination)."""
    return tuple(Signature((a, b)) for a in first for b in second)


# --- the table ---------------------------------------------------------------

PATTERNS: tuple[Pattern, ...] = (
    Pattern(
        id="gc-collect",
        category="gc_collect",
        title="Python garbage collection pass",
        signatures=_any(
            FrameRule(function=r"(?i)(?:^|[._:])(?:gc_collect\w*|collect_with_callback|_?PyGC_Collect|"
                               r"garbage_?collect\w*)$|GarbageCollect|^<gc>$"),
            FrameRule(file=r"(?i)(?:^|/)(?:garbage_collection|scheduled_gc\w*|gc_callbacks?)\.py$"),
        ),
        meaning="The rank is inside a garbage-collection pass (or a GC callback). A long, "
                "unsynchronised GC on one rank leaves its peers waiting in the next collective.",
        runbook="gc-hang",
    ),
    Pattern(
        id="cuda-synchronize",
        category="cuda_sync",
        title="Waiting in torch.cuda.synchronize()",
        signatures=_any(
            FrameRule(function=r"(?:^|[.:])synchronize$",
                      file=r"(?:^|/)(?:torch/(?:cuda|accelerator|xpu)/|deepspeed/accelerator/)"),
            innermost_python=True,
        ),
        meaning="The innermost Python call is a device synchronize: the rank waits for every kernel "
                "it queued, whatever framework code (a gradient all-reduce, a timer) called it. If "
                "a queued NCCL kernel waits for a peer, or the GPU is faulted, it never returns.",
        runbook="cuda-sync",
    ),
    Pattern(
        id="moe-all-to-all",
        category="moe_all_to_all",
        title="All-to-all in MoE token dispatch/combine",
        signatures=_any(
            FrameRule(function=r"(?i)token_dispatch|token_permut|token_unpermut|dispatch_tokens|all_?to_?all"),
            FrameRule(file=r"(?i)token_dispatcher\w*\.py$|fused_a2a\.py$|sharded_moe\.py$"),
        ),
        meaning="The rank is exchanging tokens with the other expert-parallel ranks. Every rank of "
                "the expert group must enter the same all-to-all with matching split sizes.",
        runbook="moe-all-to-all",
    ),
    Pattern(
        id="checkpoint-collective",
        category="checkpoint_io",
        title="Collective inside checkpoint save/load (resharding)",
        signatures=_both(COLLECTIVE_RULES, CHECKPOINT_RULES),
        meaning="A collective issued by checkpoint code, usually the all-gather that reshards "
                "state while saving or loading. Slow shared storage on one rank holds all the others.",
        runbook="checkpoint-reshard",
    ),
    Pattern(
        id="nccl-comm-init",
        category="collective_wait",
        title="Process group / NCCL communicator initialisation",
        signatures=_any(
            FrameRule(function=r"(?:^|[.])(?:init_process_group|_new_process_group_helper|new_group|"
                               r"_new_group_with_tag|new_subgroups\w*|_store_based_barrier|init_device_mesh|"
                               r"split_group|init_distributed|_create_c10d_store|_\w+_rendezvous_handler|"
                               r"_?rendezvous)$"),
            FrameRule(function=r"getNCCLComm|broadcastUniqueNCCLID|ncclCommInit\w*|ncclCommSplit|"
                               r"ProcessGroupNCCL::ProcessGroupNCCL|eagerConnectSingleDevice|"
                               r"TCPStore::TCPStore|tcputil::connect|TCPClient::connect"),
        ),
        meaning="The rank is still forming its process group or NCCL communicator: it waits for "
                "every peer to reach the rendezvous store and exchange the NCCL unique id.",
        runbook="nccl-init-hang",
    ),
    Pattern(
        id="barrier",
        category="barrier",
        title="Waiting in a barrier",
        signatures=_any(*BARRIER_RULES),
        meaning="The rank reached a barrier and waits for the ranks that have not; those are the "
                "ones to look at.",
        runbook="barrier-hang",
    ),
    Pattern(
        id="dataloader-worker-death",
        category="dataloader",
        title="DataLoader worker died or its pipe broke",
        signatures=(
            *_any(
                FrameRule(function=r"(?:^|[.])(?:_shutdown_workers|_error_if_any_worker_fails)$"),
                FrameRule(function=r"(?:^|[.])handler$", file=r"torch/utils/data/_utils/signal_handling\.py$"),
            ),
            *_both(
                (FrameRule(function=r"(?:^|[.])(?:rebuild_storage_fd|rebuild_storage_filename)$"),
                 FrameRule(file=r"(?:^|/)multiprocessing/resource_sharer\.py$")),
                (FrameRule(function=r"(?:^|[.])(?:_pin_memory_loop|_try_get_data|_get_data)$"),),
            ),
            Signature((FrameRule(file=r"(?:^|/)torch/utils/data/"),),
                      exception=r"DataLoader worker|ConnectionResetError|ConnectionRefusedError|EOFError"),
        ),
        meaning="A data loader worker process was killed (often by the OOM killer) or the pipe "
                "that carries its batches broke; the training loop cannot get its next batch.",
        runbook="dataloader-worker-killed",
    ),
    Pattern(
        id="dataloader-stall",
        category="dataloader",
        title="Waiting for the next batch (DataLoader.__next__)",
        signatures=(
            *_any(*DATALOADER_RULES),
            # A project's own data loader: the innermost Python frame there (a dump, or Ctrl-C).
            *_any(DATA_MODULE_RULE, innermost_python=True, busy=True),
            *_any(DATA_MODULE_RULE, innermost_python=True, exception=r"KeyboardInterrupt"),
        ),
        meaning="The training loop waits for data: workers are slow (storage, decoding) or stuck.",
        runbook="dataloader-stall",
    ),
    Pattern(
        id="checkpoint-io",
        category="checkpoint_io",
        title="Checkpoint write/read (torch.save, DCP, zipfile)",
        signatures=_any(
            FrameRule(function=r"(?:^|[.])(?:save|_save|_legacy_save|load|_load|_legacy_load|write_record|"
                               r"write_end_of_file|_open_zipfile_writer|_open_zipfile_reader)$",
                      file=r"(?:^|/)torch/serialization\.py$"),
            FrameRule(file=r"(?:^|/)torch/distributed/checkpoint/"),
            FrameRule(file=r"(?:^|/)dist_checkpointing/"),
            FrameRule(function=r"(?:^|[.])(?:save_file|save_model|save_torch_state_dict|load_file)$",
                      file=r"(?:^|/)(?:safetensors|huggingface_hub)/"),
            FrameRule(function=r"(?:^|[.])(?:write|writestr|close|_write_end_record)$",
                      file=r"(?:^|/)zipfile(?:/__init__)?\.py$"),
            FrameRule(function=r"(?i)(?:^|[._])_?save_checkpoint$"),
        ),
        meaning="The rank is writing or reading a checkpoint file; on slow shared storage this can "
                "outlast the collective timeout of the ranks waiting for it.",
        runbook="checkpoint-io",
    ),
    Pattern(
        id="collective-wait",
        category="collective_wait",
        title="Waiting in a collective (all_reduce, all_gather, broadcast, ...)",
        signatures=_any(*COLLECTIVE_RULES),
        meaning="The rank entered a collective and waits for peers that have not entered it (or "
                "entered a different one). The ranks elsewhere are the suspects.",
        runbook="collective-wait",
    ),
    Pattern(
        id="cuda-device-wait",
        category="cuda_sync",
        title="Host waiting for the GPU in the CUDA runtime or driver (a sync, .item(), a copy to the CPU)",
        signatures=(
            *_any(
                FrameRule(function=r"(?:^|[.:])synchronize$", file=r"(?:^|/)torch/cuda/"),
                FrameRule(function=r"^(?:cudaDeviceSynchronize|cudaStreamSynchronize|cudaEventSynchronize|"
                                   r"cuCtxSynchronize|cuStreamSynchronize|cuEventSynchronize)\b"),
                # The same wait on ROCm (HIP) and Apple (MPS/Metal) devices.
                FrameRule(function=r"^(?:hipDeviceSynchronize|hipStreamSynchronize|hipEventSynchronize|"
                                   r"hipMemcpy\w*)\b|mps::\w*[Ss]ynchronize|MPSModule_deviceSynchronize|"
                                   r"waitUntilCompleted\]?$"),
                FrameRule(function=r"_local_scalar_dense|c10::cuda::(?:device|stream)_synchronize"),
                # Device-to-host copies (.cpu(), .item(), .to("cpu")) block until the GPU gets there.
                FrameRule(function=r"^(?:cudaMemcpy\w*|cuMemcpy\w*)\b|copy_kernel_cuda"),
            ),
            # A thread stopped inside the CUDA driver itself, even where gdb names no function.
            *_any(FrameRule(file=r"(?:^|/)libcuda\.so"), innermost_raw=True),
            # Python-only dumps show where the wait was entered: a value turned into a device
            # tensor or read back from one (Lightning's self.log, .item(), .tolist()).
            *_any(FrameRule(function=r"^(?:_+to_tensor|to_tensor|item|tolist)$"), innermost_python=True),
            # JAX: an array's value read back to the host (float(x), np.asarray(x), jax.device_get).
            *_any(FrameRule(function=r"^(?:_value|__float__|__int__|__array__|block_until_ready|device_get)$",
                            file=r"(?:^|/)jax/_src/"), innermost_python=True),
        ),
        meaning="The CPU waits for queued GPU work to finish (a synchronize, or a copy of a result "
                "to the CPU). When that work is a NCCL kernel waiting for a peer, or the GPU is "
                "faulted, the wait never ends.",
        runbook="cuda-sync",
    ),
    Pattern(
        id="triton-compile",
        category="compile_lock",
        title="Triton compilation / cache lock",
        signatures=(
            *_any(
                FrameRule(file=r"(?:^|/)triton/compiler/"),
                FrameRule(file=r"(?:^|/)triton/runtime/(?:cache|build)\.py$"),
            ),
            Signature((FrameRule(file=r"(?i)filelock"),
                       FrameRule(file=r"(?:^|/)(?:triton|torch/_inductor)/"))),
        ),
        meaning="The rank is compiling a Triton kernel or waiting for the lock on the Triton cache; "
                "hundreds of ranks sharing one cache on network storage serialise here.",
        runbook="triton-cache-lock",
    ),
    Pattern(
        id="cpp-extension-lock",
        category="compile_lock",
        title="C++/CUDA extension build lock (FileBaton)",
        signatures=_any(
            FrameRule(file=r"(?:^|/)torch/utils/file_baton\.py$"),
            FrameRule(function=r"(?:^|[.])(?:_jit_compile|_write_ninja_file_and_build_library|_run_ninja_build|"
                               r"_build_extension_module)$"),
            FrameRule(function=r"(?:^|[.])(?:load|load_inline)$", file=r"(?:^|/)torch/utils/cpp_extension\.py$"),
            FrameRule(function=r"(?:^|[.])jit_load$", file=r"op_builder"),
        ),
        meaning="The rank waits for another process to finish building a JIT extension, or for a "
                "lock file left behind by a build that was killed.",
        runbook="cpp-extension-lock",
    ),
    Pattern(
        id="autograd-collective",
        category="collective_wait",
        title="Backward pass blocked on gradient reduction",
        signatures=_any(
            FrameRule(function=r"(?:^|[.])_?(?:engine_run_backward|run_backward)$"),
            FrameRule(function=r"(?:^|[.])backward$", file=r"(?:^|/)torch/autograd/__init__\.py$"),
            FrameRule(function=r"torch::autograd::(?:python::Python)?Engine::execute\b"),
            # DDP/FSDP/ZeRO gradient hooks (the all-reduce ones already match the generic pattern).
            FrameRule(function=r"(?i)_reducer\b|Reducer::|comm_hook|_post_backward_hook|_reduce_grad\w*|"
                               r"reduce_ipg_grads|reduce_and_partition_ipg_grads"),
        ),
        meaning="The rank is in backward; its autograd threads run the gradient-reduction hooks "
                "(DDP, FSDP, ZeRO) and wait there for peers.",
        runbook="collective-wait",
    ),
    Pattern(
        id="dataloader-worker",
        category="dataloader",
        title="A DataLoader worker process (waiting on its index queue, or making a batch)",
        # Last but one: a worker's stack is the weakest sign in a process, so any other
        # pattern in any thread wins; but a worker busy in the user's dataset code is
        # still the data pipeline, not a spin in the training loop.
        signatures=(
            *_any(DATALOADER_WORKER_RULES[0]),
            *_both(DATALOADER_WORKER_RULES[1:], QUEUE_WAIT_RULES),
        ),
        meaning="The process is one of the DataLoader's worker processes. Idle on its index "
                "queue, it waits for the training process to ask for batches, so that process is "
                "the one to look at; busy, it is loading or decoding a sample.",
        runbook="dataloader-stall",
    ),
    Pattern(
        id="compute-spin",
        category="other",
        title="Busy in user Python code",
        signatures=(Signature((FrameRule(file=USER_CODE),), innermost_only=True, busy=True),),
        meaning="The rank is running its own Python code, not waiting on anything known: an "
                "endless loop, a very slow step, or a rank that took a different code path.",
        runbook="compute-spin",
    ),
)
"""The catalog, most specific first: the first pattern that matches a thread wins."""

PATTERNS_BY_ID = {p.id: p for p in PATTERNS}
_PRIORITY = {p.id: i for i, p in enumerate(PATTERNS)}


def get(pattern_id: str | None) -> Pattern | None:
    """The catalog entry with this id, or None."""
    return PATTERNS_BY_ID.get(pattern_id) if pattern_id else None


def pattern_by_id(pattern_id: str) -> Pattern:
    """The catalog entry with this id; ValueError naming the known ids otherwise."""
    try:
        return PATTERNS_BY_ID[pattern_id]
    except KeyError:
        raise ValueError(f"unknown pattern {pattern_id!r}; known: {', '.join(PATTERNS_BY_ID)}") from None


# --- matching ------------------------------------------------------------------


# Torch's NCCL watchdog and heartbeat threads poll outstanding collectives in every
# healthy process; their frames say nothing about where the training thread waits.
_BACKGROUND = re.compile(r"(?i)watchdog|heartbeat_?monitor|workCleanupLoop|"
                         r"WorkNCCL::(?:isCompleted|finishedGPUExecution|checkTimeout)")


def match_thread(thread: ThreadStack) -> PatternMatch | None:
    """The first catalog pattern this thread shows, or None (always None for watchdog threads)."""
    frames = tuple(f for f in thread.frames if not is_address(f))
    if any(_BACKGROUND.search(f.function) for f in frames):
        return None
    for pattern in PATTERNS:
        hits = [f for sig in pattern.signatures if (f := _satisfies(sig, thread, frames)) is not None]
        if hits:
            # The innermost revealing frame is the best evidence of where the thread waits;
            # a named frame says more than an address in the same library.
            return PatternMatch(pattern, thread, min(hits, key=lambda f: (is_address(f), thread.frames.index(f))))
    return None


_LIBC_WAIT = re.compile(r"(?:^|/)(?:libc|libpthread|ld-linux[\w-]*)(?:[.-][\w.]*)?\.so|^(?:libc|libpthread)\b"
                        r"|(?:^|/)(?:pthread_cond_wait|futex-internal|poll|nanosleep)\.[cS]$")


_INTERRUPTED = re.compile(r"KeyboardInterrupt|SystemExit|Timeout|timed\s*out", re.I)
"""A traceback's exception that interrupted a wait (Ctrl-C, a time-out): its frames are where it waited."""


def _candidates(sig: Signature, thread: ThreadStack, frames: tuple[Frame, ...]) -> tuple[Frame, ...]:
    """The frames a signature's rules are checked against."""
    if sig.innermost_raw:
        # The C library's wait (futex, poll, sched_yield, nanosleep) is how the innermost
        # real frame waits: look through it to the first frame of another library.
        for index, frame in enumerate(thread.frames):
            if not _LIBC_WAIT.search(frame.file) or index == len(thread.frames) - 1:
                return thread.frames[index:index + 1]
        return ()
    if sig.innermost_python:
        return next(((f,) for f in frames if f.file.endswith(".py")), ())
    return frames[:1] if sig.innermost_only else frames


def _satisfies(sig: Signature, thread: ThreadStack, frames: tuple[Frame, ...]) -> Frame | None:
    if sig.exception is not None and not (thread.exception and _rx(sig.exception).search(thread.exception)):
        return None
    if sig.exception is None and thread.exception and not _INTERRUPTED.search(thread.exception):
        return None  # any other exception is a crash where it was raised, not a wait
    if sig.busy and (thread.active is False or thread.exception):
        return None
    candidates = _candidates(sig, thread, frames)
    evidence = None
    for rule in sig.all_of:
        hit = next((f for f in candidates if rule.matches(f)), None)
        if hit is None:
            return None
        evidence = evidence or hit
    return evidence


def interesting_thread(process: ProcessStack) -> tuple[ThreadStack | None, PatternMatch | None]:
    """The thread that best explains where this process is, and its pattern match (if any).

    All threads compete: a catalog match beats no match and a more specific
    pattern beats a generic one; then threads with frames beat empty ones, busy
    beats idle (py-spy `active: false`), and MainThread breaks the remaining ties.
    """
    best = None
    for index, thread in enumerate(process.threads):
        match = match_thread(thread)
        key = (
            _PRIORITY[match.pattern.id] if match else len(PATTERNS),
            0 if thread.frames else 1,
            1 if thread.active is False else 0,
            0 if thread.thread_name == "MainThread" else 1,
            index,
        )
        if best is None or key < best[0]:
            best = (key, thread, match)
    return (best[1], best[2]) if best else (None, None)


def match_stack(process: ProcessStack) -> PatternMatch | None:
    """The pattern of the process's most interesting thread, or None."""
    return interesting_thread(process)[1]


def classify(process: ProcessStack) -> str:
    """Stack category of a process; `other` when nothing in the catalog matches."""
    match = match_stack(process)
    return match.pattern.category if match else "other"
