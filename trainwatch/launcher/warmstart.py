"""Warm start, the launcher's side: workers forked from a zygote that has
already imported torch, instead of fresh interpreters that import it again.

torchelastic's agent builds every worker's arguments and environment and hands
them to `start_processes`; for a Python worker routed through the zero-code
bootstrap, `start_processes` is answered here with a `ZygoteContext`, a
`SubprocessContext` whose processes come from the zygote. Everything else is
torchelastic's own: rendezvous, restart budget, the environment per worker,
monitoring (poll, exit codes, failures), log redirects and tee, shutdown
(SIGTERM to the worker's process group, then SIGKILL). Whatever cannot go
through the zygote (a non-Python entrypoint, NUMA binding, a zygote that died)
starts cold, as torchrun would.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from typing import Any

from trainwatch import codec, env, messages

log = logging.getLogger("trainwatch")

BOOTSTRAP = ("-u", "-m", "trainwatch.rank.bootstrap")
ALWAYS = ("torch", "torch.distributed", "torch.nn.parallel", "torch.utils.data", "numpy", "torch._dynamo",
          "trainwatch.rank.bootstrap", "trainwatch.rank.telemetry")
"""Imported by the zygote for every job: what every worker imports anyway. torch._dynamo
(and sympy under it) is what DistributedDataParallel's and FSDP's constructors import
on first use: 1.3 s of every restart on this machine's CPUs."""
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
"""Set in the zygote only: `torch.cuda.is_available()` asks NVML instead of
initialising CUDA, which would make every forked worker unable to use the GPU."""
READY_TIMEOUT_S = 120.0
FORK_TIMEOUT_S = 10.0


class ZygoteUnavailable(Exception):
    pass


class ForkedProcess:
    """The parts of `subprocess.Popen` torchelastic uses, for a worker whose
    parent is the zygote (its exit code arrives over the control channel)."""

    def __init__(self, pid: int, zygote: Zygote):
        self.pid = pid
        self.returncode: int | None = None
        self._zygote = zygote

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._zygote.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0)
        self.returncode = code
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


class ForkedHandler:
    """torchelastic's SubprocessHandler for a forked worker."""

    def __init__(self, proc: ForkedProcess, local_rank: int):
        self.proc = proc
        self.local_rank_id = local_rank

    def close(self, death_sig: signal.Signals | None = None) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, death_sig or signal.SIGTERM)
        except ProcessLookupError:
            pass


class Zygote:
    """The launcher's handle on its zygote process and control channel."""

    def __init__(self, preload: list[str], entry: list[str] = (), job: str | None = None):
        self.preload = list(dict.fromkeys([*ALWAYS, *preload]))
        self.entry = list(entry)
        self.job = job
        """The job's name, in the zygote's own environment: /proc/PID/environ of a
        forked worker is the zygote's, and stacks are only sampled from processes
        whose environment names the job."""
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.ready: messages.ZygoteReady | None = None
        self._cond = threading.Condition()
        self._exits: dict[int, int] = {}
        self._forked: dict[int, messages.ZygoteForked] = {}
        self._next_id = 0
        self._closed = False
        self._send_lock = threading.Lock()

    def start(self) -> None:
        ours, theirs = socket.socketpair()
        self.sock = ours
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "trainwatch.rank.zygote", "--control-fd", str(theirs.fileno()),
             "--parent", str(os.getpid()), "--preload", ",".join(self.preload), "--", *self.entry],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, **({env.JOB: self.job} if self.job else {}), NVML_CHECK: "1"},
        )
        theirs.close()
        threading.Thread(target=self._read, name="trainwatch-zygote", daemon=True).start()

    def _read(self) -> None:
        buf = b""
        sock = self.sock
        while sock is not None:
            try:
                data = sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = codec.decode_line(messages.ZYGOTE_MESSAGES, line)
                with self._cond:
                    if isinstance(msg, messages.ZygoteReady):
                        self.ready = msg
                    elif isinstance(msg, messages.ZygoteForked):
                        self._forked[msg.id] = msg
                    elif isinstance(msg, messages.ZygoteExit):
                        self._exits[msg.pid] = msg.code
                    self._cond.notify_all()
        with self._cond:  # the zygote is gone: its workers died with it (parent-death signal)
            self._closed = True
            self._cond.notify_all()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and not self._closed

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> dict | None:
        with self._cond:
            self._cond.wait_for(lambda: self.ready is not None or self._closed, timeout_s)
            return self.ready

    def fork(self, args: list[str], environ: dict[str, str], stdout: str | None, stderr: str | None) -> int:
        if not self.alive() or self.wait_ready(READY_TIMEOUT_S) is None:
            raise ZygoteUnavailable("the warm-start process is not running")
        if self.ready.cuda_initialized:  # type: ignore[union-attr]
            raise ZygoteUnavailable("CUDA was initialised while preloading the entry's imports; "
                                    "forked workers could not use the GPU")
        with self._cond:
            self._next_id += 1
            rid = self._next_id
        request = messages.ZygoteFork(rid, list(args), dict(environ), os.getcwd(), stdout, stderr)
        try:
            with self._send_lock:
                self.sock.sendall((json.dumps(codec.encode(request)) + "\n").encode())  # type: ignore[union-attr]
        except OSError as e:
            raise ZygoteUnavailable(f"the warm-start process does not answer ({e})") from None
        with self._cond:
            if not self._cond.wait_for(lambda: rid in self._forked or self._closed, FORK_TIMEOUT_S):
                raise ZygoteUnavailable(f"no fork within {FORK_TIMEOUT_S:.0f} s")
            reply = self._forked.pop(rid, None)
        if reply is None or reply.pid is None:
            raise ZygoteUnavailable((reply.error if reply is not None else None) or "the warm-start process exited")
        return reply.pid

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            if pid in self._exits:
                return self._exits[pid]
            return -signal.SIGKILL if self._closed else None

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or self._closed, timeout)
        return self.exit_code(pid)

    def close(self, timeout_s: float = 5.0) -> None:
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()
            self.sock = None
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def entry_imports(script: str, module: bool) -> list[str]:
    """Top-level packages the entry script imports that are installed packages
    (site-packages), not the user's own modules: their import is what the
    zygote can pay once. Nothing of the user's own code runs in the zygote.
    The integrated trainer is trainwatch's own: its modules are preloaded."""
    if module and script.split(".")[:2] == ["trainwatch", "trainer"]:
        return ["trainwatch.trainer.train"]
    try:
        path = importlib.util.find_spec(script).origin if module else script  # type: ignore[union-attr]
        with open(path, "rb") as f:  # type: ignore[arg-type]
            tree = ast.parse(f.read())
    except (ImportError, ValueError, AttributeError, TypeError, OSError, SyntaxError):
        return []
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    out = []
    for name in dict.fromkeys(names):
        try:
            spec = importlib.util.find_spec(name.split(".")[0])
        except (ImportError, ValueError):
            continue
        origin = getattr(spec, "origin", None) or ""
        if spec is not None and any(origin.startswith(r) for r in roots):
            out.append(name)
    return out


# ---- torchelastic's start_processes, answered from the zygote ------------------------------

_current: Zygote | None = None
_original: Any = None
timings: dict[str, float] = {}
"""The last start's timing (fork seconds, warm or cold), for the restart breakdown."""


def install() -> bool:
    """Route LocalElasticAgent's start_processes through `_start_processes`."""
    global _original
    try:
        from torch.distributed.elastic.agent.server import local_elastic_agent as lea
    except ImportError:
        return False
    if _original is None:
        if not callable(getattr(lea, "start_processes", None)):
            return False
        _original = lea.start_processes
        lea.start_processes = _start_processes
    return True


class using:
    """`with using(zygote): agent._start_workers(...)` (None: cold)."""

    def __init__(self, zygote: Zygote | None):
        self.zygote = zygote

    def __enter__(self) -> None:
        global _current
        _current = self.zygote

    def __exit__(self, *exc: object) -> None:
        global _current
        _current = None


def _start_processes(**kwargs: Any) -> Any:
    t0 = time.monotonic()
    zygote, args = _current, kwargs.get("args") or {}
    warm = (zygote is not None and isinstance(kwargs.get("entrypoint"), str) and kwargs.get("numa_options") is None
            and all(tuple(a[:3]) == BOOTSTRAP for a in args.values()))
    if warm:
        try:
            from torch.distributed.elastic.multiprocessing.api import SubprocessContext

            context = ZygoteContext(zygote, SubprocessContext, kwargs)
            try:
                context.start()
            except Exception:
                context.close()
                raise
            timings.update(warm=1.0, start_s=round(time.monotonic() - t0, 4))
            return context
        except ZygoteUnavailable as e:
            print(f"[trainwatch] warm start unavailable ({e}); starting workers cold", flush=True)
    context = _original(**kwargs)
    timings.update(warm=0.0, start_s=round(time.monotonic() - t0, 4))
    return context


def ZygoteContext(zygote: Zygote, base: type, kwargs: dict) -> Any:
    """A SubprocessContext (torchelastic's class, subclassed at run time so this
    module imports no torch) whose processes come from the zygote."""

    class _ZygoteContext(base):  # type: ignore[misc, valid-type]
        def _start(self) -> None:
            handlers = {}
            try:
                for local_rank in range(self.nprocs):
                    environ = {**os.environ, **{k: str(v) for k, v in self.envs[local_rank].items()}}
                    pid = zygote.fork([str(a) for a in self.args[local_rank][3:]], environ,
                                      self.stdouts[local_rank] or None, self.stderrs[local_rank] or None)
                    handlers[local_rank] = ForkedHandler(ForkedProcess(pid, zygote), local_rank)
            finally:
                self.subprocess_handlers = handlers

    return _ZygoteContext(
        name=kwargs["name"], entrypoint=kwargs["entrypoint"], args=kwargs["args"], envs=kwargs["envs"],
        logs_specs=kwargs["logs_specs"], log_line_prefixes=kwargs.get("log_line_prefixes"),
        duplicate_stdout_filters=kwargs.get("duplicate_stdout_filters"),
        duplicate_stderr_filters=kwargs.get("duplicate_stderr_filters"),
    )
