"""Recovery that never makes a job worse, piece by piece: non-finite state is
never saved or resumed, failures a restart cannot fix are told apart from
transient ones, injected faults keep their meaning after a restart, and the
port a job will use is checked where the user named it."""

from __future__ import annotations

import json
import math
import os
import runpy
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainwatch import checkpoint, slots, state
from trainwatch.finite import NonFiniteState, nonfinite_tensors
from trainwatch.inject.faults import Armed, armed_faults, fired_before
from trainwatch.inject.spec import encode, parse
from trainwatch.rank.bootstrap import last_line, user_traceback
from trainwatch.rank.emergency import EmergencyCheckpointer
from trainwatch.trainer.config import TrainConfig, UsageError, resolve
from trainwatch.trainer.resume import find_resume, read_nonfinite_marker, write_nonfinite_marker
from trainwatch.views import hostchecks
from trainwatch.launcher import failures
from trainwatch.launcher.options import LaunchError, parse_preempt_signals

HOSTILE = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# ---- non-finite state -----------------------------------------------------------------


def test_nonfinite_tensors_names_the_broken_ones_only():
    state = {"model": {"w": torch.ones(3), "b": torch.tensor([1.0, math.nan])},
             "optimizer": {"state": {0: {"exp_avg": torch.tensor([math.inf])}}},
             "rng": torch.zeros(4, dtype=torch.uint8), "steps": [torch.tensor(1)], "lr": math.nan}
    assert nonfinite_tensors(state) == ["model.b", "optimizer.state.0.exp_avg"]
    assert nonfinite_tensors({"w": torch.ones(2)}) == []


def test_a_nonfinite_state_is_never_written(tmp_path):
    checkpoint.save_checkpoint(tmp_path, 5, {"step": 5, "w": torch.ones(2)})
    with pytest.raises(NonFiniteState, match="step-00000010 not written: .*NaN or inf in w"):
        checkpoint.save_checkpoint(tmp_path, 10, {"step": 10, "w": torch.tensor([1.0, math.nan])})
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000005"]  # nothing half-written, nothing deleted
    assert checkpoint.find_latest(tmp_path).step == 5


def _trainer_state(step: int, poison: bool = False) -> dict:
    from trainwatch.trainer.config import MODEL_PRESETS
    from trainwatch.trainer.model import GPT
    from trainwatch.trainer.train import _optimizer

    torch.manual_seed(0)
    model = GPT(MODEL_PRESETS["tiny"])
    if poison:
        with torch.no_grad():
            next(model.parameters()).fill_(math.nan)
    return {"step": step, "model": model.state_dict(),
            "optimizer": _optimizer(model, resolve(TrainConfig(model_size="tiny")), torch.device("cpu")).state_dict()}


def test_resume_skips_nonfinite_checkpoints_and_rolls_back_before_the_marker(tmp_path):
    cfg = resolve(TrainConfig(model_size="tiny", ckpt_dir=str(tmp_path)))
    for step in (10, 20):
        checkpoint.save_checkpoint(tmp_path, step, _trainer_state(step))
    checkpoint.save_checkpoint(tmp_path, 30, _trainer_state(30, poison=True), allow_nonfinite=True)  # an older release's
    assert find_resume(cfg, rank=1).step == 20  # the NaN one is skipped
    write_nonfinite_marker(str(tmp_path), 15, "loss nan")
    resume = find_resume(cfg, rank=1)
    assert (resume.step, resume.rollback) == (10, 15)
    assert set(resume.available) == {10}


@HOSTILE
@given(raw=st.binary(max_size=200) | st.text(max_size=100).map(str.encode))
def test_a_nonfinite_marker_of_any_bytes_is_a_step_or_ignored(tmp_path, raw):
    (tmp_path / "nonfinite.json").write_bytes(raw)
    step = read_nonfinite_marker(str(tmp_path))
    assert step is None or (isinstance(step, int) and step >= 1)


def test_nan_flags_are_checked():
    assert resolve(TrainConfig(), environ={"TRAINWATCH_NAN_POLICY": "alert"}).nan_policy == "alert"
    assert resolve(TrainConfig(), environ={}).nan_policy == "fail"
    for bad in (TrainConfig(nan_policy="ignore"), TrainConfig(nan_skip_batches=-1), TrainConfig(nan_lr_factor=0.0),
                TrainConfig(nan_lr_factor=2.0)):
        with pytest.raises(UsageError, match="--nan-"):
            resolve(bad, environ={})


class _Rank:
    """What the emergency checkpointer reads of the telemetry handle."""

    rank = 0
    nonfinite_step = 0

    def fault_point(self, where: str) -> None:
        pass


def test_emergency_checkpoints_keep_the_last_finite_state(tmp_path, capsys):
    tw, weights = _Rank(), {"w": torch.ones(2)}
    em = EmergencyCheckpointer(tw, str(tmp_path), lambda: {"w": weights["w"].clone()})
    em.stage(1)
    em.stage(2)
    tw.nonfinite_step = 3  # this step's loss was NaN: its state is not staged
    weights["w"] = torch.full((2,), math.nan)
    em.stage(3)
    assert em.staged_step == 2
    # Weights poisoned by a step whose own loss was still finite: the older buffer is written.
    em.stage(4)
    assert em.staged_step == 4
    path = em.write("test")
    assert path is not None and path.endswith("step-00000002-emergency-r0")
    assert "saving step 2 instead" in capsys.readouterr().out
    # Both buffers poisoned: nothing is written.
    em2 = EmergencyCheckpointer(tw, str(tmp_path / "b"), lambda: {"w": weights["w"].clone()})
    em2.stage(7)
    em2.stage(8)
    assert em2.write("test") is None and em2.refused_step == 8
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())


# ---- failures a restart cannot fix -----------------------------------------------------------


def _rec(**kw) -> dict:
    base = {"run": "r1", "generation": 0, "rank": 0, "step": 0, "stepped": False, "type": "ValueError",
            "message": "bad", "where": "train.py:3"}
    return base | kw


def _failures(*records: dict) -> list[failures.RankFailure]:
    return [failures.RankFailure.from_json(r) for r in records]


def test_an_exception_before_the_first_step_is_deterministic():
    found = failures.deterministic(_failures(_rec(rank=1)), 0)
    assert found is not None and found[1] == "before its first step"
    assert found[0].describe() == "rank 1 (train.py:3): ValueError: bad"


def test_the_same_exception_from_the_same_line_after_a_restart_is_deterministic_whatever_the_step():
    first = _rec(stepped=True, step=120, type="RuntimeError", message="shape mismatch in <Block at 0x7f00aa10>")
    assert failures.deterministic(_failures(first), 0) is None  # once: may be transient
    # The script resumed from its own checkpoint: trainwatch's count is 20 where the script's step is 120
    # again, and the object's address differs.
    again = dict(first, generation=1, step=20, message="shape mismatch in <Block at 0x7f3c0d20>")
    found = failures.deterministic(_failures(first, again), 1)
    assert found is not None and found[1] == "again from the same line after a restart"
    elsewhere = dict(again, where="train.py:4")
    assert failures.deterministic(_failures(first, elsewhere), 1) is None
    other = dict(again, message="shape mismatch in <Head at 0x7f3c0d20>")
    assert failures.deterministic(_failures(first, other), 1) is None


def test_without_a_file_and_line_the_same_exception_must_recur_at_the_same_step():
    first = _rec(stepped=True, step=12, type="RuntimeError", message="shape mismatch", where="")
    again = dict(first, generation=1)
    assert failures.deterministic(_failures(first, again), 1)[1] == "again at step 12 after a restart"
    assert failures.deterministic(_failures(first, dict(again, step=13)), 1) is None


@pytest.mark.parametrize("type_, message, transient", [
    ("RuntimeError", "[gloo] Connection closed by peer [127.0.0.1]:1234", True),
    ("DistNetworkError", "failed to connect: Connection refused", True),
    ("OutOfMemoryError", "CUDA out of memory. Tried to allocate 2 GiB", True),
    ("DistNetworkError", "The server socket has failed to listen: EADDRINUSE: address already in use", False),
    ("ModuleNotFoundError", "No module named 'nope'", False),
    ("FileNotFoundError", "[Errno 2] No such file or directory: 'data.bin'", False),
])
def test_transient_failures_keep_the_restart_budget(type_, message, transient):
    f = failures.RankFailure.from_json(_rec(type=type_, message=message))
    assert f.transient is transient
    assert (failures.deterministic([f], 0) is None) is transient


def test_only_this_runs_records_are_read(tmp_path):
    path = tmp_path / "errors.jsonl"
    lines = [json.dumps(_rec()), json.dumps(_rec(run="other")), "{not json", json.dumps(_rec(step="x")), "[]"]
    path.write_text("\n".join(lines) + "\n")
    assert [f.run if hasattr(f, "run") else f.rank for f in failures.read_failures(path, "r1")] == [0]
    assert failures.read_failures(tmp_path / "missing", "r1") == []


@HOSTILE
@given(raw=st.binary(max_size=300))
def test_an_errors_file_of_any_bytes_reads_as_records_or_nothing(tmp_path, raw):
    path = tmp_path / "errors.jsonl"
    path.write_bytes(raw)
    got = failures.read_failures(path, "r1")
    assert all(isinstance(f, failures.RankFailure) for f in got)
    failures.deterministic(got, 0)


@HOSTILE
@given(data=st.dictionaries(st.sampled_from(["run", "generation", "rank", "step", "stepped", "type", "message",
                                             "where"]),
                            st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=5) | st.floats()))
def test_a_record_of_the_wrong_shape_is_skipped(data):
    f = failures.RankFailure.from_json(data)
    assert f is None or (f.rank >= 0 and isinstance(f.type, str))


def test_a_users_traceback_has_no_trainwatch_frames(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("def build():\n    raise ValueError('width 5 is not divisible by 2')\n\nbuild()\n")
    try:
        runpy.run_path(str(script), run_name="__main__")
    except ValueError as e:
        text, where = user_traceback(e)
    assert where == f"{script}:2"
    assert "runpy.py" not in text and "<frozen runpy>" not in text and "bootstrap" not in text
    assert text.rstrip().endswith("ValueError: width 5 is not divisible by 2")
    assert last_line(ValueError("a\nb")) == "ValueError: a"


def test_an_exception_raised_in_a_library_is_placed_at_the_users_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import json\n\ndef load():\n    return json.loads('{')\n\nload()\n")
    try:
        runpy.run_path(str(script), run_name="__main__")
    except ValueError as e:
        text, where = user_traceback(e)
    assert where == f"{script}:4"  # not json/decoder.py's line: the user's call is what replays
    assert "json/decoder.py" in text  # the printed traceback is whole
    assert last_line(KeyError("k")) == "KeyError: 'k'"


# ---- injected faults after a restart ------------------------------------------------------------


def test_a_fault_that_fired_is_not_armed_again_but_a_data_fault_replays_on_its_window():
    specs = [parse("nan:rank=1,step=10"), parse("crash:rank=1,step=40"), parse("crash:rank=1,step=60")]
    fired = {(k, json.dumps(s.params, sort_keys=True), s.step) for k, s in zip(("nan", "crash"), specs[:2])}
    said: list[str] = []
    hooks = armed_faults(encode(specs), 1, restart=1, fired=fired, say=said.append)
    assert [f.kind + str(f.step) for f in hooks.faults] == ["nan10", "crash60"]
    assert any("crash (step 40) already fired" in s for s in said)
    assert any("nan (step 10) fired before restart 1" in s for s in said)
    tw = types.SimpleNamespace(current_step=9, data_offset=0, rank=1, sample_now=lambda: None)
    assert isinstance(hooks, Armed)
    assert math.isnan(float(hooks.perturb_loss(tw, torch.tensor(1.0))))  # window 10 trained again
    skipped = armed_faults(encode(specs), 1, restart=1, fired=fired, say=said.append)
    tw = types.SimpleNamespace(current_step=9, data_offset=5, rank=1, sample_now=lambda: None)
    for step in range(9, 30):
        tw.current_step = step
        assert float(skipped.perturb_loss(tw, torch.tensor(1.0))) == 1.0  # window 10 is never trained again
    assert [f.step for f in skipped.not_replayed()] == [10] and skipped.unfired()[0].step == 60
    first = armed_faults(encode(specs), 1, restart=0, fired=fired, say=said.append)
    assert len(first.faults) == 3  # the first start arms everything


@HOSTILE
@given(raw=st.binary(max_size=300))
def test_a_faults_file_of_any_bytes_reads_as_fired_faults_or_nothing(tmp_path, raw):
    path = tmp_path / "faults.jsonl"
    path.write_bytes(raw)
    assert all(isinstance(k, tuple) and len(k) == 3 for k in fired_before(1, path))


def test_fired_before_reads_this_runs_faults_file(tmp_path):
    path = tmp_path / "faults.jsonl"
    path.write_text(json.dumps({"kind": "crash", "params": {}, "rank": 1, "step": 41, "planned": 40}) + "\n"
                    + json.dumps({"kind": "crash", "params": {}, "rank": 0, "step": 41, "planned": 40}) + "\n\x00{")
    assert fired_before(1, path) == {("crash", "{}", 40)}


# ---- ports and preemption signals -----------------------------------------------------------------


def _host(tmp_path, probe: str, env: dict | None = None) -> hostchecks.Host:
    return hostchecks.Host(env=env or {}, root=tmp_path, home=tmp_path, mounts="",
                           port_probe=lambda addrs, port: probe, resolve=lambda name: ["127.0.0.1"])


def test_the_port_check_reads_the_flag_before_the_environment(tmp_path):
    opts = hostchecks.Options(**hostchecks.port_options(29555, None, None))
    check = hostchecks.check_master_port(_host(tmp_path, "taken", {"MASTER_PORT": "1234"}), opts)
    assert check.verdict == "fail" and "--master-port=29555 is already in use" in check.message
    opts = hostchecks.Options(**hostchecks.port_options(None, None, "node0:29401"))
    assert (opts.master_port, opts.master_addr, opts.port_flag) == (29401, "node0", "--rdzv-endpoint")
    assert hostchecks.port_options(None, None, "node0") == {}
    assert hostchecks.check_master_port(_host(tmp_path, "free"), opts).verdict == "ok"


def test_preemption_signals_are_checked():
    assert parse_preempt_signals("TERM,sigusr1, USR1") == ("TERM", "USR1")
    assert parse_preempt_signals("none") == ()
    for bad in ("KILL", "", "TERM,STOP"):
        with pytest.raises(LaunchError, match="--preempt-signals"):
            parse_preempt_signals(bad)


def test_a_job_ending_on_a_nan_loss_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWATCH_HOME", str(tmp_path))
    job = state.JobDir("nanjob").create()
    job.update_job(start_time=0.0)
    table = np.zeros(2, dtype=slots.slot_dtype())
    table["pid"], table["rank"], table["step"], table["loss"] = [10, 11], [0, 1], [80, 80], [2.5, math.nan]
    assert failures.nonfinite_end(job, table, 2, "r1") is None  # a NaN slot alone may be a loss never reported
    job.append_event({"kind": "loss_nan", "id": "a", "time": "2026-01-01T00:00:00+00:00", "culprit_ranks": [1]})
    assert failures.nonfinite_end(job, table, 2, "r1") == "rank 1's last reported loss is nan (step 80; loss_nan)"
    table["loss"][1] = 2.4
    assert failures.nonfinite_end(job, table, 2, "r1") is None
    state.append_line(job.errors_file, json.dumps(_rec(type="NonFiniteEnd", rank=0, stepped=True, step=80)))
    assert failures.nonfinite_end(job, table, 2, "r1").startswith("rank 0's last reported loss")
    assert os.environ["TRAINWATCH_HOME"] == str(tmp_path) and Path(tmp_path).is_dir()


def test_a_lost_peer_is_told_from_a_fault_of_the_rank_itself(tmp_path):
    path = tmp_path / "errors.jsonl"
    recs = [_rec(rank=0, type="RuntimeError", message="[gloo] Connection closed by peer [10.0.0.2]:29500"),
            _rec(rank=1, type="DistBackendError", message="NCCL error: remote process exited or there was a network error"),
            _rec(rank=2, type="ValueError", message="bad batch"),
            _rec(rank=3, generation=1, type="RuntimeError", message="Connection reset by peer")]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert failures.peer_lost_ranks(path, "r1", 0) == {0, 1}
    assert failures.peer_lost_ranks(path, "r1", 1) == {3}
    assert failures.peer_lost_ranks(tmp_path / "missing", "r1", 0) == set()


def test_a_lost_rendezvous_host_is_told_from_a_rendezvous_timeout():
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

    lost, why = failures.rendezvous_lost(RendezvousConnectionError("The connection to the C10d store has failed."),
                                         "10.0.0.1:29500")
    assert lost and "rendezvous host 10.0.0.1:29500 no longer answers" in why and "--rdzv-endpoint" in why
    try:  # the store's own error, under a rendezvous error
        try:
            raise ConnectionResetError("Connection reset by peer")
        except ConnectionResetError as inner:
            raise RuntimeError("rendezvous failed") from inner
    except RuntimeError as outer:
        assert failures.rendezvous_lost(outer, "h:1")[0]
    lost, why = failures.rendezvous_lost(RendezvousTimeoutError("timed out"), "h:1")
    assert not lost and "--rdzv-timeout" in why
