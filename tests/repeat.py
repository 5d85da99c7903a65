"""Find flaky tests before CI does: run the suite several times and report
every test that did not pass every time.

    python tests/repeat.py --runs 3            # the end-to-end tests (-m slow), 3 runs
    python tests/repeat.py --runs 3 --all      # every test
    make test-repeat N=3

Run 1 keeps the usual order; later runs shuffle modules and the tests within
them (`--shuffle SEED`, printed, so an order can be replayed); the last run has
a CPU hog beside it (one busy process per core, `--no-hog` to skip), as a
loaded CI machine would. Each run writes a JUnit XML file; the report lists,
per test, how often it passed, failed or errored. Exit 1 when any test did
not pass every time it ran.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import random
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def cpu_hog(enabled: bool):
    procs = []
    if enabled:
        for _ in range(os.cpu_count() or 1):
            p = multiprocessing.Process(target=_spin, daemon=True)
            p.start()
            procs.append(p)
    try:
        yield len(procs)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join(timeout=10)


def outcomes(junit: Path) -> dict[str, str]:
    """{test id: passed|failed|error|skipped} from a pytest JUnit XML file."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag for child in case}
        out[name] = ("failed" if "failure" in kinds else "error" if "error" in kinds
                     else "skipped" if "skipped" in kinds else "passed")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="how many runs (default 3)")
    ap.add_argument("--all", action="store_true", help="every test, not only the end-to-end (slow) ones")
    ap.add_argument("--no-hog", action="store_true", help="no CPU hog beside the last run")
    ap.add_argument("--seed", type=int, default=None, help="seed of the first shuffled order (default: random)")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be 1 or more")
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    results: dict[str, Counter] = defaultdict(Counter)
    with tempfile.TemporaryDirectory(prefix="tw-repeat-") as tmp:
        for i in range(args.runs):
            shuffle = [] if i == 0 else ["--shuffle", str(seed + i)]
            hog = not args.no_hog and args.runs > 1 and i == args.runs - 1
            junit = Path(tmp) / f"run{i}.xml"
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                   *([] if args.all else ["-m", "slow"]), *shuffle, *args.pytest_args]
            t0 = time.monotonic()
            with cpu_hog(hog) as hogs:
                print(f"run {i + 1}/{args.runs}: {' '.join(shuffle) or 'usual order'}"
                      f"{f', beside a CPU hog of {hogs} processes' if hogs else ''}", flush=True)
                code = subprocess.run(cmd, cwd=ROOT).returncode
            print(f"run {i + 1}: exit {code} in {time.monotonic() - t0:.0f} s", flush=True)
            if not junit.exists():
                print(f"run {i + 1} wrote no report (pytest exit {code})", file=sys.stderr)
                return 2
            for name, outcome in outcomes(junit).items():
                results[name][outcome] += 1
    flaky = {n: c for n, c in results.items() if c["failed"] or c["error"]}
    print(f"\n{len(results)} tests, {args.runs} runs, first shuffle seed {seed + 1}")
    if not flaky:
        print("every test passed every time it ran")
        return 0
    print(f"{len(flaky)} tests did not pass every time:")
    for name, c in sorted(flaky.items()):
        print(f"  {name}: passed {c['passed']}, failed {c['failed']}, error {c['error']}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
