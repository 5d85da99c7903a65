"""Recovery benchmark: a hang in the default job, recovered by trainwatch.

    python benchmarks/recovery.py [--ranks 4] [--where dataloader] [--step 100]

Runs the integrated trainer's default job twice on 4 ranks: once
uninterrupted, once with a hang injected into rank 2. trainwatch must detect
it, checkpoint every rank that can still write, restart the worker group
through torchelastic and finish with the same final weights, bit for bit.
recovery_s runs from the moment the fault began (recorded by the faulting
rank) to the first step completed after the restart.

Progress goes to stderr; the LAST stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json

import torch

from common import events, faults_fired, job_json, launch, log, new_home

TORCHRUN_ALONE = (
    "plain torchrun waits in the hung all_reduce until gloo's 30 min timeout (NCCL: 10 min), then fails; "
    "with --max-restarts it restarts from the last checkpoint the script itself saved (here every 50 steps), "
    "and on torch 2.13 a gloo worker group restarted by torchrun fails in connectFullMesh (stale rendezvous store)"
)


def final_weights(home, job):
    from trainwatch.checkpoint import find_latest, load_checkpoint

    info = find_latest(home / "jobs" / job / "checkpoints")
    return (info.step if info else None), (load_checkpoint(info)["model"] if info else None)


def run(home, job, ranks, *extra):
    proc = launch(home, "--nproc-per-node", str(ranks), "--job", job, *extra)
    out, _ = proc.communicate(timeout=1200)
    return proc.returncode, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--where", default="dataloader", help="hang kind (compute, gc, dataloader, checkpoint, collective_skip)")
    p.add_argument("--step", type=int, default=100)
    p.add_argument("--rank", type=int, default=2)
    args = p.parse_args()

    log(f"uninterrupted default job on {args.ranks} ranks ...")
    ref_home = new_home("recovery-ref")
    code, out = run(ref_home, "ref", args.ranks)
    if code != 0:
        raise SystemExit(f"reference run failed:\n{out[-3000:]}")
    ref_step, ref = final_weights(ref_home, "ref")
    log(f"  done at step {ref_step}")

    spec = f"hang:where={args.where},rank={args.rank},step={args.step}"
    log(f"default job with --inject {spec} ...")
    home = new_home("recovery")
    code, out = run(home, "hung", args.ranks, "--inject", spec)
    restarts = [e for e in events(home, "hung") if e["kind"] == "restart"]
    step, weights = final_weights(home, "hung")
    recovered = code == 0 and bool(restarts) and step == ref_step
    bitwise = bool(recovered and weights is not None and weights.keys() == ref.keys()
                   and all(torch.equal(weights[k], ref[k]) for k in ref))
    ev = restarts[0]["evidence"] if restarts else {}
    fired = faults_fired(home, "hung")
    first_new_step = None
    if restarts and fired:
        # The restart incident is emitted at the first step after the restart.
        first_new_step = restarts[0]["detected_mono"]
    recovery_s = round(first_new_step - fired[0]["mono"], 3) if first_new_step and fired else ev.get("recovery_s")
    breakdown = ev.get("breakdown", {})
    if fired and breakdown.get("detect_s") is not None:
        hang = next((e for e in events(home, "hung") if e["kind"] in ("hang", "collective_mismatch")), None)
        if hang:
            breakdown["detect_s"] = round(hang["detected_mono"] - fired[0]["mono"], 3)
    for k, v in breakdown.items():
        log(f"  {k:<14} {v}")
    log(f"  recovered={recovered} bitwise_equal={bitwise} steps_lost={ev.get('steps_lost')} "
        f"recovery_s={recovery_s} restarts={job_json(home, 'hung').get('restarts')}")
    print(json.dumps({
        "recovered": recovered,
        "bitwise_equal": bitwise,
        "steps_lost": ev.get("steps_lost"),
        "recovery_s": recovery_s,
        "breakdown": breakdown,
        "fault": spec,
        "ranks": args.ranks,
        "torchrun_alone": TORCHRUN_ALONE,
    }))


if __name__ == "__main__":
    main()
