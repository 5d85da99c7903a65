"""`trainwatch launch --config FILE`: every launch and watchdog option from a
TOML file, TRAINWATCH_* variables over it, flags over both; the effective
configuration printed back; a bad file is one line naming the key."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainwatch import flags
from trainwatch.launcher import configfile
from trainwatch.watchdog.config import launch_flags
from trainwatch.launcher.options import LaunchError, build_parser, parse, prescan_job, prescan_node_scope

from util import ROOT, env_for, trainwatch

SCRIPT = "tests/scripts/plain_ddp.py"
FILE = """
[launch]
nproc_per_node = 4
metrics_port = 9400
max_restarts = 5
training_script = "tests/scripts/plain_ddp.py"
training_script_args = ["--steps", "7"]

[watchdog]
tick_s = 0.2

[watchdog.detectors.hang]
floor_s = 7
k = 4.0

[watchdog.actions]
restart = false
restart_kinds = ["hang", "xid"]
"""


@pytest.fixture
def config_file(tmp_path, monkeypatch):
    for name in list(os.environ):
        if name.startswith(("TRAINWATCH_", "PET_")):
            monkeypatch.delenv(name)
    path = tmp_path / "trainwatch.toml"
    path.write_text(FILE)
    return path


def test_the_file_sets_launch_and_watchdog_options(config_file):
    args, config = parse(["--config", str(config_file)])
    assert (args.nproc_per_node, args.max_restarts, config.metrics_port) == ("4", 5, 9400)
    assert args.training_script == SCRIPT and args.training_script_args == ["--steps", "7"]
    side = config.sidecar
    assert (side.tick_s, side.detectors.hang.floor_s, side.detectors.hang.k) == (0.2, 7.0, 4.0)
    assert side.actions.restart is False and side.actions.restart_kinds == frozenset({"hang", "xid"})


def test_environment_beats_the_file_and_flags_beat_both(config_file, monkeypatch):
    monkeypatch.setenv("TRAINWATCH_CONFIG", str(config_file))  # the file without --config
    monkeypatch.setenv("TRAINWATCH_HANG_FLOOR_S", "8")
    monkeypatch.setenv("TRAINWATCH_HANG_K", "6")
    monkeypatch.setenv("TRAINWATCH_NO_RESTART", "0")  # the switch off: restart again
    monkeypatch.setenv("TRAINWATCH_METRICS_PORT", "9500")
    monkeypatch.setenv("TRAINWATCH_RESTART_KINDS", "ecc")
    args, config = parse(["--hang-k", "3", "--metrics-port", "9600", SCRIPT])
    hang = config.sidecar.detectors.hang
    assert (hang.floor_s, hang.k) == (8.0, 3.0)  # env over file; flag over env
    assert config.metrics_port == 9600
    assert config.sidecar.actions.restart is True
    assert config.sidecar.actions.restart_kinds == frozenset({"ecc"})
    assert config.sidecar.tick_s == 0.2  # the file, where nothing overrides it
    assert args.training_script == SCRIPT and args.training_script_args == []  # the command line's script
    monkeypatch.setenv("TRAINWATCH_NO_RESTART", "yes")
    assert parse([SCRIPT])[1].sidecar.actions.restart is False


def test_torchruns_own_variables_beat_the_file(config_file, monkeypatch):
    monkeypatch.setenv("PET_NPROC_PER_NODE", "2")
    args, _ = parse(["--config", str(config_file)])
    assert args.nproc_per_node == "2"


def test_prescans_read_the_file_without_the_parser(config_file, tmp_path, monkeypatch):
    config_file.write_text('[launch]\njob = "from-file"\nnnodes = "2"\nnode_name = "n7"\n')
    argv = ["--config", str(config_file), SCRIPT]
    assert prescan_job(argv) == "from-file"
    assert prescan_job(["--job", "flag", *argv]) == "flag"
    assert prescan_node_scope(argv) == "n7"
    monkeypatch.setenv("TRAINWATCH_JOB", "a-rank-of-another-job")  # the ranks' variable, not an option
    assert prescan_job(argv) == "from-file"
    assert configfile.Setting(key=("launch", "job"), dest="job", option="--job", kind=str).env is None


def test_print_config_round_trips(config_file, tmp_path):
    r = subprocess.run([sys.executable, "-m", "trainwatch", "launch", "--config", str(config_file),
                        "--hang-k", "9", "--print-config"], env=env_for(tmp_path), cwd=str(ROOT),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "effective.toml"
    out.write_text(r.stdout)
    data = flags.read_toml(str(out))
    assert data["watchdog"]["detectors"]["hang"] == {**data["watchdog"]["detectors"]["hang"], "k": 9.0,
                                                     "floor_s": 7.0}
    assert data["launch"]["metrics_port"] == 9400 and data["watchdog"]["actions"]["restart"] is False
    assert "# --hang-floor-s / TRAINWATCH_HANG_FLOOR_S" in r.stdout
    args, config = parse(["--config", str(out)])
    assert config.sidecar == parse(["--config", str(config_file), "--hang-k", "9"])[1].sidecar
    assert not list((tmp_path / "jobs").glob("*")) if (tmp_path / "jobs").exists() else True  # nothing launched


@pytest.mark.parametrize("text, needle", [
    ("[launch\n", "not valid TOML"),
    ("[launch]\nnproc_per_nod = 2\n", "unknown key 'launch.nproc_per_nod'"),
    ("[watchdog.detectors.hang]\nflor_s = 2\n", "unknown key 'watchdog.detectors.hang.flor_s'"),
    ("[cluster]\nx = 1\n", "unknown table 'cluster'"),
    ("[watchdog.detectors.hang]\nfloor_s = 'soon'\n", "watchdog.detectors.hang.floor_s: --hang-floor-s must be"),
    ("[watchdog.detectors.hang]\nfloor_s = -1\n", "--hang-floor-s must be a finite number > 0"),
    ("[watchdog.actions]\nrestart = 'no'\n", "must be true or false"),
    ("[launch]\nmax_restarts = 2.5\n", "launch.max_restarts: must be an integer"),
    ("[launch]\nmetrics_port = 70000\n", "--metrics-port must be 0..65535"),
    ("[launch]\ninject = 'hang'\n", "must be a list of strings"),
    ("[watchdog.actions]\nmin_severity_restart = 'meh'\n", "--min-severity-restart must be one of"),
])
def test_a_bad_file_is_one_line_naming_the_key(config_file, text, needle):
    config_file.write_text(text)
    with pytest.raises(LaunchError) as e:
        parse(["--config", str(config_file), SCRIPT])
    message = str(e.value)
    assert needle in message and "\n" not in message, message


def test_bad_files_and_variables_exit_2_on_one_line(tmp_path):
    missing = tmp_path / "nope.toml"
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe[launch]")
    cases = [(["--config", str(missing)], {}, "cannot read the config file"),
             (["--config", str(binary)], {}, "not UTF-8"),
             ([], {"TRAINWATCH_HANG_K": "lots"}, "TRAINWATCH_HANG_K='lots': --hang-k must be a number"),
             ([], {"TRAINWATCH_NO_CAPTURE": "maybe"}, "--no-capture is a switch")]
    for argv, extra, needle in cases:
        r = trainwatch(tmp_path, "launch", *argv, "--print-config", SCRIPT, **extra)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], (needle, r.stderr)


def test_switch_flags_say_what_they_turn_off():
    for f in launch_flags():
        if f.option.startswith("--no-"):
            assert f.help.startswith("Do not "), (f.option, f.help)
    helps = {f.option: f.help for f in launch_flags()}
    assert helps["--no-restart"].startswith("Do not restart the job")
    assert helps["--no-capture"].startswith("Do not capture every rank's stacks")


_TABLE = configfile.settings(build_parser(), launch_flags())
_toml_values = st.recursive(st.one_of(st.integers(), st.floats(), st.booleans(), st.text(max_size=5)),
                            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                                st.sampled_from(["launch", "watchdog", "detectors", "hang", "floor_s", "tick_s",
                                                 "nproc_per_node", "inject", "actions", "restart", "x"]),
                                inner, max_size=4), max_leaves=12)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=200) | _toml_values.map(lambda v: flags.to_toml(v if isinstance(v, dict) else
                                                                                {"launch": {"x": v}}).encode()))
def test_any_file_is_settings_or_a_one_line_error(tmp_path, data):
    path = tmp_path / "fuzz.toml"
    path.write_bytes(data)
    try:
        values = configfile.layered_defaults(_TABLE, str(path), environ={})
    except ValueError as e:
        assert "\n" not in str(e) and str(path) in str(e), str(e)
    else:
        assert set(values) <= {s.dest for s in _TABLE}
