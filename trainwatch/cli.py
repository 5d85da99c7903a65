"""`trainwatch` command line: launch, diagnose, explain, jobs, runbook, report, dashboards."""

from __future__ import annotations

import argparse
import json
import sys
import time

from trainwatch import __version__, state

USAGE = """trainwatch {launch,diagnose,explain,jobs,runbook,report,dashboards} ...

  launch   [torchrun options] [--job NAME] [--inject SPEC]... [SCRIPT | -m MODULE] [ARGS...]
  diagnose JOB [--json]          live verdict for a running job (or the last incident)
  explain  FILE... [--json]      verdicts from logs, py-spy dumps, kernel logs ('-' = stdin)
  jobs     [--json]              list jobs and their status
  runbook  [ID]                  list runbooks, or print one
  report   JOB [--out FILE.html] one self-contained HTML page of the job: loss, step time, incidents
  dashboards [--out DIR] [--check]  write the Grafana dashboards and provisioning files
"""


def _fail(message: str, code: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def cmd_launch(argv: list[str]) -> int:
    from trainwatch.watchdog.launcher import LaunchError, launch

    try:
        return launch(argv)
    except LaunchError as e:
        return _fail(str(e))


def cmd_jobs(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="trainwatch jobs")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    jobs = state.list_jobs()
    if args.json:
        print(json.dumps(jobs, indent=2, default=str))
        return 0
    if not jobs:
        print(f"no jobs under {state.home() / 'jobs'}")
        return 0
    print(f"{'JOB':<36} {'STATUS':<10} {'RANKS':>5} {'RESTARTS':>8}  {'STARTED':<19}  ENTRYPOINT")
    for j in jobs:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.get("start_time", 0)))
        status = state.live_status(j)
        print(
            f"{j.get('job', '?'):<36} {status:<10} {len(j.get('ranks') or []):>5} {j.get('restarts', 0):>8}  "
            f"{started:<19}  {j.get('entrypoint', '')}"
        )
    return 0


def cmd_runbook(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="trainwatch runbook")
    p.add_argument("id", nargs="?")
    args = p.parse_args(argv)
    from trainwatch.diagnostics import runbooks

    if args.id is None:
        for rid, title in runbooks.list_runbooks():
            print(f"{rid:<28} {title}")
        return 0
    try:
        print(runbooks.get_runbook(args.id))
    except ValueError as e:
        return _fail(str(e))
    return 0


def cmd_explain(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="trainwatch explain")
    p.add_argument("files", nargs="+", metavar="FILE", help="log, py-spy dump or kernel log; '-' reads stdin")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from trainwatch.diagnostics import explain

    return explain.main(args.files, args.json)


def cmd_diagnose(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="trainwatch diagnose")
    p.add_argument("job")
    p.add_argument("--json", action="store_true")
    p.add_argument("--native", action="store_true", help="include native frames (slower)")
    p.add_argument("--timeout", type=float, default=8.0, help="overall time budget in seconds")
    args = p.parse_args(argv)
    from trainwatch.diagnostics import diagnose

    return diagnose.main(args.job, as_json=args.json, native=args.native, timeout_s=args.timeout)


def cmd_report(argv: list[str]) -> int:
    from trainwatch import report

    return report.main(argv)


def cmd_dashboards(argv: list[str]) -> int:
    from trainwatch import dashboards

    return dashboards.main(argv)


COMMANDS = {
    "launch": cmd_launch,
    "diagnose": cmd_diagnose,
    "explain": cmd_explain,
    "jobs": cmd_jobs,
    "runbook": cmd_runbook,
    "report": cmd_report,
    "dashboards": cmd_dashboards,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"trainwatch {__version__}")
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        return _fail(f"unknown command {argv[0]!r}; use one of: {', '.join(COMMANDS)}")
    try:
        return command(argv[1:])
    except state.StateError as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
