"""Every numeric watchdog setting has its range in one table
(`trainwatch.watchdog.config.RANGES`), checked alike for a flag, a
TRAINWATCH_* variable, the config file and the JSON the sidecar reads; a value
outside it is one line naming the key (`tick_s = 0` would busy-loop the
sidecar)."""

from __future__ import annotations

import json
import os

import pytest

from trainwatch.launcher.options import LaunchError, parse
from trainwatch.watchdog.config import RANGES, SidecarConfig, launch_flags

SCRIPT = "tests/scripts/plain_ddp.py"


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("TRAINWATCH_", "PET_")):
            monkeypatch.delenv(name)


def test_every_numeric_setting_has_its_range_in_the_one_table():
    numeric = {".".join(f.path) for f in launch_flags() if f.kind in (int, float)}
    assert numeric == set(RANGES), (numeric ^ set(RANGES))
    assert all(f.range is RANGES[".".join(f.path)] for f in launch_flags() if f.kind in (int, float))
    SidecarConfig()  # the defaults lie in their ranges


@pytest.mark.parametrize("value", ["0", "-1", "0.001", "1e9"])
def test_tick_s_out_of_range_is_one_line_from_the_flag_the_variable_and_the_file(clean_env, tmp_path, monkeypatch,
                                                                                 value):
    with pytest.raises(LaunchError) as e:
        parse(["--tick-s", value, SCRIPT])
    assert str(e.value) == f"--tick-s must be a finite number >= 0.01 and <= 60; got {value!r}"
    monkeypatch.setenv("TRAINWATCH_TICK_S", value)
    with pytest.raises(LaunchError) as e:
        parse([SCRIPT])
    assert str(e.value).startswith(f"TRAINWATCH_TICK_S={value!r}: --tick-s must be a finite number >= 0.01")
    monkeypatch.delenv("TRAINWATCH_TICK_S")
    path = tmp_path / "c.toml"
    path.write_text(f"[watchdog]\ntick_s = {float(value)!r}\n")
    with pytest.raises(LaunchError) as e:
        parse(["--config", str(path), SCRIPT])
    assert str(e.value).startswith(f"{path}: watchdog.tick_s: --tick-s must be a finite number >= 0.01")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("argv, needle", [
    (["--rearm-s", "0"], "--rearm-s must be a finite number > 0; got '0'"),
    (["--capture-timeout-s", "0"], "--capture-timeout-s must be a finite number > 0"),
    (["--hang-k", "0"], "--hang-k must be a finite number > 0"),
    (["--straggler-arrival-last-fraction", "1.5"], "--straggler-arrival-last-fraction must be a finite number >= 0 "
                                                   "and <= 1; got '1.5'"),
    (["--health-vanishing-frac", "1"], "--health-vanishing-frac must be a finite number > 0 and < 1"),
    (["--trend-points", "3"], "--trend-points must be an integer >= 4; got '3'"),
    (["--step-time-history", "1"], "--step-time-history must be an integer >= 2"),
    (["--snapshot-s", "0"], "--snapshot-s must be a finite number >= 0.1 and <= 3600"),
])
def test_a_setting_out_of_its_range_is_one_line_naming_it(clean_env, argv, needle):
    with pytest.raises(LaunchError) as e:
        parse([*argv, SCRIPT])
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_sidecar_refuses_a_written_config_out_of_range(tmp_path):
    path = tmp_path / "sidecar-config.json"
    data = SidecarConfig().to_json()
    data["tick_s"] = 0
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"not a trainwatch sidecar config \(--tick-s must be"):
        SidecarConfig.read(path)
