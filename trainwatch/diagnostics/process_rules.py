"""Log rules for processes and data loaders: launchers reporting a worker that died (torchelastic,
mp.spawn, DeepSpeed, Paddle, srun, mpirun) and DataLoader workers that were killed or timed out.
Appended to log_rules.RULES, after every other rule."""

from __future__ import annotations

import re

from trainwatch.diagnostics.line_rule import LineRule, nothing as _nothing, rank_list as _rank_list, words as _words
from trainwatch.diagnostics.process_facts import (
    bus_error,
    dataloader_facts,
    elastic_failed,
    elastic_squashed,
    launcher_exit,
    mpi_signalled,
    signal_died,
    spawn_exited,
    task_signalled,
)

PROCESS_RULES: tuple[LineRule, ...] = (
    # -- processes -------------------------------------------------------------------
    LineRule("elastic-failed", "exitcode", "child_failed", re.compile(
        r"failed\s*\(exitcode:\s*(?P<exit>-?\d+)\)\s*local_rank:\s*(?P<local>\d+)\s*\(pid:\s*(?P<pid>\d+)\)"),
        elastic_failed),
    # torchelastic before torch 1.10: "Child process 17057 (local_rank 0) FAILED (exitcode 1)".
    LineRule("elastic-child-failed-old", "child process", "child_failed", re.compile(
        r"Child\s*process\s*(?P<pid>\d{1,12})\s*\(local_rank\s*(?P<local>\d{1,9})\)\s*FAILED\s*\(exitcode\s*(?P<exit>-?\d{1,4})\)"),
        lambda m: {"pid": int(m.group("pid")), "local_rank": int(m.group("local")), "exit_code": int(m.group("exit"))}),
    # DeepSpeed's launcher: "[launch.py:320:sigkill_handler] ['python', ...] exits with return code = -9".
    LineRule("deepspeed-launcher-exit", "return code", "child_failed", re.compile(
        r"\]\s*exits\s*with\s*return\s*code\s*=\s*(?P<exit>-?\d{1,4})"), launcher_exit),
    # ... and its signal handler stopping every worker after one failed:
    # "[launch.py:315:sigkill_handler] Killing subprocess 2432905".
    LineRule("deepspeed-launcher-kill", "killing subprocess", "child_failed", re.compile(
        r"sigkill_handler\]\s*Killing\s*subprocess\s*(?P<pid>\d{1,12})"), lambda m: {"pid": int(m.group("pid"))}),
    # A ChildFailedError summary whose line breaks were lost in the paste:
    # "rank2 (local rank: 2)exitcode: -9 (pid: 36071)error file: <N/A>".
    LineRule("elastic-summary-squashed", "exitcode", "child_failed", re.compile(
        r"(?i)\brank\s*:?\s*(?P<rank>\d{1,9})\s*\(local[_ ]rank:\s*(?P<local>\d{1,9})\)\s*"
        r"exitcode\s*:\s*(?P<exit>-?\d{1,12})\s*\(pid:\s*(?P<pid>\d{1,12})\)"), elastic_squashed),
    LineRule("spawn-exited", "terminated", "child_failed", re.compile(
        r"\bprocess\s*(?P<local>\d{1,6})\s*terminated\s*with\s*(?:signal\s*(?P<sig>SIG[A-Z]{2,6})"
        r"|exit\s*code\s*(?P<exit>-?\d{1,4}))"), spawn_exited),
    # mp.spawn re-raising a worker's exception; the pre-elastic launcher (torch.distributed.launch)
    # on a worker that exited non-zero; Horovod after one rank failed.
    LineRule("spawn-raised", "raisedexception", "child_failed", re.compile(r"\bProcessRaisedException\b"), _nothing),
    LineRule("launch-called-process", "non-zero exit status", "child_failed", re.compile(
        r"CalledProcessError:\s*Command\s*'\[.{0,600}?local[_-]rank.{0,600}?\]'\s*returned\s*non-zero\s*exit\s*status"
        r"\s*(?P<exit>-?\d{1,4})"), lambda m: {"exit_code": int(m.group("exit"))}),
    LineRule("horovod-shut-down", "horovod has been shut down", "child_failed", re.compile(
        _words("Horovod has been shut down. This was caused by an exception on one of the ranks")), _nothing),
    # torchelastic's agent after a worker failed, before it restarts the group.
    LineRule("elastic-group-failed", "worker group failed", "child_failed", re.compile(
        r"Worker\s*group\s*FAILED\.\s*(?P<left>\d{1,9})/(?P<max>\d{1,9})\s*attempts\s*left"
        r"|\[\w{1,40}\]\s*Worker\s*group\s*failed\s*$"), _nothing),
    # Horovod's gloo launcher; Lightning's deadlock detector killing the ranks after one failed.
    LineRule("horovod-process-exit", "exit with status code", "child_failed", re.compile(
        r"Process\s*(?P<rank>\d{1,9})\s*exit\s*with\s*status\s*code\s*(?P<exit>-?\d{1,4})"),
        lambda m: {"rank": int(m.group("rank")), "exit_code": int(m.group("exit"))}),
    LineRule("lightning-deadlock", "deadlock detected", "child_failed", re.compile(
        r"DeadlockDetectedException:\s*DeadLock\s*detected\s*from\s*rank:\s*(?P<rank>\d{1,9})"),
        lambda m: {"rank": int(m.group("rank"))}),
    # Ray: an actor or task worker process that died.
    LineRule("ray-worker-died", "died", "child_failed", re.compile(
        r"ActorDiedError|The\s*actor\s*died\s*unexpectedly\s*before\s*finishing\s*this\s*task"
        r"|A\s*worker\s*died\s*or\s*was\s*killed\s*while\s*executing\s*a\s*task"), _nothing),
    # Paddle's launcher: "ABORT!!! Out of all 4 trainers, the trainer process with rank=[1, 2, 3] was aborted."
    LineRule("paddle-trainers-aborted", "abort", "child_failed", re.compile(
        r"Out\s*of\s*all\s*\d{1,9}\s*trainers,\s*the\s*trainer\s*process\s*with\s*rank=\[(?P<ranks>[\d,\s]{1,400})\]"
        r"\s*was\s*aborted"), lambda m: {"ranks": _rank_list(m)}),
    LineRule("subprocess-signalled", "died with", "child_failed", re.compile(
        r"died\s*with\s*<Signals\.(?P<sig>SIG[A-Z]{2,6}):\s*(?P<num>\d{1,3})>"), signal_died),
    LineRule("srun-task-signalled", "srun", "child_failed", re.compile(
        r"srun:\s*error:\s*\S+:\s*tasks?\s*(?P<task>[\d,\-]+):\s*(?P<what>Killed|Segmentation fault|Bus error|Aborted)"),
        task_signalled),
    LineRule("mpirun-signalled", "noticed", "child_failed", re.compile(
        r"noticed\s*that\s*process\s*rank\s*(?P<rank>\d{1,9})\s*with\s*PID\s*(?P<pid>\S{1,20})\s*on\s*node\s*\S+"
        r"\s*exited\s*on\s*signal\s*(?P<num>\d{1,3})"), mpi_signalled),
    # Open MPI's summary when a rank exits non-zero (its PID may be redacted in a paste).
    LineRule("mpirun-nonzero", "non-zero exit code", "child_failed", re.compile(
        r"Primary\s*job\s*terminated\s*normally,\s*but\s*\d{1,9}\s*process(?:es)?\s*returned\s*a?\s*non-zero\s*exit\s*code"),
        _nothing),
    # A data loader's time-out for one batch: torch's "DataLoader timed out after 120 seconds",
    # MXNet Gluon's "Worker timed out after 120 seconds".
    LineRule("dataloader-timeout", "timed out after", "dataloader", re.compile(
        r"(?:DataLoader|Worker)\s*timed\s*out\s*after\s*\d{1,9}\s*seconds"), _nothing),
    LineRule("dataloader-killed", "dataloader", "dataloader_worker_killed", re.compile(
        r"DataLoader\s*worker\s*(?:\(pid(?:\(s\))?\s*(?P<pids>\d[\d,\s]*)\)\s*)?"
        r"(?:is\s*killed\s*by\s*(?:signal|\w{4,8})\s*:\s*(?P<sig>[A-Za-z ]+)|exited\s*unexpectedly"
        r"(?:\s*with\s*exit\s*code\s*(?P<exit>-?\d+))?)"), dataloader_facts),
    LineRule("dataloader-bus-error", "bus", "dataloader_worker_killed", re.compile(
        r"(?i)Unexpected\s*bus\s*error\s*encountered\s*in\s*(?:DataLoader\s*)?worker"), bus_error),
    LineRule("pin-memory-exited", "pin memory thread", "dataloader_worker_killed", re.compile(
        _words("Pin memory thread exited unexpectedly")), _nothing),
    LineRule("dataloader-fds", "no longer possible", "dataloader_worker_killed", re.compile(
        _words("Communication with the workers is no longer possible")), _nothing),
    LineRule("dataloader-worker-segv", "encountered in worker", "dataloader_worker_killed", re.compile(
        r"(?i)Unexpected\s*(?:segmentation\s*fault|floating-point\s*exception)\s*encountered\s*in\s*"
        r"(?:DataLoader\s*)?worker"), _nothing),
    # -- start-up waits ---------------------------------------------------------------
    # torch logs this every 10 s a rank waits at init_process_group's store barrier, so a line is
    # a wait of 10 s or more: "Waiting in store based barrier to initialize process group for
    # rank: 2, key: store_based_barrier_key:2 (world_size=8, worker_count=7, timeout=0:30:00)".
    LineRule("store-barrier-wait", "store based barrier", "barrier", re.compile(
        _words("Waiting in store based barrier to initialize process group for rank:") + r"\s*(?P<rank>\d{1,9})"
        r"(?:.{0,120}?world_size=(?P<world>\d{1,9}),\s*(?:worker_count|num_workers_joined)=(?P<joined>\d{1,9}))?"),
        lambda m: {"rank": int(m.group("rank")), "world_size": int(m.group("world")) if m.group("world") else None,
                   "joined": int(m.group("joined")) if m.group("joined") else None}),
    # torch.utils.cpp_extension finding the lock an earlier (perhaps killed) build left behind.
    LineRule("extension-lock-file", "lock file", "compile_lock", re.compile(
        _words("Lock file exists in build directory")), _nothing),
    # Shared memory full while a worker hands a batch over (/dev/shm too small in a container):
    # "unable to write to file </torch_18692_1954506624>: No space left on device (28)".
    LineRule("dataloader-shm", "torch_", "dataloader_worker_killed", re.compile(
        r"unable\s*to\s*(?:write\s*to\s*file|open\s*shared\s*memory\s*object|mmap\s*\d{1,20}\s*bytes\s*from\s*file)"
        r"\s*</torch_\d"), _nothing),
)
