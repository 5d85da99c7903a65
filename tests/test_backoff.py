"""Restart backoff is for crash loops only: a job that fails again without a
step, or of the same cause again soon, waits longer each time; spaced faults
that each recovered restart at once and start the ladder over. Also what
makes two crashes the same cause (the failure's identity, its message's
volatile parts masked)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainwatch.launcher import failures
from trainwatch.launcher.backoff import Backoff, Cause, crash_cause, incident_cause

UNTRUSTED = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run(backoff: Backoff, clock: Clock, ran_s: float, cause: Cause | None, progressed: bool):
    """One worker group: started, ran `ran_s`, failed."""
    backoff.workers_started()
    clock.now += ran_s
    return backoff.next(cause, progressed)


def cause(n: int) -> Cause:
    return Cause(("exit", ((1, -9, n),)), f"rank 1 killed by SIGKILL at step {n}")


def test_a_job_failing_before_any_step_backs_off_up_to_the_maximum():
    clock = Clock()
    backoff = Backoff(max_s=30.0, clock=clock)
    waits = [run(backoff, clock, 5.0, None, progressed=False).wait_s for _ in range(7)]
    assert waits == [0.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_no_step_since_the_restart_backs_off_whatever_the_time_it_ran():
    clock = Clock()
    backoff = Backoff(clock=clock)
    assert run(backoff, clock, 3.0, cause(1), progressed=True).wait_s == 0.0
    decision = run(backoff, clock, 600.0, cause(2), progressed=False)  # ten minutes stuck before its first step
    assert decision.wait_s == 2.0 and decision.loop
    assert decision.describe() == "after 2s backoff: no step completed since the last restart (restarts in this loop: 2)"


def test_spaced_faults_that_each_recovered_never_wait_and_reset_the_ladder():
    clock = Clock()
    backoff = Backoff(clock=clock)
    # A loop first: three failures without a step.
    assert [run(backoff, clock, 4.0, None, progressed=False).wait_s for _ in range(3)] == [0.0, 2.0, 4.0]
    # Then faults 20 s apart, each of another cause, each after training resumed.
    decisions = [run(backoff, clock, 20.0, cause(n), progressed=True) for n in (40, 80, 120, 160, 200)]
    assert [d.wait_s for d in decisions] == [0.0] * 5 and not any(d.loop for d in decisions)
    assert decisions[0].describe() == "no backoff: steps completed since the last restart; the backoff ladder starts over"
    assert decisions[1].describe() == ("no backoff: steps completed since the last restart and a different failure "
                                       "(rank 1 killed by SIGKILL at step 80)")
    # The ladder starts over: the next loop begins at 2 s, not at 8 s.
    assert run(backoff, clock, 4.0, None, progressed=False).wait_s == 2.0


def test_the_same_cause_again_soon_backs_off_even_after_steps():
    clock = Clock()
    backoff = Backoff(same_cause_window_s=60.0, clock=clock)
    hang = incident_cause("hang", {0: 37, 1: 36})
    assert run(backoff, clock, 10.0, hang, progressed=True).wait_s == 0.0
    again = run(backoff, clock, 10.0, incident_cause("hang", {0: 36, 1: 38}), progressed=True)
    assert again.wait_s == 2.0 and again.loop
    assert again.reason == "the same failure again (hang at step 36) 10s after the last restart (restarts in this loop: 2)"
    assert run(backoff, clock, 10.0, hang, progressed=True).wait_s == 4.0
    # The same cause after a long stretch of training is a spaced fault, not a loop.
    late = run(backoff, clock, 61.0, hang, progressed=True)
    assert late.wait_s == 0.0 and not late.loop
    assert "steps completed since the last restart (for 61s) before the same failure (hang at step 36)" in late.reason


def test_the_first_restart_never_waits():
    clock = Clock()
    decision = run(Backoff(clock=clock), clock, 1.0, None, progressed=False)
    assert decision.wait_s == 0.0
    assert decision.describe() == "no backoff: no step completed since the start; the first restart waits for nothing"


# ---- what makes two failures the same cause --------------------------------------------------------


def record(**kw) -> failures.RankFailure:
    base = {"rank": 0, "generation": 0, "step": 120, "stepped": True, "type": "ValueError",
            "message": "bad batch at step 120 (worker pid 4242)", "where": "/home/u/train.py:40"}
    return failures.RankFailure.from_json(base | kw)


def test_the_same_exception_from_the_same_line_is_one_cause_whatever_the_step_count():
    first = crash_cause([record()], {0: 1}, {0: 120})
    # After the script's own resume: trainwatch counts from 0 again, another pid.
    again = crash_cause([record(generation=1, step=20, message="bad batch at step 120 (worker pid 5151)"),
                         record(rank=1, generation=1, type="RuntimeError", message="Connection closed by peer")],
                        {0: 1}, {0: 20})
    assert first == again and first.words == "ValueError at train.py:40"
    assert crash_cause([record(where="/home/u/train.py:41")], {0: 1}, {}) != first
    assert crash_cause([record(message="bad batch at step 121 (worker pid 4242)")], {0: 1}, {}) != first
    # Without a file:line the step tells them apart (the trainer's records).
    assert crash_cause([record(where="")], {}, {}) != crash_cause([record(where="", step=20)], {}, {})


def test_a_death_by_signal_is_its_rank_signal_and_step():
    killed = crash_cause([], {1: -9}, {0: 40, 1: 39})
    assert killed.words == "rank 1 killed by SIGKILL at step 39"
    assert killed == crash_cause([], {1: -9}, {1: 39}) != crash_cause([], {1: -9}, {1: 80})
    assert crash_cause([], {0: 3}, {}).words == "rank 0 exited with code 3 at step 0"
    # Its peer's exit, seen in the same poll or not, changes nothing.
    lost = record(message="[gloo] Connection closed by peer [127.0.0.1]:1418", type="RuntimeError")
    assert crash_cause([lost], {0: 1, 1: -9}, {0: 40, 1: 39}) == killed
    assert crash_cause([], {}, {}) is None


def test_volatile_parts_of_a_message_are_masked():
    said = ("tensor at 0x7f3a2c001e50 is bad in pid 81234, tid=99 at 2025-03-01T12:00:01.123Z "
            "(12:00:01) t=1718000000.25 from [127.0.0.1]:54321 in /tmp/tmpab12cd_x "
            "id 123e4567-e89b-12d3-a456-426614174000; shape [4, 16] at step 120")
    assert failures.crash_message(said) == (
        "tensor at 0x<addr> is bad in pid <n>, tid=<n> at <time> (<time>) t=<time> from [127.0.0.1]:<port> in "
        "/tmp/tmp<name> id <uuid>; shape [4, 16] at step 120")


VOLATILE = st.sampled_from(["0x{:x}", "pid {}", "PID={}", "thread {}", "localhost:{}", "{}.5"])


@UNTRUSTED
@given(text=st.text(max_size=300))
def test_masking_any_text_is_bounded_and_idempotent(text):
    once = failures.crash_message(text)
    assert isinstance(once, str) and len(once) <= 8 * 1000
    assert failures.crash_message(once) == once


@UNTRUSTED
@given(head=st.text(alphabet="abc ,:()[]", max_size=20), tail=st.text(alphabet="abc ,:()[]", max_size=20),
       form=VOLATILE, a=st.integers(1_000_000_000, 1_999_999_999), b=st.integers(1_000_000_000, 1_999_999_999))
def test_two_runs_differing_only_in_a_volatile_value_read_the_same(head, tail, form, a, b):
    one, two = f"{head} {form.format(a)} {tail}", f"{head} {form.format(b)} {tail}"
    assert failures.crash_message(one) == failures.crash_message(two)
    assert str(a) not in failures.crash_message(one) and f"{a:x}" not in failures.crash_message(one)
