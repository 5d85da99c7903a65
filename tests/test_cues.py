"""The words of a failure's area (diagnostics/cues.py): the last reader `explain` tries."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainwatch.diagnostics.cues import CUES, MIN_SCORE, area_scores, cue_findings
from trainwatch.diagnostics.explain import explain_inputs
from trainwatch.diagnostics.findings import FINDING_KEYS
from trainwatch.diagnostics.runbooks import list_runbooks


def runbook_ids() -> set[str]:
    return {runbook_id for runbook_id, _ in list_runbooks()}


def _explained(text: str) -> list[tuple[str, str]]:
    return [(f["category"], f["severity"]) for f in explain_inputs([("issue.txt", text.encode())])["findings"]]


# Accounts no message rule reads: a user's own words, a version's wording, a line cut short.
@pytest.mark.parametrize("text, category", [
    ("after ~2k steps the training loss becomes nan and never comes back", "loss_nan"),
    ("  5/300   3.1G   nan   nan   nan   12   640", "loss_nan"),
    ("the scaler keeps reducing the loss scale every iteration until it is 1e-9", "loss_scale_collapse"),
    ("worker 3 cannot reach the store: the hostname could not be resolved (Name or service not known)",
     "heartbeat_timeout"),
    ("Timed out after 600 seconds waiting for clients. 3/4 clients joined.", "heartbeat_timeout"),
    ("The run died with 'GPU out of memory' once we raised the batch size to 64", "oom"),
    ("Failed to allocate 2.00 GiB on device 0 (RESOURCE_EXHAUSTED)", "oom"),
    ("Both nodes fail: NCCL error, the IB link reports ibv_poll_cq errors on mlx5_0", "nccl_error"),
    ("NCCL cannot create its shm segment: the container's /dev/shm is 64MB", "nccl_error"),
    ("the allreduce timed out after 30 minutes on rank 5, everyone else waited", "collective_timeout"),
    ("ranks 0-3 use a different shape for the all_gather than ranks 4-7, which is a desync", "collective_mismatch"),
    ("C++ side: Assertion `t >= 0 && t < n_classes` failed. in the loss kernel", "cuda_error"),
    ("CUDA error: an illegal memory access was encountered (seen in the thread's last log)", "illegal_memory_access"),
    ("launcher: process 2 terminated with signal SIGKILL, exit code -9", "child_failed"),
    ("DataLoader worker (pid 4411) exited; the container had a 64M shm, raising --shm-size fixed it",
     "dataloader_worker_killed"),
    ("the job is stuck, py-spy shows every rank inside torch.cuda.synchronize", "cuda_sync"),
    ("it hangs: all ranks wait in the all_gather of the next step", "collective_wait"),
    ("stuck forever at 'Waiting for lock on /root/.cache/torch_extensions/fused_adam'", "compile_lock"),
    ("dmesg shows Xid 79 right before the job died", "xid"),
    ("rank 3 keeps waiting in the store based barrier after the others started", "barrier"),
    ("the build is waiting on a lock file under torch_extensions from a killed run", "compile_lock"),
    ("多卡训练时 all_reduce 超时，单卡正常", "collective_timeout"),
    ("nvidia-smi -q shows an uncorrectable ECC error count of 2 on GPU 3", "ecc"),
])
def test_an_account_in_an_areas_words_is_read_as_that_area_at_low_severity(text: str, category: str) -> None:
    found = cue_findings(text)
    assert [f["category"] for f in found] == [category], area_scores(text)
    finding = found[0]
    assert finding["severity"] == "low" and finding["source"] == "cues"
    assert list(finding)[:len(FINDING_KEYS)] == list(FINDING_KEYS)
    assert finding["evidence"] and finding["evidence"].splitlines()[0] in text
    assert finding["runbook"] in runbook_ids()


def test_the_xid_number_is_read_when_the_words_give_it() -> None:
    assert cue_findings("dmesg shows Xid 79 right before the job died")[0]["xid"] == 79


@pytest.mark.parametrize("text", [
    "",
    "We broadcast the parameters and use a DataLoader with 8 workers.",
    "epoch 1 | loss 2.31 | lr 3e-4",
    "node1:2:9 [0] NCCL INFO Channel 00/02 : 0 1 2 3\nnode1:2:9 [0] NCCL INFO Connected all rings",
    "cublas handle created: CUBLAS_STATUS_SUCCESS",
    # Settings a process group prints at start-up: names of variables, not events.
    "ProcessGroupNCCL initialization options: NCCL_ASYNC_ERROR_HANDLING: 1, NCCL_DESYNC_DEBUG: 0",
    "We save the checkpoint with torch.save every 1000 steps.",  # a place, but nothing waits
    "The allocator ran out of memory trying to allocate 2GiB. The caller indicates that this is not a failure.",
])
def test_words_that_name_no_failure_find_nothing(text: str) -> None:
    assert cue_findings(text) == []


def test_a_tie_between_two_areas_names_neither() -> None:
    text = "CUDA out of memory\nNCCL error: unhandled system error"
    scores = {area: score for area, (score, _) in area_scores(text).items()}
    assert scores["oom"] >= MIN_SCORE and scores["nccl_error"] >= MIN_SCORE
    assert abs(scores["oom"] - scores["nccl_error"]) < 1.0
    assert cue_findings(text) == []


def test_the_narrower_area_wins_over_the_wider_one_its_words_also_speak() -> None:
    assert [f["category"] for f in cue_findings(
        "RuntimeError: CUDA error: an illegal memory access, CUDA_LAUNCH_BLOCKING=1 for a stack")] == [
        "illegal_memory_access"]
    assert [f["category"] for f in cue_findings(
        "the watchdog got stuck; TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC was hit while the collective timed out")] == [
        "heartbeat_timeout"]


def test_values_a_loss_reader_has_weighed_are_not_overruled_by_words() -> None:
    # One routine scale cut, a constant bf16 scale and a scale logged as nan: the loss-health
    # reader read these numbers and found no fault; the words around them change nothing.
    assert cue_findings("Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0") == []
    assert cue_findings("\n".join(f"step {i} | loss_scale 1.0" for i in range(8))) == []
    assert cue_findings("loss_scale: nan\nloss scale 0.0") == []
    # ... but a scaler cut again and again is worth a look even while its scale is large.
    cuts = "\n".join(f"OVERFLOW! Skipping step. Attempted loss scale: {2.0 ** (32 - i)}, reducing to "
                     f"{2.0 ** (31 - i)}" for i in range(8))
    assert "loss_scale_collapse" in [c for c, _ in _explained(cuts)]


def test_a_stack_area_needs_a_text_that_says_the_run_waits() -> None:
    assert cue_findings("we call torch.cuda.synchronize() before timing each step") == []
    assert [f["category"] for f in cue_findings(
        "the run hangs and the dump ends in cudaStreamSynchronize")] == ["cuda_sync"]


def test_explain_tries_the_words_only_when_nothing_else_explains_the_text() -> None:
    # A message rule explains it: no cue finding is added beside it.
    rule = "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB"
    assert [f.get("source") for f in explain_inputs([("a.log", rule.encode())])["findings"]] != ["cues"]
    # Nothing else does: the area at low severity, beside the exception the text ended on.
    text = "After some hours the store could not be reached: hostname lookup failed.\nValueError: bad host"
    assert _explained(text) == [("heartbeat_timeout", "low"), ("other", "low")]


def test_every_area_has_a_runbook_and_cues_of_positive_weight() -> None:
    for area, cues in CUES.items():
        assert cues and all(weight > 0 and lines >= 1 for _, weight, lines in cues), area
        finding_text = {"xid": "Xid 13"}.get(area)
        if finding_text:
            assert cue_findings(finding_text)[0]["runbook"] in runbook_ids()


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=3000))
def test_any_text_gives_findings_or_nothing_never_a_traceback(text: str) -> None:
    found = cue_findings(text)
    assert len(found) <= 1
    assert all(f["severity"] == "low" for f in found)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from(["loss nan", "NCCL error", "out of memory", "hang", "barrier(", "Xid 48",
                                 "timed out", "rendezvous", "x" * 500, "\n"]), max_size=400))
def test_long_texts_of_cue_words_stay_bounded(parts: list[str]) -> None:
    found = cue_findings(" ".join(parts))
    assert len(found) <= 1


def test_a_long_text_is_weighed_by_its_start_and_its_end() -> None:
    """Words are no evidence worth scanning megabytes for: a log's failure is near its end, a
    pasted issue's near its start, and a line's words come early in it."""
    filler = "\n".join(f"step {i} | lr 0.001 | acc 0.5" for i in range(40_000))
    account = "the training loss becomes nan after a while"
    assert cue_findings(account + "\n" + filler)[0]["category"] == "loss_nan"
    assert cue_findings(filler + "\n" + account)[0]["category"] == "loss_nan"
    half = len(filler) // 2
    assert cue_findings(filler[:half] + "\n" + account + "\n" + filler[half:]) == []
    assert cue_findings("x" * 600 + account) == []
