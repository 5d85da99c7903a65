"""What `trainwatch launch` reads from its command line before importing
anything heavy (trainwatch.launcher.prescan): the job name and the node's
scope, whatever the order of the options and whichever of them take no value,
the same as the launch parser itself reads them."""

from __future__ import annotations

import pytest

from trainwatch.launcher import prescan
from trainwatch.launcher.options import build_parser

SCRIPT = "tests/scripts/plain_ddp.py"

ORDERS = [
    ["--virtual-local-rank", "--job", "X", SCRIPT],
    ["--job", "X", "--virtual-local-rank", SCRIPT],
    ["--virtual_local_rank", "--job=X", SCRIPT],
    ["--nproc-per-node", "2", "--virtual-local-rank", "--standalone", "--job", "X", SCRIPT, "--job", "theirs"],
    ["--standalone", "--strict", "--insecure-store", "--no-warm-start", "--job", "X", SCRIPT],
    ["--no-restart", "--no-live-counts", "--virtual-local-rank", "--hang-floor-s", "2", "--job", "X", SCRIPT],
    ["--run-path", "--no-python", "--job", "X", SCRIPT],
    ["-m", "--job", "X", "trainwatch.trainer", "--job", "theirs"],
    ["--module", "--virtual-local-rank", "--job", "X", "trainwatch.trainer"],
    ["--virtual-local-rank", "-m", "--job", "X", "trainwatch.trainer"],
    ["-r", "3", "--virtual-local-rank", "--job", "X", SCRIPT],
    ["-r3", "--virtual-local-rank", "--job", "X", SCRIPT],
    ["--metrics-port", "-1", "--virtual-local-rank", "--job", "X", SCRIPT],
    ["--virtual-local-rank", "--print-config", "--job", "X"],
]


@pytest.mark.parametrize("argv", ORDERS, ids=[" ".join(a) for a in ORDERS])
def test_the_job_name_is_read_whatever_the_order(argv):
    assert prescan.prescan_job(argv) == "X"
    assert build_parser().parse_args(argv).job == "X"  # as the launch itself reads it


def test_no_job_given_is_none_not_a_word_of_the_command():
    assert prescan.prescan_job(["--virtual-local-rank", "--standalone", SCRIPT, "--job", "theirs"]) is None
    assert prescan.prescan_job(["--", SCRIPT, "--job", "theirs"]) is None


def test_the_node_scope_is_read_after_a_flag_that_takes_no_value():
    argv = ["--virtual-local-rank", "--nnodes", "2", "--node-name", "n7", "--job", "X", SCRIPT]
    assert prescan.prescan_node_scope(argv) == "n7"
    assert prescan.prescan_node_scope(["--virtual-local-rank", "--nnodes", "1", SCRIPT]) is None
    assert prescan.prescan_print_config(["--virtual-local-rank", "--print-config"])


def test_which_options_take_a_value_is_what_the_launch_parser_says():
    """Every option of the real parser (torch.distributed.run's, trainwatch's and
    the watchdog's generated flags): the prescan reads a value after exactly
    those that take one. A torch upgrade that adds a flag fails here."""
    parser = build_parser()
    wrong = sorted(option for action in parser._actions for option in action.option_strings
                   if prescan.takes_value(option) != (action.nargs != 0))
    assert not wrong, f"prescan.TORCHRUN_FLAGS/TRAINWATCH_FLAGS disagree with the launch parser on {wrong}"
    flags = {option for action in parser._actions if action.nargs == 0 for option in action.option_strings}
    assert prescan.TORCHRUN_FLAGS | prescan.TRAINWATCH_FLAGS <= flags  # none stale either
