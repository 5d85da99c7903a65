"""Telemetry overhead: what one `tw.step()` costs, and what the whole
instrumentation costs a real DDP training step.

    python benchmarks/overhead.py [--ranks 2] [--model-size small] [--pairs 12] [--block 15] [--device cpu|cuda]
    python benchmarks/overhead.py --smoke    # every measurement once, tiny (seconds; for tests)

record_ns: median cost of one tw.step(loss=..., grad_norm=...) into a real
shared-memory slot (sampler thread running, as under `trainwatch launch`).

step_overhead_ratio: median step time with telemetry / without, measured in
the same run with the same ranks: each rank alternates blocks of steps with
the full instrumentation (phases + step record + sampler thread) and blocks
without, ON/OFF interleaved so machine drift hits both equally.

zero_code_*: an unmodified DDP script with 10 collectives per step
(benchmarks/scripts/collective_heavy.py: DDP's gradient all-reduce and nine
metric all-reduces) run whole under `trainwatch launch` and under plain
torchrun, alternately, `--zero-code-pairs` times, each rank pinned to a CPU:
the median over pairs of the step time ratio (goal <= 1.02) and of the ratio
of CPU time per step of the ranks, all their threads (sampler included; goal
<= 1.03); *_range gives the lowest and highest pair, the run-to-run spread.
zero_code_rank_side_share: what trainwatch itself costs a rank, as a fraction
of its step time (goal < 0.01): the CPU of its sampler thread per step (from
the same runs) plus ten collectives' worth of collective_wrapper_ns (a wrapped
against an unwrapped all_reduce, measured here).

Prints progress to stderr; the LAST line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import BIN, ROOT, SMOKE_HELP, env_for, new_home, run_command
from trainwatch import slots
from trainwatch.rank import telemetry as api


def measure_record_ns(calls: int = 20000, batches: int = 15) -> float:
    path = str(new_home("overhead-record") / "seg")
    slots.create_segment(path, 1)
    seg = slots.Segment(path)
    tw = api.Telemetry(seg, 0, rank=0, world_size=1, restart=0, attached=True)
    tw.start_sampler()
    per_call = []
    for _ in range(batches):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            tw.step(loss=1.0, grad_norm=0.5)
        per_call.append((time.perf_counter_ns() - t0) / calls)
    tw.close()
    return statistics.median(per_call)


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    from trainwatch.trainer.config import MODEL_PRESETS
    from trainwatch.trainer.data import get_batch, load_corpus
    from trainwatch.trainer.model import GPT

    preset = MODEL_PRESETS[args.model_size]
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(GPT(preset).to(device), device_ids=[device] if cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    corpus = load_corpus()
    seg_path = os.path.join(out_path + ".d", "seg")
    tw = api.Telemetry(slots.Segment(seg_path), rank, rank=rank, world_size=world, restart=0, attached=True)

    def step(i: int, on: bool) -> None:
        x, y = get_batch(corpus, seed=0, step=i, rank=rank, batch_size=preset.batch_size, seq_len=preset.seq_len)
        x, y = x.to(device), y.to(device)
        if on:
            with tw.phase("data"):
                pass
            with tw.phase("forward"):
                _, loss = model(x, y)
            with tw.phase("backward"):
                opt.zero_grad(set_to_none=True)
                loss.backward()
            with tw.phase("optimizer"):
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
            tw.step(loss=float(loss.detach()), grad_norm=float(norm), step=i)
        else:
            _, loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            float(loss.detach()), float(norm)  # the same host reads the ON path does

    for i in range(args.warmup):
        step(i, i % 2 == 0)
    times = {True: [], False: []}
    i = args.warmup
    for pair in range(args.pairs):
        order = (True, False) if pair % 2 == 0 else (False, True)
        for on in order:
            if on:
                tw.start_sampler() if tw._sampler is None else None
            dist.barrier()
            for _ in range(args.block):
                t0 = time.perf_counter()
                step(i, on)
                times[on].append(time.perf_counter() - t0)
                i += 1
        if rank == 0:
            print(f"  pair {pair + 1}/{args.pairs}: on {statistics.median(times[True]) * 1e3:.2f} ms, "
                  f"off {statistics.median(times[False]) * 1e3:.2f} ms", file=sys.stderr, flush=True)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"on": times[True], "off": times[False]}, f)
    tw.close()
    dist.destroy_process_group()


def measure_step_ratio(args: argparse.Namespace) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(new_home("overhead-step") / "times.json")
    os.makedirs(out + ".d")
    slots.create_segment(os.path.join(out + ".d", "seg"), args.ranks)
    mp.start_processes(_rank_main, args=(args.ranks, port, args, out), nprocs=args.ranks, start_method="spawn")
    with open(out) as f:
        times = json.load(f)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    return {"step_ms_on": round(on * 1e3, 3), "step_ms_off": round(off * 1e3, 3), "ratio": on / off, "steps": len(times["on"])}


def measure_wrapper_ns(calls: int = 2000, batches: int = 9) -> float:
    """What trainwatch's wrapper adds to one blocking collective: a 4-float
    all_reduce on a one-rank gloo group, wrapped (counted, marked as a wait in
    the slot) against the same call unwrapped, interleaved batches."""
    import socket

    from trainwatch.rank import collectives

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    path = str(new_home("overhead-wrapper") / "seg")
    slots.create_segment(path, 1)
    tw = api.Telemetry(slots.Segment(path), 0, rank=0, world_size=1, restart=0, attached=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        collectives.install(tw)
        wrapped = dist.all_reduce
        raw = wrapped.__wrapped__
        t = torch.zeros(4)
        per_call: dict[bool, list[float]] = {True: [], False: []}
        for b in range(batches * 2):
            on = b % 2 == 0
            fn = wrapped if on else raw
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                fn(t)
            per_call[on].append((time.perf_counter_ns() - t0) / calls)
        return max(statistics.median(per_call[True]) - statistics.median(per_call[False]), 0.0)
    finally:
        tw.close()
        dist.destroy_process_group()


def _zero_code_run(launcher: str, ranks: int, steps: int) -> tuple[float, float, float]:
    """(median step s, CPU s per step summed over ranks, of which in trainwatch's
    threads) of one run of the collective-heavy script, each rank pinned to a CPU."""
    from pathlib import Path

    home = new_home("overhead")
    out = str(home / "times")
    script = str(ROOT / "benchmarks" / "scripts" / "collective_heavy.py")
    if launcher == "trainwatch":
        cmd = [str(BIN / "trainwatch"), "launch", "--nproc-per-node", str(ranks), "--job", "overhead", "--no-restart"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
    r = run_command([*cmd, script, "--steps", str(steps), "--out", out, "--pin"], home, env=env_for(home),
                    timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"{launcher} run failed: {r.stdout[-2000:]}{r.stderr[-2000:]}")
    per_rank = [json.loads(Path(f"{out}.rank{k}.json").read_text()) for k in range(ranks)]
    step_s = statistics.median(statistics.median(p["step_s"]) for p in per_rank)
    cpu = sum(p["cpu_s"] / len(p["step_s"]) for p in per_rank)
    tw_cpu = sum(p.get("trainwatch_cpu_s", 0.0) / len(p["step_s"]) for p in per_rank)
    return step_s, cpu, tw_cpu


def measure_zero_code(ranks: int, pairs: int, steps: int, wrapper_calls: int = 2000) -> dict:
    runs: dict[str, list[tuple[float, float, float]]] = {"trainwatch": [], "torchrun": []}
    for pair in range(pairs):
        order = ("trainwatch", "torchrun") if pair % 2 == 0 else ("torchrun", "trainwatch")
        for launcher in order:
            runs[launcher].append(_zero_code_run(launcher, ranks, steps))
        tw, tr = runs["trainwatch"][-1], runs["torchrun"][-1]
        print(f"  pair {pair + 1}/{pairs}: trainwatch {tw[0] * 1e3:.2f} ms/step, {tw[1] * 1e3:.2f} ms CPU; "
              f"torchrun {tr[0] * 1e3:.2f} ms/step, {tr[1] * 1e3:.2f} ms CPU", file=sys.stderr, flush=True)
    med = {k: (statistics.median(v[0] for v in vs), statistics.median(v[1] for v in vs)) for k, vs in runs.items()}
    # Ratios within a pair (two runs minutes apart at most), then their median:
    # on a shared machine the speed of whole runs drifts by tens of percent from
    # one minute to the next, which a ratio of two separate medians would keep.
    pairs_of = list(zip(runs["trainwatch"], runs["torchrun"]))
    pair_step = sorted(tw[0] / tr[0] for tw, tr in pairs_of)
    pair_cpu = sorted(tw[1] / tr[1] for tw, tr in pairs_of)
    print("  per collective: what trainwatch's wrapper adds ...", file=sys.stderr, flush=True)
    wrapper_ns = measure_wrapper_ns(calls=wrapper_calls)
    # The rank-side cost itself, free of that noise: the sampler thread's CPU
    # and ten wrapped collectives, per step of one rank.
    sampler_s = statistics.median(v[2] for v in runs["trainwatch"]) / ranks
    step_s = med["trainwatch"][0]
    return {
        "zero_code_rank_side_share": round((sampler_s + 10 * wrapper_ns * 1e-9) / step_s, 5),
        "zero_code_sampler_share": round(sampler_s / step_s, 5),
        "collective_wrapper_ns": round(wrapper_ns, 1),
        "zero_code_step_ratio": round(statistics.median(pair_step), 4),
        "zero_code_cpu_ratio": round(statistics.median(pair_cpu), 4),
        "zero_code_step_ratio_range": [round(pair_step[0], 3), round(pair_step[-1], 3)],
        "zero_code_cpu_ratio_range": [round(pair_cpu[0], 3), round(pair_cpu[-1], 3)],
        "zero_code_step_ms": {k: round(v[0] * 1e3, 3) for k, v in med.items()},
        "zero_code_cpu_ms_per_step": {k: round(v[1] * 1e3, 3) for k, v in med.items()},
        "zero_code_collectives_per_step": 10,
        "zero_code_pairs": pairs,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--model-size", default="small")
    p.add_argument("--pairs", type=int, default=12, help="ON/OFF block pairs")
    p.add_argument("--block", type=int, default=15, help="steps per block")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: one rank per GPU (ranks beyond the GPUs share them), NCCL")
    p.add_argument("--zero-code-pairs", type=int, default=8, help="trainwatch/torchrun run pairs (0 = skip)")
    p.add_argument("--zero-code-steps", type=int, default=400)
    p.add_argument("--skip-trainer", action="store_true", help="only the zero-code row")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args()
    if args.smoke:  # 1 rank of the tiny model, a block of 2 steps a side, one zero-code pair of 10 steps
        args.ranks, args.model_size, args.pairs, args.block, args.warmup = 1, "tiny", 1, 2, 1
        args.zero_code_pairs, args.zero_code_steps = 1, 10
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result: dict = {"ranks": args.ranks, "device": args.device}
    if not args.skip_trainer:
        print("measuring record cost ...", file=sys.stderr, flush=True)
        record_ns = measure_record_ns(*((200, 3) if args.smoke else ()))
        print(f"  record_ns = {record_ns:.0f}", file=sys.stderr, flush=True)
        print(f"measuring step overhead: {args.ranks} ranks, model {args.model_size}, "
              f"{args.pairs} interleaved pairs of {args.block}-step blocks ...", file=sys.stderr, flush=True)
        step = measure_step_ratio(args)
        result.update({
            "record_ns": round(record_ns, 1),
            "step_overhead_ratio": round(step["ratio"], 4),
            "step_ms_with": step["step_ms_on"],
            "step_ms_without": step["step_ms_off"],
            "steps_per_side": step["steps"],
            "model_size": args.model_size,
        })
    if args.zero_code_pairs > 0:
        print(f"zero-code: 10 collectives per step, trainwatch launch vs torchrun, {args.zero_code_pairs} pairs "
              f"of {args.zero_code_steps}-step runs ...", file=sys.stderr, flush=True)
        result.update(measure_zero_code(args.ranks, args.zero_code_pairs, args.zero_code_steps,
                                        100 if args.smoke else 2000))
    print(json.dumps(result))


if __name__ == "__main__":
    import common

    common.main(main)
