"""The watchdog's typed config: launch flags generated from it, the JSON the
sidecar reads back, and one-line errors for values that make no sense."""

from __future__ import annotations

import json

import pytest

from trainwatch import flags
from trainwatch.watchdog.config import SidecarConfig, launch_flags
from trainwatch.launcher.options import LaunchError, parse

SCRIPT = "tests/scripts/plain_ddp.py"


def test_every_setting_is_a_flag_with_help():
    options = {f.option: f for f in launch_flags()}
    for expected in ("--hang-floor-s", "--hang-k", "--no-mismatch-live-counts", "--straggler-ratio",
                     "--loss-spike-factor", "--emergency-timeout-s", "--no-restart", "--capture-timeout-s",
                     "--tick-s", "--rearm-s"):
        assert expected in options, expected
        assert options[expected].help, f"{expected} has no help (its field needs a docstring)"


def test_flags_land_in_the_config():
    args, config = parse(["--nproc-per-node", "2", "--hang-floor-s", "2.5", "--no-live-counts",
                          "--emergency-timeout", "3", "--restart-kinds", "hang,xid", SCRIPT])
    side = config.sidecar
    assert side.detectors.hang.floor_s == 2.5
    assert side.detectors.collective_mismatch.live_counts is False
    assert side.actions.emergency_timeout_s == 3.0
    assert side.actions.restart_kinds == frozenset({"hang", "xid"})
    assert side.detectors.straggler.ratio == SidecarConfig().detectors.straggler.ratio  # untouched


def test_config_round_trips_through_json(tmp_path):
    _, config = parse(["--hang-k", "7", "--no-restart", SCRIPT])
    path = tmp_path / "sidecar-config.json"
    config.sidecar.write(path)
    back = SidecarConfig.read(path)
    assert back == config.sidecar
    assert json.loads(path.read_text())["detectors"]["hang"]["k"] == 7.0


def test_a_config_file_of_the_wrong_shape_is_a_clear_error(tmp_path):
    path = tmp_path / "c.json"
    for bad in ('{"detectors": {"hang": {"floor_s": "x"}}}', '{"nope": 1}', "[1, 2]", "{"):
        path.write_text(bad)
        with pytest.raises(ValueError, match="not a trainwatch sidecar config"):
            SidecarConfig.read(path)


@pytest.mark.parametrize("argv, needle", [
    (["--emergency-timeout", "nan"], "--emergency-timeout-s must be a finite number"),
    (["--hang-floor-s", "inf"], "--hang-floor-s must be a finite number"),
    (["--hang-floor-s", "-1"], "--hang-floor-s must be a finite number > 0"),
    (["--hang-history", "many"], "--hang-history must be an integer"),
    (["--hang-history", "0"], "--hang-history must be an integer >= 1"),
    (["--hang-learn-phases", "checkpoint,backward"], "--hang-learn-phases must name phases among"),
    (["--hang-phase-history", "0"], "--hang-phase-history must be an integer >= 1"),
    (["--hang-phase-factor", "-2"], "--hang-phase-factor must be a finite number >= 0"),
    (["--emergency-timeout", "0"], "--emergency-timeout-s must be a finite number > 0"),
    (["--min-severity-restart", "urgent"], "--min-severity-restart must be one of"),
    (["--nnodes", "abc"], "--nnodes must be N or MIN:MAX"),
    (["--inject", "crash:signal=FOO"], "unknown signal 'FOO'"),
    (["--nproc-per-node", "2", "--inject", "hang:rank=5"], "rank=5 but the job has 2 rank(s)"),
    (["--inject", "straggler:delay=inf"], "delay must be a finite number >= 0"),
    (["--inject", "hang:step=-3"], "step must be >= 1"),
    (["--job", ""], "--job must be"),
    (["--job", "name\n"], "--job must be"),
    (["--rdzv-endpoint", ":abc"], "--rdzv-endpoint must be HOST or HOST:PORT"),
    (["--rdzv-endpoint", "10.0.0.1:99999"], "--rdzv-endpoint must be HOST or HOST:PORT"),
    (["--inject", "xid:rank=0,code=-1"], "code must be an Xid number"),
])
def test_bad_values_are_one_line_launch_errors(argv, needle):
    with pytest.raises(LaunchError) as e:
        parse([*argv, SCRIPT])
    assert needle in str(e.value) and "\n" not in str(e.value).strip(), str(e.value)


def test_learnt_hang_threshold_flags():
    options = {f.option: f for f in launch_flags()}
    for expected in ("--hang-phase-factor", "--hang-phase-min-samples", "--hang-learn-phases", "--hang-phase-history"):
        assert options[expected].help, expected
    _, config = parse(["--hang-floor-s", "2", "--hang-phase-factor", "4", "--hang-learn-phases", "checkpoint,eval",
                       SCRIPT])
    hang = config.sidecar.detectors.hang
    assert (hang.floor_s, hang.phase_factor, hang.learn_phases) == (2.0, 4.0, ("checkpoint", "eval"))
    _, config = parse(["--hang-learn-phases", "", SCRIPT])
    assert config.sidecar.detectors.hang.learn_phases == ()
    defaults = SidecarConfig().detectors.hang
    assert defaults.phase_min_samples >= 2 and defaults.phase_factor >= 2  # a cold job is not tightened at once


def test_bool_flags_need_no_value_in_the_prescan():
    from trainwatch.launcher.options import prescan_job

    assert prescan_job(["--no-live-counts", "--no-restart", "--job", "j1", SCRIPT]) == "j1"


def test_flags_from_json_rejects_unknown_types():
    with pytest.raises(ValueError):
        flags.from_json(SidecarConfig, {"tick_s": [1]})
