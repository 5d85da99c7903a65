"""The one validating codec: what a record's declaration says is written is
what is read back; anything else is a skipped record or a named error, never
a traceback."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainwatch import codec
from trainwatch.codec import check
from trainwatch.watchdog.detectors.base import RankExit, rank_exit_from_line
from trainwatch.watchdog.failures import RankFailure


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Inner:
    n: int = field(metadata=check(min=0))


@dataclass(frozen=True)
class Record:
    rank: int = field(metadata=check(min=0))
    name: str = field(metadata=check(max_len=5))
    ratio: float = 1.0
    ranks: list[int] = field(default_factory=list)
    colour: Colour = Colour.RED
    inner: Inner | None = None
    note: str | None = None
    flag: bool = False


def test_a_record_round_trips():
    r = Record(rank=3, name="abc", ratio=0.5, ranks=[1, 2], colour=Colour.BLUE, inner=Inner(4), note="x", flag=True)
    data = json.loads(json.dumps(codec.encode(r)))
    assert data["colour"] == "blue" and data["inner"] == {"n": 4}
    assert codec.decode(Record, data) == r


def test_required_fields_make_a_record_unreadable_and_optional_ones_fall_back():
    assert codec.decode(Record, {"name": "a"}) is None
    assert codec.decode(Record, {"rank": True, "name": "a"}) is None  # true is not rank 1
    assert codec.decode(Record, {"rank": -1, "name": "a"}) is None  # below its bound
    with pytest.raises(codec.CodecError, match=r"Record\.rank: not a int|Record\.rank: not an int|Record\.rank"):
        codec.decode(Record, {"rank": "1", "name": "a"}, strict=True)
    got = codec.decode(Record, {"rank": 1, "name": "abcdefgh", "ratio": float("nan"), "ranks": [1, "x", True, 2],
                                "colour": "green", "inner": {"n": -3}, "note": 5, "flag": "yes", "extra": 1})
    assert got == Record(rank=1, name="abcde", ranks=[1, 2])


def test_the_declared_records_read_their_own_writers_output():
    from trainwatch.watchdog.agent import exit_line

    line = json.dumps(exit_line(2, 0, 77, -9, node="n1", run="r", first=True)).encode()
    e = rank_exit_from_line(line, "other", run="r")
    assert e == RankExit(rank=2, local_rank=0, pid=77, exitcode=-9, signal_name="SIGKILL", node="n1", first=True)
    assert rank_exit_from_line(line, "n", run="another run") is None
    f = RankFailure.from_json({"run": "r", "rank": 0, "generation": 1, "step": 3, "stepped": True, "type": "E" * 300,
                               "message": "m", "where": ""})
    assert f is not None and len(f.type) == 200 and f.generation == 1


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=5),
                    max_leaves=20)
FIELDS = st.sampled_from(["rank", "name", "ratio", "ranks", "colour", "inner", "note", "flag", "local_rank", "pid",
                          "exitcode", "signal_name", "node", "first", "generation", "step", "stepped", "type",
                          "message", "where"])


@settings(max_examples=300, deadline=None)
@given(data=st.dictionaries(FIELDS, JSON, max_size=10) | JSON)
def test_any_json_reads_as_a_record_or_nothing(data):
    for cls in (Record, RankExit, RankFailure):
        got = codec.decode(cls, data)
        assert got is None or isinstance(got, cls)
        try:
            codec.decode(cls, data, strict=True)
        except codec.CodecError:
            pass


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=200))
def test_any_bytes_in_exits_jsonl_read_as_an_exit_or_nothing(raw):
    got = rank_exit_from_line(raw, "n")
    assert got is None or isinstance(got, RankExit)
