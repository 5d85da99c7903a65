"""`trainwatch` entry point. Every command speaks the same way when given bad
input: one `error: ...` line naming the fix, exit code 2, never a traceback."""

from __future__ import annotations

import os
import sys
import threading

from trainwatch import __version__, state
from trainwatch.usage import Parser, fail

USAGE = """trainwatch {launch,doctor,diagnose,explain,jobs,runbook,report,dashboards} ...

  launch   [torchrun options] [--job NAME] [--inject SPEC]... [SCRIPT | -m MODULE] [ARGS...]
  doctor   [--json] [--nproc-per-node N] [--nnodes N] [--ckpt-dir DIR]
                                 preflight: settings that hang a job, before it starts (exit 1: a check failed)
  diagnose JOB [--json]          live verdict for a running job (or the last incident)
  explain  FILE... [--json]      verdicts from logs, py-spy dumps, kernel logs ('-' = stdin)
  jobs     [--json]              list jobs and their status
  runbook  [ID]                  list runbooks, or print one
  report   JOB [--out FILE.html] one self-contained HTML page of the job: loss, step time, incidents
  dashboards [--out DIR] [--check]  write the monitoring bundle: dashboards, provisioning, Prometheus configs, alert rules
"""


def cmd_launch(argv: list[str]) -> int:
    # Announced first: `diagnose` knows the job while the launcher imports the rest.
    from trainwatch.launcher.prescan import announce, prescan_print_config, start_failure

    announced = None
    try:
        if not prescan_print_config(argv):  # --print-config runs nothing: no launch to announce
            announced = announce(argv)
    except state.StateError as e:
        return fail(str(e))
    except OSError as e:  # a full or read-only home: one line, nothing to undo yet
        return fail(start_failure(e))
    from trainwatch.launcher.launch import LaunchError, launch

    try:
        return launch(argv, announced)
    except LaunchError as e:
        return fail(str(e))


def cmd_doctor(argv: list[str]) -> int:
    from trainwatch.views import doctor
    from trainwatch.launcher.preflight import read_gpus

    gpus, reason = read_gpus()
    return doctor.main(argv, gpus=gpus, gpu_reason=reason)


def cmd_jobs(argv: list[str]) -> int:
    from trainwatch.views import jobs

    return jobs.main(argv)


def cmd_runbook(argv: list[str]) -> int:
    from trainwatch.diagnostics import runbooks

    p = Parser(prog="trainwatch runbook", usage_hint="usage: trainwatch runbook [ID]")
    p.add_argument("id", nargs="?")
    args = p.parse_args(argv)
    if args.id is None:
        for rid, title in runbooks.list_runbooks():
            print(f"{rid:<28} {title}")
        return 0
    try:
        print(runbooks.get_runbook(args.id))
    except ValueError as e:
        return fail(str(e))
    return 0


def cmd_explain(argv: list[str]) -> int:
    from trainwatch.views import explain

    return explain.main(argv)


def cmd_diagnose(argv: list[str]) -> int:
    from trainwatch.views import diagnose

    return diagnose.main(argv)


def cmd_report(argv: list[str]) -> int:
    from trainwatch.views import report

    return report.main(argv)


def cmd_dashboards(argv: list[str]) -> int:
    from trainwatch import dashboards

    return dashboards.main(argv)


# Each command imports its module when run, so `trainwatch jobs` never pays
# for torch and `trainwatch launch` announces the job before importing it.
COMMANDS = {
    "launch": cmd_launch,
    "doctor": cmd_doctor,
    "diagnose": cmd_diagnose,
    "explain": cmd_explain,
    "jobs": cmd_jobs,
    "runbook": cmd_runbook,
    "report": cmd_report,
    "dashboards": cmd_dashboards,
}


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, not at exit: a reader that left is a BrokenPipeError caught below
        return code
    except BrokenPipeError:
        # `trainwatch --help | true`, `trainwatch jobs | head -0`: the reader left; say nothing more.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def entry() -> None:
    """The `trainwatch` command. After `launch` (torch imported, the job's state
    written and closed, only the main thread left) the exit handlers run and
    the process ends at once: tearing torch's modules down one by one would
    hold the job's exit code back by most of a second."""
    code = main()
    if "torch" in sys.modules and threading.active_count() == 1:
        from trainwatch import procctl

        os._exit(procctl.finish_interpreter(code))
    sys.exit(code)


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"trainwatch {__version__}")
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        return fail(f"unknown command {argv[0]!r}; use one of: {', '.join(COMMANDS)}")
    try:
        return command(argv[1:])
    except state.StateError as e:
        return fail(str(e))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
