"""Stack model, parsers, signatures, grouping and the explain view of stacks.

Parsers are tested on every supported shape (py-spy text/JSON, faulthandler,
tracebacks, pystack, gdb, c10 C++ frames), on real output produced here
(faulthandler, traceback, a live py-spy dump) and on real dumps from public
issue threads (the golden corpus in tests/fixtures/explain/stack-*.txt).
"""

from __future__ import annotations

import faulthandler
import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from pathlib import Path

import pytest

from trainwatch.diagnostics.stack_groups import (
    STOPPED_ERROR,
    StackGroup,
    group_stacks,
    odd_one_out,
    signature,
    stack_findings,
)
from trainwatch.diagnostics.stack_parsers import parse_pyspy_json, parse_stack_text, strip_line_prefixes
from trainwatch.diagnostics.stacks import Frame, ProcessStack, ThreadStack, short_path

FIXTURES = Path(__file__).parent / "fixtures" / "explain"
FINDING_KEYS = {"kind", "category", "op", "xid", "pci", "seq", "timeout_ms", "rank", "ranks",
                "severity", "runbook", "evidence"}


def dedent(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


# --- py-spy text ---------------------------------------------------------------

PYSPY_TWO_PROCESSES = dedent('''
    Process 1234: python train.py --lr 3e-4
    Python v3.11.7 (/usr/bin/python3.11)

    Thread 0x7F0A2B3C4740 (active+gil): "MainThread"
        all_reduce (torch/distributed/distributed_c10d.py:2501)
            Arguments:
                tensor: <Tensor at 0x7f0a>
            Locals:
                work: None
        wrapper (torch/distributed/c10d_logger.py:83)
        train_step (train.py:41)
        <module> (train.py:90)
    Thread 0x7F0A11112222 (idle): "Thread-1"
        wait (threading.py:324)
        run (tqdm/_monitor.py:60)
    Process 1235: python train.py --lr 3e-4
    Python v3.11.7 (/usr/bin/python3.11)

    Thread 1235 (idle): "MainThread"
        0x7f259f401d71 (libc.so.6)
        __next__ (torch/utils/data/dataloader.py:708)
        train_step (train.py:38)
''')


def test_pyspy_text_processes_threads_and_frames():
    procs = parse_stack_text(PYSPY_TWO_PROCESSES)
    assert [(p.pid, p.command) for p in procs] == [(1234, "python train.py --lr 3e-4"),
                                                   (1235, "python train.py --lr 3e-4")]
    main, helper = procs[0].threads
    assert (main.thread_id, main.thread_name, main.active, main.gil) == ("0x7F0A2B3C4740", "MainThread", True, True)
    assert (helper.thread_name, helper.active, helper.gil) == ("Thread-1", False, False)
    # Innermost first; `Arguments:`/`Locals:` blocks are not frames.
    assert main.frames[0] == Frame("all_reduce", "torch/distributed/distributed_c10d.py", 2501)
    assert [f.function for f in main.frames] == ["all_reduce", "wrapper", "train_step", "<module>"]
    native = procs[1].threads[0].frames
    assert native[0] == Frame("0x7f259f401d71", "libc.so.6", None)
    assert native[1].function == "__next__"


def test_pyspy_text_without_thread_id_and_with_junk_lines():
    text = dedent('''
        Thread (idle): "MainThread"
            get (queue.py:180)
            ...
            _poll → poll → get
        Thread 4076 (idle)
    ''')
    (proc,) = parse_stack_text(text)
    assert proc.pid is None
    assert [t.thread_name for t in proc.threads] == ["MainThread", None]
    assert proc.threads[0].frames == (Frame("get", "queue.py", 180),)
    assert proc.threads[1].frames == ()  # py-spy lists threads with no Python frames


# --- py-spy JSON ------------------------------------------------------------------

def _json_thread(name, frames, pid=77, tid=101, active=False, gil=False):
    return {
        "pid": pid, "thread_id": 140000 + tid, "thread_name": name, "os_thread_id": tid,
        "active": active, "owns_gil": gil, "process_info": None,
        "frames": [{"name": f, "filename": path, "module": None, "short_filename": path.rsplit("/", 1)[-1],
                    "line": line, "locals": None, "is_entry": False} for f, path, line in frames],
    }


def test_parse_pyspy_json_thread_list_and_capture_metadata():
    data = [
        _json_thread("MainThread", [("all_gather", "/v/site-packages/torch/distributed/distributed_c10d.py", 3000),
                                    ("step", "/job/train.py", 10)], active=True, gil=True),
        _json_thread("pin", [("clock_nanosleep", "/usr/lib/libc.so.6", 0)], tid=102),
    ]
    (proc,) = parse_pyspy_json(data, pid=77, rank=3)
    assert (proc.pid, proc.rank, proc.error) == (77, 3, None)
    main = proc.threads[0]
    assert (main.thread_id, main.thread_name, main.active, main.gil) == ("101", "MainThread", True, True)
    assert main.frames[0].describe() == "all_gather (torch/distributed/distributed_c10d.py:3000)"
    assert proc.threads[1].frames[0].line is None  # native frames come with line 0


def test_parse_pyspy_json_mapping_wrapper_and_concatenated_dumps():
    by_pid = {"11": [_json_thread("MainThread", [("f", "a.py", 1)], pid=11)],
              "12": [_json_thread("MainThread", [("g", "b.py", 2)], pid=12)]}
    assert [p.pid for p in parse_pyspy_json(by_pid)] == [11, 12]
    wrapped = {"pid": 5, "rank": 0, "command": "python x.py", "threads": [_json_thread("MainThread", [])]}
    (proc,) = parse_pyspy_json(wrapped)
    assert (proc.pid, proc.rank, proc.command) == (5, 0, "python x.py")
    failed = {"pid": 6, "rank": 1, "error": "py-spy timed out after 10 s"}
    assert parse_pyspy_json(failed) == [ProcessStack(6, 1, None, (), "py-spy timed out after 10 s")]
    text = "\n".join(json.dumps([_json_thread("MainThread", [("f", "a.py", 1)], pid=p)]) for p in (21, 22))
    assert [p.pid for p in parse_stack_text(text)] == [21, 22]


@pytest.mark.parametrize("junk", [None, 3, "x", [], [1, 2], {"frames": 5}, [{"frames": [None, 7]}],
                                  {"a": {"b": None}}, [[[]]], {"threads": "no"}])
def test_parse_pyspy_json_never_raises(junk):
    assert isinstance(parse_pyspy_json(junk), list)


def test_real_pyspy_dump_json_round_trip():
    """Dump a live process with the real py-spy and find the function it sleeps in."""
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    script = ("import threading, time\n"
              "def waiting_in_helper():\n    time.sleep(60)\n"
              "threading.Thread(target=waiting_in_helper, name='helper', daemon=True).start()\n"
              "print('ready', flush=True)\ntime.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        dump = subprocess.run([pyspy, "dump", "--json", "--pid", str(child.pid)],
                              capture_output=True, text=True, timeout=60)
        if dump.returncode != 0:
            pytest.skip(f"py-spy cannot attach here: {dump.stderr.strip()[:200]}")
    finally:
        child.kill()
        child.wait()
    procs = parse_pyspy_json(json.loads(dump.stdout))
    assert [p.pid for p in procs] == [child.pid]
    helper = next(t for t in procs[0].threads if t.thread_name == "helper")
    assert helper.frames[0].function.endswith("waiting_in_helper")
    assert helper.active is False


# --- faulthandler, tracebacks ----------------------------------------------------------

def test_faulthandler_dump_with_threads_and_gc_mark():
    text = dedent('''
        Fatal Python error: Aborted

        Thread 0x00007fc81efd6700 (most recent call first):
          File "/usr/lib/python3.10/threading.py", line 306 in wait
          File "/usr/lib/python3.10/queue.py", line 179 in get

        Current thread 0x00007f04d36bb740 (most recent call first):
          Garbage-collecting
          File "/job/train.py", line 12 in step
          File "/job/train.py", line 30 in <module>
    ''')
    (proc,) = parse_stack_text(text)
    other, current = proc.threads
    assert other.thread_id == "0x00007fc81efd6700"
    assert other.frames[0] == Frame("wait", "/usr/lib/python3.10/threading.py", 306)
    assert current.frames[0] == Frame("<gc>", "gc")
    assert [f.function for f in current.frames[1:]] == ["step", "<module>"]


def _here_in_faulthandler():
    with tempfile.TemporaryFile("w+") as out:
        faulthandler.dump_traceback(file=out, all_threads=True)
        out.seek(0)
        return out.read()


def test_real_faulthandler_output():
    (proc,) = parse_stack_text(_here_in_faulthandler())
    functions = [f.function for t in proc.threads for f in t.frames]
    assert "_here_in_faulthandler" in functions
    current = next(t for t in proc.threads if t.frames and t.frames[0].function == "_here_in_faulthandler")
    assert current.frames[1].function == "test_real_faulthandler_output"  # innermost first


def _raise_in_helper():
    raise RuntimeError("DataLoader worker (pid 801) is killed by signal: Killed.")


def test_real_traceback_is_reversed_and_keeps_exception():
    try:
        _raise_in_helper()
    except RuntimeError:
        text = traceback.format_exc()
    (proc,) = parse_stack_text(text)
    (thread,) = proc.threads
    assert thread.frames[0].function == "_raise_in_helper"
    assert thread.frames[1].function == "test_real_traceback_is_reversed_and_keeps_exception"
    assert thread.exception == "RuntimeError: DataLoader worker (pid 801) is killed by signal: Killed."


def test_chained_tracebacks_become_separate_threads():
    text = dedent('''
        Traceback (most recent call last):
          File "a.py", line 1, in inner
            x()
        ValueError: bad

        The above exception was the direct cause of the following exception:

        Traceback (most recent call last):
          File "b.py", line 2, in outer
            y()
        RuntimeError: wrapped
    ''')
    (proc,) = parse_stack_text(text)
    assert [(t.frames[0].function, t.exception) for t in proc.threads] == [
        ("inner", "ValueError: bad"), ("outer", "RuntimeError: wrapped")]


# --- pystack, gdb, c10 frames ---------------------------------------------------------

def test_pystack_output():
    text = dedent('''
        Traceback for thread 112 (python3) [Has the GIL] (most recent call last):
            (Python) File "/job/train.py", line 17, in <module>
                main()
            (Python) File "/v/site-packages/torch/distributed/distributed_c10d.py", line 2501, in all_reduce
                work.wait()
            (C) File "???", line 0, in pthread_cond_wait (libc.so.6)

        Traceback for thread 113 (python3) [Garbage collecting] (most recent call last):
            (Python) File "/job/cb.py", line 3, in on_step
    ''')
    (proc,) = parse_stack_text(text)
    first, second = proc.threads
    assert (first.thread_id, first.thread_name, first.gil) == ("112", "python3", True)
    assert first.frames[0] == Frame("pthread_cond_wait", "libc.so.6", None)
    assert first.frames[1].function == "all_reduce"
    assert second.frames[0] == Frame("<gc>", "gc")


def test_gdb_py_bt_both_styles():
    old = dedent('''
        Thread 1 (Thread 0x7f384e2dc740 (LWP 237)):
        (gdb) py-bt
        #4 Frame 0x7f3484000910, for file /lib/python2.7/threading.py, line 358, in wait (self=<_Condition at remote 0x7f36>, timeout=<float at remote 0x811eca8>)
        #7 Frame 0x7f3484000a10, for file /job/train.py, line 20, in step (batch=None)
    ''')
    (proc,) = parse_stack_text(old)
    (thread,) = proc.threads
    assert thread.thread_id == "237"
    assert [(f.function, f.line) for f in thread.frames] == [("wait", 358), ("step", 20)]

    new = dedent('''
        (gdb) py-bt
        Traceback (most recent call first):
          File "/usr/lib/python3.10/threading.py", line 320, in wait
            waiter.acquire()
          File "/job/train.py", line 20, in step
            q.get()
    ''')
    (proc,) = parse_stack_text(new)
    assert [f.function for f in proc.threads[0].frames] == ["wait", "step"]


def test_gdb_native_bt_with_continuation_lines():
    text = dedent('''
        Thread 29 (Thread 0x2aab3b40b480 (LWP 17290)):
        #0  0x00002aaaaacd86d5 in pthread_cond_wait@@GLIBC_2.3.2 () from /usr/lib64/libpthread.so.0
        #1  0x00002aaab055bce9 in __kmp_suspend_64 ()
           from /opt/lib/libiomp5.so
        #2  0x000014cdb53ae194 in cudaStreamSynchronize () from /opt/cuda/lib64/libcudart.so.11.0
        #3  _PyEval_EvalFrameDefault (tstate=<optimized out>, f=<optimized out>) at ../Python/ceval.c:3487
    ''')
    (proc,) = parse_stack_text(text)
    frames = proc.threads[0].frames
    assert frames[0] == Frame("pthread_cond_wait@@GLIBC_2.3.2", "/usr/lib64/libpthread.so.0")
    assert frames[1] == Frame("__kmp_suspend_64", "/opt/lib/libiomp5.so")
    assert frames[2].function == "cudaStreamSynchronize"
    assert frames[3] == Frame("_PyEval_EvalFrameDefault", "../Python/ceval.c", 3487)


def test_c10_cpp_frames_and_rank_prefixes():
    text = dedent('''
        [rank3]: frame #0: c10d::ProcessGroupNCCL::allreduce_impl(at::Tensor&) + 0x10 (0x7f8a in /v/torch/lib/libtorch_cuda.so)
        [rank3]: frame #1: <unknown function> + 0x5cb428e (0x7f8a in /v/torch/lib/libtorch_cpu.so)
        [rank5]: Traceback (most recent call last):
        [rank5]:   File "/job/train.py", line 9, in <module>
        [rank5]:     barrier()
        [rank5]: KeyboardInterrupt
    ''')
    procs = parse_stack_text(text)
    assert [p.rank for p in procs] == [3, 5]
    assert procs[0].threads[0].frames[0] == Frame("c10d::ProcessGroupNCCL::allreduce_impl(at::Tensor&)",
                                                  "/v/torch/lib/libtorch_cuda.so")
    assert procs[1].threads[0].exception == "KeyboardInterrupt"


@pytest.mark.parametrize("line, rank, rest", [
    ("[rank3]:  File \"a.py\", line 1 in f", 3, ' File "a.py", line 1 in f'),
    # torchrun tees a rank's output that already carries torch's prefix (pytorch/torchtitan#3065).
    ("[rank0]:[rank0]:   File \"a.py\", line 1 in f", 0, '  File "a.py", line 1 in f'),
    ("[default1]:[rank1]: Current thread 0x1 (most recent call first):", 1,
     "Current thread 0x1 (most recent call first):"),
    ("18:11:06.680 [rank4]:[E205 18:11:06] x", 4, "[E205 18:11:06] x"),
    ("2024-02-09 09:09:15,164 [rank2]: Thread 0x1 (most recent call first):", 2,
     "Thread 0x1 (most recent call first):"),
    ("node-7: [rank5]:     all_reduce (torch/distributed/distributed_c10d.py:2501)", 5,
     "    all_reduce (torch/distributed/distributed_c10d.py:2501)"),
    ("[worker0]:    f (a.py:1)", None, "   f (a.py:1)"),
    ("    f (a.py:1)", None, "    f (a.py:1)"),
    ("12:00:00 not a prefix", None, "12:00:00 not a prefix"),
    ("RuntimeError: [1] is setting up NCCL communicator", None, "RuntimeError: [1] is setting up NCCL communicator"),
    ("12:00:00 [E ProcessGroupNCCL.cpp:1] x", None, "12:00:00 [E ProcessGroupNCCL.cpp:1] x"),
    ("[rank1]:[titan] 2026-05-07 04:08:47,135 - root - INFO - x", 1,
     "[titan] 2026-05-07 04:08:47,135 - root - INFO - x"),
])
def test_launcher_line_prefixes_are_stripped_and_name_the_rank(line, rank, rest):
    assert strip_line_prefixes(line) == (rank, rest)


def test_faulthandler_dump_with_doubled_rank_prefixes():
    text = dedent('''
        [rank3]:[rank3]:Current thread 0x00007f12c2a4e740 (most recent call first):
        [rank3]:[rank3]:  File "/v/torch/distributed/distributed_c10d.py", line 4778 in scatter
        [rank3]:[rank3]:  File "/v/torch/distributed/checkpoint/utils.py", line 162 in scatter_object
        [rank3]:[rank3]:  File "/v/torch/distributed/checkpoint/state_dict_loader.py", line 183 in load
    ''')
    (proc,) = parse_stack_text(text)
    assert proc.rank == 3
    assert [f.function for f in proc.threads[0].frames] == ["scatter", "scatter_object", "load"]


def test_gdb_threads_join_the_pyspy_process_of_the_same_os_thread():
    text = dedent('''
        Thread 1 (Thread 0x7f00 (LWP 4242) "python"):
        #0  0x00007f1 in ?? () from /lib/x86_64-linux-gnu/libcuda.so.1
        #1  0x00007f2 in cuStreamSynchronize () from /lib/x86_64-linux-gnu/libcuda.so.1
        Process 4242: python train.py
        Thread 4242 (active): "MainThread"
            train_step (train.py:50)
        Thread 4300 (idle): "Thread-1"
            wait (threading.py:320)
    ''')
    (proc,) = parse_stack_text(text)
    assert proc.pid == 4242
    assert [t.thread_id for t in proc.threads] == ["4242", "4300", "4242"]
    (finding,) = stack_findings(text)
    assert (finding["category"], finding["evidence"]) == (
        "cuda_sync", "cuStreamSynchronize (/lib/x86_64-linux-gnu/libcuda.so.1)")


def test_gdb_process_sharing_no_thread_stays_its_own():
    text = dedent('''
        Thread 1 (Thread 0x7f00 (LWP 1) "python"):
        #0  0x00007f1 in poll () from /lib/x86_64-linux-gnu/libc.so.6
        Process 4242: python train.py
        Thread 4242 (active): "MainThread"
            train_step (train.py:50)
    ''')
    assert [p.pid for p in parse_stack_text(text)] == [None, 4242]


def test_source_lines_and_fences_are_skipped():
    text = "# source: https://example.org/issue/1\n```\nThread 9 (idle): \"MainThread\"\n    f (a.py:1)\n```\n"
    (proc,) = parse_stack_text(text)
    assert proc.threads[0].frames == (Frame("f", "a.py", 1),)


@pytest.mark.parametrize("junk", [
    "", "\n\n", "hello world", "Thread", "Process x: y", "#", "#1", "frame #", "File \"", "[rank", "[rankX]: a",
    "Traceback (most recent call last):", "Thread 0x (most recent call first):", "{", "[1, 2",
    "\x00\x01\x02", "    (Python) File", "\ufeffThread 1 (idle)", "a (b) (c)\n   x (y:z)",
    "Traceback for thread 1 (most recent call last):\n    (C) File \"?\", line x, in f",
    "[rank1]:[rank1]:", "[rank99999999999999999999]: x", "1:2:3 [", "a: [rank1]", "[]:[]:[]:",
    "Thread 1 (Thread 0x1 (LWP 7)):\n#0 ?? ()\nThread 7 (idle)\n", "Thread 1 (x):\nThread 1 (y):",
])
def test_parse_stack_text_never_raises_on_junk(junk):
    assert isinstance(parse_stack_text(junk), list)


def test_short_path():
    assert short_path("/x/lib/python3.11/site-packages/torch/a.py") == "torch/a.py"
    assert short_path("/usr/lib/python3.11/threading.py") == "threading.py"
    assert short_path("train.py") == "train.py"


# --- signatures ------------------------------------------------------------------------

def _thread(*frames, name="MainThread", active=None):
    return ThreadStack("1", name, tuple(Frame(*f) for f in frames), active)


def test_signature_ignores_lines_addresses_prefixes_and_qualified_names():
    a = _thread(("0x7f00", "libc.so.6"),
                ("all_reduce", "/v/site-packages/torch/distributed/distributed_c10d.py", 2501),
                ("Trainer.step", "/home/u/job/train.py", 41))
    b = _thread(("all_reduce", "torch/distributed/distributed_c10d.py", 2600), ("step", "train.py", 44))
    assert signature(a) == signature(b) == (("all_reduce", "distributed_c10d.py"), ("step", "train.py"))


def test_signature_collapses_launcher_frames():
    torchrun = _thread(("step", "train.py", 1), ("main", "train.py", 9), ("<module>", "train.py", 12),
                       ("_run_code", "runpy.py", 86), ("_run_module_as_main", "runpy.py", 196))
    spawned = _thread(("step", "train.py", 1), ("main", "train.py", 9), ("<module>", "train.py", 12),
                      ("_wrap", "torch/multiprocessing/spawn.py", 69),
                      ("run", "multiprocessing/process.py", 108))
    assert signature(torchrun) == signature(spawned)
    assert signature(torchrun)[-1] == ("<module>", "train.py")


# --- grouping ---------------------------------------------------------------------------

IN_ALL_REDUCE = (("all_reduce", "torch/distributed/distributed_c10d.py", 2501), ("step", "train.py", 40))
IN_DATALOADER = (("_try_get_data", "torch/utils/data/dataloader.py", 1310),
                 ("__next__", "torch/utils/data/dataloader.py", 741), ("step", "train.py", 38))


def _proc(rank, *threads, error=None):
    return ProcessStack(1000 + rank, rank, "python train.py", tuple(threads), error)


def test_group_stacks_largest_first_and_odd_one_out():
    stacks = {r: _proc(r, _thread(*IN_ALL_REDUCE)) for r in (0, 1, 2, 4, 5)}
    stacks[3] = _proc(3, _thread(*IN_DATALOADER))
    groups = group_stacks(stacks)
    assert [(g.ranks, g.category, g.pattern_id) for g in groups] == [
        ((0, 1, 2, 4, 5), "collective_wait", "collective-wait"),
        ((3,), "dataloader", "dataloader-stall"),
    ]
    assert groups[0].frames[0] == "all_reduce (torch/distributed/distributed_c10d.py:2501)"
    assert groups[0].op == "all_reduce" and groups[0].thread == "MainThread"
    assert groups[1].evidence == "_try_get_data (torch/utils/data/dataloader.py:1310)"
    assert odd_one_out(groups).ranks == (3,)


def test_group_stacks_ignores_line_numbers_between_ranks():
    moved = (("all_reduce", "torch/distributed/distributed_c10d.py", 2999), ("step", "train.py", 77))
    groups = group_stacks({0: _proc(0, _thread(*IN_ALL_REDUCE)), 1: _proc(1, _thread(*moved))})
    assert [g.ranks for g in groups] == [(0, 1)]


def test_interesting_thread_is_chosen_across_all_threads():
    idle_main = _thread(("wait", "threading.py", 320), ("join", "threading.py", 1100),
                        name="MainThread", active=False)
    busy_helper = _thread(("print_stats", "monitor.py", 5), name="stats", active=True)
    comm_worker = _thread(("all_gather_into_tensor", "torch/distributed/distributed_c10d.py", 2709),
                          ("prefetch", "deepspeed/runtime/zero/stage3.py", 10), name=None, active=True)
    stacks = {0: _proc(0, idle_main, busy_helper, comm_worker),
              1: _proc(1, _thread(("all_gather_into_tensor", "torch/distributed/distributed_c10d.py", 2709),
                                  ("prefetch", "deepspeed/runtime/zero/stage3.py", 11), name="MainThread"))}
    (group,) = group_stacks(stacks)
    assert group.ranks == (0, 1) and group.category == "collective_wait"
    assert group.op == "all_gather_into_tensor"


def test_idle_unmatched_threads_rank_below_busy_ones():
    idle_main = _thread(("select", "selectors.py", 415), name="MainThread", active=False)
    busy = _thread(("compute", "model_utils.py", 3), name="worker", active=True)
    (group,) = group_stacks({0: _proc(0, idle_main, busy)})
    assert group.thread == "worker" and group.pattern_id == "compute-spin"


def test_unsampled_processes_form_their_own_groups():
    stacks = {r: _proc(r, _thread(*IN_ALL_REDUCE)) for r in range(3)}
    stacks[3] = _proc(3, error="py-spy: Permission denied (os error 13)")
    stacks[4] = _proc(4, error="py-spy: Permission denied (os error 13)")
    stacks[5] = _proc(5, error="process 1005 no longer exists")
    groups = group_stacks(stacks)
    assert [(g.ranks, g.category, g.error) for g in groups] == [
        ((0, 1, 2), "collective_wait", None),
        ((3, 4), "other", "py-spy: Permission denied (os error 13)"),
        ((5,), "other", "process 1005 no longer exists"),
    ]
    assert groups[1].frames == () and groups[1].pattern_id is None


def test_group_stacks_of_nothing_and_of_frameless_processes():
    assert group_stacks({}) == []
    (group,) = group_stacks({7: _proc(7)})
    assert (group.ranks, group.category, group.frames, group.thread) == ((7,), "other", (), None)


def _group(*ranks):
    return StackGroup(tuple(ranks), (), "collective_wait", None, None)


@pytest.mark.parametrize("sizes, expected", [
    ([[0, 1, 2, 3, 4, 5, 6], [7]], (7,)),
    ([[0, 1, 2, 3, 4, 5], [6], [7]], (6,)),          # several stragglers: lowest key, deterministic
    ([[0, 1, 2, 3, 4], [5, 6], [7]], (7,)),          # the smallest of the rest
    ([[0, 1, 2, 3], [4, 5, 6, 7]], None),            # no majority
    ([[0, 1], [2], [3]], None),                      # largest holds exactly half
    ([[0, 1, 2, 3]], None),                          # nothing stands out
    ([], None),
])
def test_odd_one_out(sizes, expected):
    result = odd_one_out([_group(*s) for s in sizes])
    assert (result.ranks if result else None) == expected


# --- explain ------------------------------------------------------------------------------

def test_stack_findings_shape_for_a_multi_process_dump():
    findings = stack_findings(PYSPY_TWO_PROCESSES)
    assert all(set(f) == FINDING_KEYS for f in findings)
    by_category = {f["category"]: f for f in findings}
    assert set(by_category) == {"collective_wait", "dataloader"}
    coll = by_category["collective_wait"]
    assert coll["op"] == "all_reduce" and coll["severity"] == "high" and coll["runbook"] == "collective-wait"
    assert coll["rank"] is None and coll["ranks"] == [1234]  # no ranks in the text: pids
    assert coll["xid"] is None and coll["pci"] is None and coll["seq"] is None and coll["timeout_ms"] is None
    assert by_category["dataloader"]["evidence"] == "__next__ (torch/utils/data/dataloader.py:708)"
    assert by_category["dataloader"]["severity"] == "medium"


def test_stack_findings_one_finding_per_category_with_ranks():
    lines = []
    for rank in range(4):
        lines += [f"[rank{rank}]: Traceback (most recent call first):",
                  f'[rank{rank}]:   File "/v/torch/distributed/distributed_c10d.py", line {2500 + rank}, in all_reduce',
                  f'[rank{rank}]:   File "/job/train.py", line 40, in step']
    findings = stack_findings("\n".join(lines))
    (finding,) = findings
    assert finding["ranks"] == [0, 1, 2, 3] and finding["rank"] is None
    single = stack_findings("\n".join(lines[:3]))
    assert single[0]["rank"] == 0 and single[0]["ranks"] == [0]


def test_stack_findings_single_unnamed_process_and_no_match():
    findings = stack_findings('Thread 7 (idle): "MainThread"\n    select (selectors.py:415)\n')
    assert findings == [{"kind": "stack", "category": "other", "op": None, "xid": None, "pci": None,
                         "seq": None, "timeout_ms": None, "rank": None, "ranks": None, "severity": "info",
                         "runbook": "hang", "evidence": "select (selectors.py:415)"}]
    assert stack_findings("") == []
    crash = stack_findings('Traceback (most recent call last):\n  File "t.py", line 3, in main\nValueError: x\n')
    assert (crash[0]["category"], crash[0]["runbook"]) == ("other", "crash")
    assert stack_findings("no stacks in here\n") == []


# --- golden corpus: real stack texts from public issue threads -------------------------------

GOLDEN = sorted(FIXTURES.glob("stack-*.txt"))
# The corpus's held-out and retired parts are scored only by benchmarks/explain_accuracy.py.
GOLDEN_DEV = [p for p in GOLDEN
              if json.loads((p.parent / (p.stem + ".expected.json")).read_text())["meta"]["split"] == "dev"]


def test_golden_corpus_is_large_and_sourced():
    assert len(GOLDEN) >= 15
    for path in GOLDEN:
        assert path.read_text().startswith("# source: https://"), path.name
        assert (path.parent / (path.stem + ".expected.json")).exists(), path.name


@pytest.mark.parametrize("path", GOLDEN_DEV, ids=lambda p: p.stem)
def test_golden_stack(path):
    expected = json.loads((path.parent / (path.stem + ".expected.json")).read_text())["findings"]
    produced = stack_findings(path.read_text())
    assert all(set(f) == FINDING_KEYS for f in produced)
    for want in expected:
        assert any(all(got.get(k) == v for k, v in want.items()) for got in produced), (
            f"{path.name}: no finding matches {want}; got {produced}")


def test_diagnose_captures_are_pruned(tmp_path):
    from trainwatch.capture import KEEP_CAPTURES, capture_dir

    for _ in range(12):
        capture_dir(tmp_path, "diagnose").mkdir(parents=True)
    incident = capture_dir(tmp_path, "hang")
    incident.mkdir(parents=True)
    kept = [p for p in (tmp_path / "stacks").iterdir() if "-diagnose-" in p.name]
    assert len(kept) == KEEP_CAPTURES["diagnose"] - 1 or len(kept) == KEEP_CAPTURES["diagnose"]
    assert incident.exists()


def test_stopped_process_is_its_own_stack_group():
    groups = group_stacks({1: ProcessStack(11, 1, None, (), error=f"{STOPPED_ERROR} (state T)"),
                           0: ProcessStack(10, 0, None, (), error="py-spy timed out")})
    assert {g.category for g in groups} == {"stopped", "other"}
