"""The flight recorder on CUDA builds: NCCL's process groups record into
ProcessGroupNCCL's own recorder (`_dump_nccl_trace_json`), gloo's into the
generic one (`_dump_fr_trace_json`). The reader reads both, so a NCCL job's
sequence numbers and arrivals reach the slot (a CPU build has only the generic one)."""

from __future__ import annotations

import json

import pytest

from trainwatch import slots
from trainwatch.rank import flightrec
from trainwatch.rank.flightrec import FlightRecorderReader, merged_dump

EPOCH_NS = 1_700_000_000 * 10**9


def entry(seq, pg, name, op, started=0):
    return {"collective_seq_id": seq, "pg_id": pg, "process_group": [name, "x"], "is_p2p": False,
            "profiling_name": op, "time_created_ns": EPOCH_NS + seq * 10**6, "time_discovered_started_ns": started}


def nccl_dump(**kw):
    # As torch returns it: bytes. The default group (0) and the trainer's logging group (1) are NCCL.
    return json.dumps({"version": "2.10", "entries": [
        entry(s, 0, "0", "nccl:all_reduce", started=EPOCH_NS + s * 10**6 + 5) for s in (1, 2, 3)
    ] + [entry(1, 1, "1", "nccl:all_reduce", started=EPOCH_NS + 7)], "pg_status": {
        "0": {"last_enqueued_collective": 3, "last_completed_collective": 2},
        "1": {"last_enqueued_collective": 1, "last_completed_collective": 1}}}).encode()


def gloo_dump(**kw):
    # A CPU-side gloo group (2) beside them.
    return json.dumps({"version": "2.10", "entries": [entry(4, 2, "2", "gloo:broadcast")],
                       "pg_status": {"2": {"last_enqueued_collective": 4, "last_completed_collective": 4}}})


def broken(**kw):
    raise RuntimeError("recorder gone")


def test_merged_dump_reads_both_recorders():
    data = merged_dump([nccl_dump, gloo_dump], includeCollectives=True, onlyActive=False)
    assert [e["pg_id"] for e in data["entries"]] == [0, 0, 0, 1, 2]
    assert sorted(data["pg_status"]) == ["0", "1", "2"]


def test_merged_dump_leaves_out_a_failing_recorder_and_raises_when_all_fail():
    assert len(merged_dump([broken, gloo_dump])["entries"]) == 1
    with pytest.raises(RuntimeError, match="recorder gone"):
        merged_dump([broken, broken])
    with pytest.raises(TypeError):
        merged_dump([lambda **kw: "[1, 2]"])


def test_reader_publishes_nccl_groups_and_device_start_times(monkeypatch):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    import torch._C._distributed_c10d as c10d
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", nccl_dump, raising=False)
    monkeypatch.setattr(c10d, "_dump_fr_trace_json", gloo_dump, raising=False)
    reader = FlightRecorderReader()
    groups = reader.sample()
    assert reader.available
    assert [(g.pg, g.enqueued, g.completed, g.last_op) for g in groups] == [
        (0, 3, 2, "all_reduce"), (1, 1, 1, "all_reduce"), (2, 4, 4, "broadcast")]
    assert reader.arrivals == (slots.ARRIVAL_STARTED, [(s, EPOCH_NS + s * 10**6 + 5) for s in (1, 2, 3)])


def test_reader_on_a_cpu_build_uses_the_generic_recorder_alone(monkeypatch):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    import torch._C._distributed_c10d as c10d

    monkeypatch.delattr(c10d, "_dump_nccl_trace_json", raising=False)
    monkeypatch.setattr(c10d, "_dump_fr_trace_json", gloo_dump, raising=False)
    assert FlightRecorderReader()._fn is gloo_dump
    assert flightrec.DUMPS[0] == "_dump_nccl_trace_json"  # NCCL's first: where a NCCL job's collectives are
