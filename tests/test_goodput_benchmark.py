"""benchmarks/goodput.py's measurement, on scripted logs: the same arithmetic
judges every tool, so it must count a caught collective skip as caught and an
uncaught one (or a resume from a checkpoint written after it) as lost."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import goodput  # noqa: E402

STEP_S = 0.1


def write_logs(work: Path, world: int, lives: list[tuple[float, int, int]]) -> None:
    """lives: (start time, resumed_from, last step) per process generation,
    every rank stepping every STEP_S from its start."""
    (work / "logs").mkdir(parents=True)
    for r in range(world):
        lines = []
        for gen, (t, resumed, last) in enumerate(lives):
            pid = 1000 * (gen + 1) + r
            lines.append({"ev": "start", "rank": r, "pid": pid, "mono": t, "resumed_from": resumed})
            for k, step in enumerate(range(resumed + 1, last + 1), start=1):
                lines.append({"ev": "step", "rank": r, "pid": pid, "mono": t + k * STEP_S, "step": step})
        (work / "logs" / f"rank{r}.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def skip_at(t: float) -> dict:
    return {"kind": "collective_skip", "rank": 0, "mono": t}


def test_a_skip_caught_and_resumed_from_before_it_is_not_lost_by_later_restarts(tmp_path):
    """Skip at step 100 (t=10.05); restart at t=11 from step 90; a second
    restart at t=40 from step 350 (a checkpoint of the clean lineage)."""
    write_logs(tmp_path, 2, [(0.0, 0, 109), (11.0, 90, 370), (40.0, 350, 650)])
    res = goodput.measure(tmp_path, 2, 0.0, 70.0, [skip_at(10.05)])
    assert res["desynced"] is None
    assert res["steps"] == 650


def test_an_uncaught_skip_stops_net_progress_at_the_step_before_it(tmp_path):
    write_logs(tmp_path, 2, [(0.0, 0, 600)])
    res = goodput.measure(tmp_path, 2, 0.0, 61.0, [skip_at(10.05)])
    assert res["desynced"]["clean_step"] == 100 and res["steps"] == 100


@pytest.mark.parametrize("resumed", [105, 300])
def test_a_restart_from_a_checkpoint_written_after_the_skip_is_lost(tmp_path, resumed):
    write_logs(tmp_path, 2, [(0.0, 0, 320), (33.0, resumed, 600)])
    res = goodput.measure(tmp_path, 2, 0.0, 70.0, [skip_at(10.05)])
    assert res["desynced"]["clean_step"] == 100 and res["steps"] == 100
