"""tests/repeat.py, the flaky-test finder behind `make test-repeat`."""

from __future__ import annotations

import subprocess
import sys

from util import ROOT

sys.path.insert(0, str(ROOT / "tests"))
import repeat  # noqa: E402


def test_outcomes_read_every_kind_of_result(tmp_path):
    junit = tmp_path / "r.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="test_ok"/>'
        '<testcase classname="tests.test_a" name="test_bad"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_b" name="test_err"><error message="y"/></testcase>'
        '<testcase classname="tests.test_b" name="test_skip"><skipped message="z"/></testcase>'
        "</testsuite></testsuites>"
    )
    assert repeat.outcomes(junit) == {"tests.test_a::test_ok": "passed", "tests.test_a::test_bad": "failed",
                                      "tests.test_b::test_err": "error", "tests.test_b::test_skip": "skipped"}


def test_repeats_in_shuffled_order_and_reports_every_test_passing():
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "repeat.py"), "--runs", "2", "--no-hog", "--all",
                        "--seed", "7", "tests/test_xid.py"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "run 2/2: --shuffle 8" in r.stdout
    assert "every test passed every time it ran" in r.stdout
