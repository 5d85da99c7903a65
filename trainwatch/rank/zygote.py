"""Warm start: a per-node process that imported torch once and forks workers.

    python -u -m trainwatch.rank.zygote --control-fd FD --parent PID [--preload MOD,...] -- SCRIPT ARGS...

(the launcher starts it; nobody types this). A restart's cost is mostly
process start-up and `import torch`, paid again by every new worker. The
zygote pays it once, while training runs, then forks each worker of the next
generation on request: the child sets the worker's environment, working
directory and output, and runs the program through the zero-code bootstrap
exactly as `python -u -m trainwatch.rank.bootstrap ARGS` would.

The control channel is newline-delimited JSON on a socket shared with the
launcher's agent:

    agent  -> {"op": "fork", "id": N, "args": [...], "env": {...}, "cwd": ..., "stdout": PATH|null, "stderr": PATH|null}
    zygote -> {"op": "ready", "pid": P, "preloaded": [...], "import_s": S}
              {"op": "forked", "id": N, "pid": P} | {"op": "forked", "id": N, "error": "..."}
              {"op": "exit", "pid": P, "code": C}      (C as Popen.returncode: -SIG when signalled)

The zygote stays single-threaded (fork from a threaded process can copy a
held lock). It dies with the launcher, and its workers die with it (the
kernel's parent-death signal), so nothing outlives the job.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import selectors
import signal
import socket
import sys
import time

from trainwatch import codec, env, messages, procctl


def _send(sock: socket.socket, msg: object) -> None:
    sock.sendall((json.dumps(codec.encode(msg)) + "\n").encode())


def _preload(names: list[str]) -> list[str]:
    """Import what every worker imports anyway; a module that fails here is
    left to the worker (it imports it itself and reports its own error)."""
    done = []
    for name in names:
        try:
            importlib.import_module(name)
            done.append(name)
        except BaseException:  # noqa: BLE001 - any import-time failure, even SystemExit
            continue
    return done


def _exit_code(status: int) -> int:
    return os.waitstatus_to_exitcode(status)


def cuda_initialized() -> bool:
    """True when torch initialised CUDA in this process: a forked child could not
    use it ("Cannot re-initialize CUDA in forked subprocess"), so no fork then.
    (The launcher starts the zygote with PYTORCH_NVML_BASED_CUDA_CHECK=1, so a
    preloaded package asking `torch.cuda.is_available()` asks NVML, not CUDA.)"""
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a torch without it: nothing was initialised through it
        return False


def serve(sock: socket.socket, preload: list[str]) -> None:
    t0 = time.monotonic()
    preloaded = _preload(preload)
    _send(sock, messages.ZygoteReady(os.getpid(), preloaded, round(time.monotonic() - t0, 3), cuda_initialized()))
    # SIGCHLD wakes the loop through a pipe: exits are reported as they happen.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ, "control")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    buf = b""
    children: set[int] = set()
    while True:
        for key, _ in sel.select(timeout=1.0):
            if key.data == "child":
                os.read(wake_r, 4096)
                continue
            data = sock.recv(1 << 20)
            if not data:  # the agent is gone: the workers go with us (parent-death signal)
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = codec.decode_line(messages.ZYGOTE_MESSAGES, line)
                if isinstance(req, messages.ZygoteFork):
                    pid = _fork(sock, req, (wake_r, wake_w))
                    if pid:
                        children.add(pid)
        while children:  # reap every exited worker, report its code
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            _send(sock, messages.ZygoteExit(pid, _exit_code(status)))


def _fork(sock: socket.socket, req: messages.ZygoteFork, fds: tuple[int, int]) -> int:
    args, environ, cwd, out, err = req.args, req.env, req.cwd, req.stdout, req.stderr
    if not args:
        _send(sock, messages.ZygoteForked(req.id, error="bad request: no command"))
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            sock.close()
            for fd in fds:
                os.close(fd)
            code = _become_worker(args, environ, cwd, out, err)
        finally:
            os._exit(code)
    _send(sock, messages.ZygoteForked(req.id, pid=pid))
    return pid


def _become_worker(args: list[str], environ: dict, cwd: str, out: str | None, err: str | None) -> int:
    """In the forked child: turn into the worker a fresh interpreter would be."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.setsid()  # as torchelastic starts workers: the agent signals the group
    zygote = os.getppid()
    procctl.die_with_parent(signal.SIGKILL, zygote)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    os.environ[env.PARENT_PID] = str(zygote)
    for path, fd in ((out, 1), (err, 2)):
        if path:
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
    _reseed()
    sys.path[0] = cwd
    from trainwatch.rank import bootstrap

    code = 0
    try:
        bootstrap.main(args)
    except SystemExit as e:
        code = _system_exit_code(e)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException as e:  # noqa: BLE001 - printed as the interpreter would, from the program's frames
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        code = 1
    return procctl.finish_interpreter(code)


def _system_exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    print(e.code, file=sys.stderr)
    return 1


def _reseed() -> None:
    """A fresh interpreter seeds `random` (and numpy's legacy global generator)
    from the OS; forked copies would share one stream."""
    import random

    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        try:
            np.random.seed()
        except Exception:  # noqa: BLE001
            pass


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m trainwatch.rank.zygote")
    p.add_argument("--control-fd", type=int, required=True)
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--preload", default="")
    p.add_argument("entry", nargs=argparse.REMAINDER,
                   help="the job's command line, unused: `ps` and `pkill -f` find the zygote and its workers by it")
    args = p.parse_args(argv)
    procctl.die_with_parent(signal.SIGKILL, args.parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent decides when workers stop
    sock = socket.socket(fileno=args.control_fd)
    try:
        serve(sock, [m for m in args.preload.split(",") if m])
    except (BrokenPipeError, ConnectionResetError):
        pass
    # The agent let go: no user code ran here and nothing is left to save, so the
    # preloaded modules (torch among them) are not torn down one by one: that
    # would hold the job's exit back by most of a second.
    os._exit(procctl.finish_interpreter(0))


if __name__ == "__main__":
    main()
