"""Straggler benchmark: no false stragglers under CPU contention, real ones still found.

    python benchmarks/stragglers.py [--runs 10] [--ranks 4] [--model-size tiny] [--neighbour alternate]
                                    [--workload trainer|zero-code] [--flight-recorder-off]
    python benchmarks/stragglers.py --smoke   # one short healthy run, one control, 2 ranks, alone (for tests)

Runs `--runs` healthy jobs of the integrated trainer (4 ranks, 200 steps)
while another job runs beside them on the same machine: a second, healthy
2-rank trainwatch job, a process spinning on a CPU, or both (`--neighbour
alternate`, the default, takes them in turns; `job`, `hog`, `both` pick one).
Every straggler incident in a healthy run is a false one; those of the 2-rank
neighbour job (healthy too) are counted apart. The tiny model is the default:
its short, fast steps are the hardest case (compute of ~50 ms that the
scheduler stretches 2-3x on one rank for seconds). Then a control: the same
job with a real straggler injected into one rank (`--inject
straggler:delay=...`) beside both neighbours must be detected; detect_s runs
from the moment the fault began (recorded by the faulting rank) to the
incident (the sidecar's detection time, same clock).

Which evidence the detector used: with the flight recorder on (trainwatch
launch's default) ranks publish their arrival times at collectives and the
detector judges by arrival order (incident evidence `"source":
"collective_arrival"`); `--flight-recorder-off` runs every job with
TORCH_FR_BUFFER_SIZE=0, so only compute time is left (`"source": "compute"`).
`--workload zero-code` runs tests/scripts/plain_ddp.py, an unmodified DDP
script (no trainwatch import: steps and phases come from the zero-code
bootstrap), instead of the integrated trainer; its steps are short (~25 ms),
so pass more of them (e.g. `--steps 2000`). Each control's incident source
is in the output.

Every run has its own TRAINWATCH_HOME and job name; after each one nothing of
it may be left (common.reap: no process of its session, no slot segment);
what was left is reaped and counted in `leftovers`.

`--trace DIR` also records the slot table every sidecar tick (0.15 s) into
DIR/<job>.npz; `--replay DIR` runs the straggler detector over such
recordings offline and prints what it would report (no jobs are started);
`--detector FILE` replays with another version of the detector module, e.g.
`git show HEAD~1:trainwatch/watchdog/detectors/straggler.py > /tmp/old.py`,
so two versions are compared on the same data; `--replay DIR --no-arrivals`
replays with compute time only, and every replay says for how many ticks the
arrival evidence judged the ranks.

`--tick-ranks N` measures one straggler-detector round over N synthetic
ranks (median ms), with and without arrivals published (every rank
publishing new ones every round: the heaviest case), and exits.

Progress goes to stderr; the LAST stdout line is one JSON object:
{"healthy_runs": 10, "false_stragglers": 0, "true_straggler_detected": true, "detect_s": ...}
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from pathlib import Path

import numpy as np

from common import SMOKE_HELP, ROOT, events, faults_fired, job_json, keep, launch, log, new_home, reap, spawn, wait_for

TICK_S = 0.15  # the sidecar's default tick
CULPRIT = 2
LEFTOVERS: list[str] = []  # processes or segments a run left behind (reaped)


WORKLOAD = "trainer"  # or "zero-code" (--workload)


def trainer(steps: int, model: str) -> list[str]:
    """The measured workload: the integrated trainer, or an unmodified DDP script."""
    if WORKLOAD == "zero-code":
        return [str(ROOT / "tests" / "scripts" / "plain_ddp.py"), "--steps", str(steps)]
    return ["-m", "trainwatch.trainer", "--model-size", model, "--max-steps", str(steps), "--log-interval", "100000"]


class Output(threading.Thread):
    """Reads a launcher's output as it comes (a pipe nobody reads fills up and
    blocks the writer), keeping the last lines for a failure report."""

    def __init__(self, proc: subprocess.Popen):
        super().__init__(daemon=True)
        self.proc, self.lines = proc, deque(maxlen=40)
        self.start()

    def run(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def tail(self) -> str:
        self.join(10)
        return "".join(self.lines)


class Neighbour:
    """What runs beside the measured job: a healthy 2-rank trainwatch job, a
    process spinning on a CPU, or both."""

    def __init__(self, kind: str, model: str, trace: str | None = None):
        self.kind = kind
        self.tracer: Tracer | None = None
        self.hog: subprocess.Popen | None = None
        self.job: subprocess.Popen | None = None
        self.home: Path | None = None
        self.name = ""
        if kind in ("hog", "both"):
            self.hog = spawn([sys.executable, "-c", "while True: pass"])
        if kind in ("job", "both"):
            self.home = new_home("straggler-neighbour")
            self.name = f"neighbour-{uuid.uuid4().hex[:6]}"
            self.job = launch(self.home, "--nproc-per-node", "2", "--job", self.name, *trainer(1_000_000, model))
            self.output = Output(self.job)
            if trace:
                self.tracer = Tracer(self.home, self.name, Path(trace))
                self.tracer.start()
            # Let it start stepping first: the measured job then starts under load.
            wait_for(lambda: _stepping(self.home, self.name, 2), 120, 0.5)

    def stop(self) -> int:
        """Stop everything; the neighbour job's (false) straggler incidents."""
        found = 0
        if self.job is not None:
            if self.tracer is not None:
                self.tracer.halt.set()
                self.tracer.join()
            # SIGTERM to its session (a user's Ctrl-C); nothing of it may be left.
            left = reap(self.job, self.home, self.name)
            if left:
                LEFTOVERS.extend(left)
                log(f"  neighbour {self.name} did not stop cleanly; its last output:\n{self.output.tail()}")
            found = len([e for e in events(self.home, self.name) if e["kind"] == "straggler"])
        if self.hog is not None:
            self.hog.kill()
            self.hog.wait()
        return found


def _stepping(home: Path, job: str, ranks: int) -> bool:
    try:
        tel = json.loads((home / "jobs" / job / "telemetry.json").read_text())["ranks"]
    except (OSError, ValueError, KeyError):
        return False
    return len(tel) == ranks and all((r.get("step") or 0) >= 3 for r in tel)


class Tracer(threading.Thread):
    """Records the job's slot table every tick, as the sidecar reads it."""

    def __init__(self, home: Path, job: str, out: Path):
        super().__init__(daemon=True)
        self.home, self.job, self.out = home, job, out
        self.halt = threading.Event()

    def run(self) -> None:
        from trainwatch import slots

        seg_path = wait_for(lambda: job_json(self.home, self.job).get("slots"), 120, 0.2)
        if not seg_path:
            return
        try:
            seg = slots.Segment(seg_path)
        except (OSError, ValueError):
            return
        times, tables, prev = [], [], None
        try:
            while not self.halt.wait(TICK_S):
                try:
                    prev = seg.read_table(previous=prev)
                except (OSError, ValueError):
                    break
                times.append(time.monotonic())
                tables.append(prev.view(np.uint8).copy())  # raw bytes: np.stack drops the layout's padding
        finally:
            seg.close()
        if tables:
            np.savez_compressed(self.out / f"{self.job}.npz", now=np.array(times), table=np.stack(tables))


def run_job(home: Path, job: str, args, *extra: str, until=None, timeout: float = 900) -> tuple[list[dict], subprocess.Popen]:
    tracer = Tracer(home, job, Path(args.trace)) if args.trace else None
    proc = launch(home, "--nproc-per-node", str(args.ranks), "--job", job, "--no-restart", *extra)
    output = Output(proc)
    if tracer:
        tracer.start()
    try:
        if until is not None:
            wait_for(until, timeout, 0.25)
        else:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log(f"  {job} did not finish in {timeout:.0f}s; stopping it")
    finally:
        if tracer:
            tracer.halt.set()
            tracer.join()
        # Stopped like a user's Ctrl-C if still running; nothing of the run may
        # be left: not a process of its session, not its slot segment.
        LEFTOVERS.extend(reap(proc, home, job))
    if until is None and proc.returncode != 0:
        keep(home)
        log(f"  {job} exited {proc.returncode} (its home {home} is kept); its last output:\n{output.tail()}")
    return [e for e in events(home, job) if e["kind"] == "straggler"], proc


def neighbour_kind(mode: str, i: int) -> str:
    return ("job", "hog", "both")[i % 3] if mode == "alternate" else mode


def healthy_runs(args) -> tuple[int, int, list]:
    false_main, false_neighbour, detail = 0, 0, []
    for i in range(args.runs):
        kind = neighbour_kind(args.neighbour, i)
        job = f"healthy-{i}-{uuid.uuid4().hex[:6]}"
        home = new_home("straggler-healthy")
        t0 = time.monotonic()
        nb = Neighbour(kind, args.model_size, args.trace)
        try:
            found, proc = run_job(home, job, args, *trainer(args.steps, args.model_size))
        finally:
            nb_found = nb.stop()
        wall = time.monotonic() - t0
        false_main += len(found)
        false_neighbour += nb_found
        detail.append({"run": i, "neighbour": kind, "rc": proc.returncode, "false_stragglers": len(found),
                       "neighbour_false_stragglers": nb_found, "wall_s": round(wall, 1)})
        for e in found:
            log(f"  FALSE straggler ({e['evidence'].get('source')}): {e['summary']}")
        log(f"run {i + 1}/{args.runs} beside {kind}: rc={proc.returncode} false stragglers={len(found)} "
            f"(neighbour job: {nb_found}) {wall:.0f}s")
        if not args.keep and proc.returncode == 0:
            shutil.rmtree(home, ignore_errors=True)
            if nb.home:
                shutil.rmtree(nb.home, ignore_errors=True)
    return false_main, false_neighbour, detail


def control_run(args) -> dict:
    kind = args.control_neighbour
    job = f"straggler-{uuid.uuid4().hex[:6]}"
    home = new_home("straggler-control")
    culprit = min(CULPRIT, args.ranks - 1)
    spec = f"straggler:delay={args.delay},rank={culprit},step=5"
    log(f"control: --inject {spec} beside {kind} ...")
    nb = Neighbour(kind, args.model_size, args.trace) if kind != "none" else None
    try:
        found, _ = run_job(home, job, args, "--inject", spec, *trainer(1_000_000, args.model_size),
                           until=lambda: [e for e in events(home, job) if e["kind"] == "straggler"],
                           timeout=args.timeout)
        fired = faults_fired(home, job)
    finally:
        if nb is not None:
            nb.stop()
    out = {"detected": bool(found), "culprit_ok": bool(found) and found[0]["culprit_ranks"] == [culprit],
           "detect_s": None, "neighbour": kind, "source": found[0]["evidence"].get("source") if found else None}
    if found and fired:
        out["detect_s"] = round(found[0]["detected_mono"] - fired[0]["mono"], 2)
        out["summary"] = found[0]["summary"][:200]
    log(f"  detected={out['detected']} culprit_ok={out['culprit_ok']} detect_s={out['detect_s']} "
        f"source={out['source']}")
    if not args.keep:
        shutil.rmtree(home, ignore_errors=True)
        if nb is not None and nb.home:
            shutil.rmtree(nb.home, ignore_errors=True)
    return out


def replay(trace_dir: Path, module: str | None, arrivals: bool = True) -> None:
    """The straggler detector over recorded slot tables, tick by tick."""
    from trainwatch import slots
    from trainwatch.watchdog.detectors import StragglerConfig, StragglerDetector
    from trainwatch.watchdog.detectors.base import TickView

    if module:
        import importlib.util

        spec = importlib.util.spec_from_file_location("straggler_under_test", module)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
        detector = mod.StragglerDetector
    else:
        detector = StragglerDetector
    total, judged_ticks, ticks = 0, 0, 0
    for path in sorted(trace_dir.glob("*.npz")):
        data = np.load(path)
        det, seen = (detector() if arrivals else detector(StragglerConfig(arrivals=False))), set()
        judged = 0
        for now, raw in zip(data["now"], data["table"]):
            for inc in det.check(TickView.from_table(float(now), raw.view(slots.slot_dtype()))):
                key = tuple(inc.culprit_ranks)
                if key not in seen:
                    seen.add(key)
                    log(f"  {path.stem} t={now - data['now'][0]:.1f}s ({inc.evidence.get('source')}): {inc.summary}")
            arrival = getattr(det, "_arrival", None)
            judged += bool(arrival is not None and arrival.active)
        total += bool(seen) and not path.stem.startswith("straggler")
        ticks += len(data["now"])
        judged_ticks += judged
        log(f"{path.stem}: {'straggler ' + str(sorted(seen)) if seen else 'no straggler'} "
            f"(arrivals judged {judged} of {len(data['now'])} ticks)")
    print(json.dumps({"traces": len(list(trace_dir.glob('*.npz'))), "healthy_with_straggler": total,
                      "ticks": ticks, "arrival_judged_ticks": judged_ticks}))


def tick_cost(nranks: int, ticks: int = 50) -> dict:
    """Median ms of one straggler-detector round over `nranks` synthetic ranks
    that all finish a step every round, without and with arrivals published
    (each rank its last 16 collectives, 3 of them new every round)."""
    import statistics

    from trainwatch import slots
    from trainwatch.watchdog.detectors import StragglerDetector
    from trainwatch.watchdog.engine import _SyntheticJob

    def rounds(with_arrivals: bool) -> float:
        job, det = _SyntheticJob(nranks), StragglerDetector()
        rng = np.random.default_rng(1)
        times = []
        for k in range(60 + ticks):
            view = job.advance()
            if with_arrivals:
                t = view.table
                seq = 3 * t["step"][:, None] - np.arange(slots.ARRIVALS)[::-1][None, :]
                t["arrival_source"] = slots.ARRIVAL_ENQUEUED
                t["narrivals"] = slots.ARRIVALS
                t["arrivals"]["seq"] = seq
                t["arrivals"]["t_ns"] = (1.7e18 + seq * 0.033e9 + rng.normal(0, 2e6, seq.shape)).astype(np.int64)
            start = time.perf_counter()
            det.check(view)
            if k >= 60:  # histories full
                times.append((time.perf_counter() - start) * 1000.0)
        return statistics.median(times)

    return {"ranks": nranks, "straggler_tick_ms": round(rounds(False), 3),
            "straggler_tick_ms_with_arrivals": round(rounds(True), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10, help="healthy runs")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=200, help="steps of each healthy run")
    p.add_argument("--model-size", default="tiny")
    kinds = ("job", "hog", "both", "none")
    p.add_argument("--neighbour", choices=("alternate", *kinds), default="alternate",
                   help="what runs beside the healthy jobs (alternate: job, hog, both in turns)")
    p.add_argument("--control-neighbour", choices=kinds, default="both")
    p.add_argument("--delay", type=float, default=0.3, help="the injected straggler's extra compute per step (s)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the control's incident")
    p.add_argument("--no-control", action="store_true")
    p.add_argument("--trace", help="record every run's slot tables into this directory")
    p.add_argument("--replay", help="run the detector over the recordings in this directory and exit")
    p.add_argument("--detector", help="with --replay: the straggler detector module file to replay")
    p.add_argument("--no-arrivals", action="store_true", help="with --replay: compute time only")
    p.add_argument("--workload", choices=("trainer", "zero-code"), default="trainer",
                   help="the integrated trainer, or tests/scripts/plain_ddp.py run unmodified")
    p.add_argument("--flight-recorder-off", action="store_true",
                   help="run every job with TORCH_FR_BUFFER_SIZE=0 (no arrival times: compute time only)")
    p.add_argument("--tick-ranks", type=int, help="measure one detector round over this many ranks and exit")
    p.add_argument("--keep", action="store_true", help="keep the runs' TRAINWATCH_HOME directories")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args()
    if args.keep:
        os.environ["TRAINWATCH_BENCH_KEEP"] = "1"  # common.clean_up() keeps every home
    if args.smoke:  # 2 ranks: one healthy run of 20 steps and the control, alone (a hog would slow every test)
        args.runs, args.ranks, args.steps, args.neighbour, args.control_neighbour = 1, 2, 20, "none", "none"
        args.timeout, args.tick_ranks, args.replay = 90.0, None, None
    if args.replay:
        replay(Path(args.replay), args.detector, arrivals=not args.no_arrivals)
        return
    if args.tick_ranks:
        print(json.dumps(tick_cost(args.tick_ranks)))
        return
    global WORKLOAD
    WORKLOAD = args.workload
    if args.flight_recorder_off:
        os.environ["TORCH_FR_BUFFER_SIZE"] = "0"  # the launcher keeps a value it is given
    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
    false_main, false_nb, detail = healthy_runs(args) if args.runs else (0, 0, [])
    control = None if args.no_control else control_run(args)
    print(json.dumps({
        "workload": args.workload,
        "flight_recorder": not args.flight_recorder_off,
        "healthy_runs": args.runs,
        "false_stragglers": false_main,
        "neighbour_false_stragglers": false_nb,
        "true_straggler_detected": None if control is None else control["detected"] and control["culprit_ok"],
        "detect_s": None if control is None else control["detect_s"],
        "leftovers": len(LEFTOVERS),
        "control": control,
        "runs": detail,
    }))


if __name__ == "__main__":
    import common

    common.main(main)
