"""GPU check: every CUDA, NCCL and NVML path of trainwatch, and the trainer's MFU, in one command.

    python benchmarks/gpu_check.py [--only CHECK ...] [--out-dir DIR] [--total-s 470] [--device auto|cuda|cpu]
    make gpu-check

On a machine with NVIDIA GPUs it runs, each check in its own process with its
own time budget (a hung CUDA call or NCCL collective costs that check, never
the rest), in five groups:

  nvml        every GPU read through the hardware monitor (name, UUID, memory,
              utilisation, temperature, power, ECC, throttle reasons, Xid
              registration); `trainwatch doctor --json`'s GPU checks
  trainer     the integrated trainer on 1 GPU in bf16 and (transformer-engine
              importable, compute capability 8.9+) fp8: tokens/s and MFU
              (trainwatch.trainer.mfu); data parallel on every GPU over NCCL;
              the zero-code loss/grad-norm read adds no CUDA synchronisation
  nccl        `trainwatch launch` with NCCL: how many ranks NCCL allows here
              (one GPU: two ranks sharing it, else one), the flight recorder's
              sequence numbers and arrival times in the slot, a hang (emergency
              checkpoint of CUDA state, restart, bit-exact resume), a crash, a
              skipped collective and a straggler: detection latency and culprit
  warm_start  the zygote initialises no CUDA and its forked worker uses the GPU;
              restart time with and without the zygote
  overhead    `tw.step()` cost; DDP step time with / without trainwatch on GPU

Output: one JSON line per check on stdout,
{"check", "group", "status": "pass|fail|skip|timeout", "seconds", ...figures},
then one summary line {"summary": {...}}. Progress goes to stderr; each check's
own output is kept in --out-dir (<check>.log) and quoted in its line when it
fails. Exit 0 when nothing failed or timed out (always without a GPU: every
check is a skip that says why), 1 otherwise.

--device cpu rehearses the checks that can run without a GPU (gloo, the tiny
model, a fake NVML): for working on this script on a machine without one.

Installs nothing: it uses what this Python has (the project, and for fp8 its
`[gpu]` extra, transformer-engine).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # the other benchmarks' helpers: common, detection, overhead, recovery
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

STATUSES = ("pass", "fail", "skip", "timeout")
TOTAL_S = 470.0
"""All checks together, seconds: under 8 minutes on one H100 with room for start-up."""
KILL_GRACE_S = 5.0
"""Seconds between SIGTERM and SIGKILL for a check over its budget."""
REAP_S = 10.0
"""Seconds to wait for a killed check's launched jobs to go."""
MFU_TARGET = 0.45
"""The bf16 MFU the trainer's largest size is meant to reach on an H100."""
MFU_SIZE = "gpt3-1.3b"
"""The trainer's largest built-in size: the one MFU is measured on."""
FAULT_SIZE = "tiny"
"""Model of the fault and restart checks: they test trainwatch, not the model."""
SMOKE_CHECKS = ("nvml", "doctor", "deferred_sync", "nccl_ranks", "nccl_crash", "zygote_cuda", "overhead")
"""--smoke: one or two checks of every group, the quick ones."""
SMOKE_TOTAL_S = 300.0


class Skip(Exception):
    """The check cannot run here; the message says why."""


class Fail(Exception):
    """The check ran and something is wrong; the message says what."""


@dataclass(frozen=True, slots=True)
class Check:
    """One check: a function run in its own process under a time budget."""

    name: str
    """Its name in the output and in --only."""
    group: str
    """nvml, trainer, nccl, warm_start or overhead."""
    budget_s: float
    """Seconds it may take before its process is killed and it reports `timeout`."""
    fn: Callable[[Context], dict]
    """Runs in the check's process; returns figures (status pass unless it sets one), raises Skip or Fail."""
    cpu: bool = False
    """It can also run in the --device cpu rehearsal."""


@dataclass(slots=True)
class Context:
    """What every check's process knows about the machine (a JSON file between processes)."""

    device: str
    """'cuda' or 'cpu' (the rehearsal)."""
    gpus: list[dict] = field(default_factory=list)
    """NVML's GPUs: index, name, uuid, compute_capability."""
    work: str = ""
    """Scratch directory of this run."""
    deadline: float = 0.0
    """CLOCK_MONOTONIC time this check must end by (its budget)."""
    fault_ranks: int = 0
    """Ranks of the launched jobs: --ranks, else what nccl_ranks found (0: not known yet)."""
    shared_gpu: bool = False
    """Those ranks share GPUs (more ranks than GPUs)."""
    no_gpu: str = ""
    """Why the GPU checks skip ('' when they run)."""

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def remaining(self, reserve: float = 3.0) -> float:
        return max(1.0, self.deadline - time.monotonic() - reserve)

    @classmethod
    def load(cls, path: str) -> Context:
        with open(path) as f:
            return cls(**json.load(f))

    def save(self, path: str) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(asdict(self), f)
        os.replace(tmp, path)


CHECKS: list[Check] = []


def check(name: str, group: str, budget_s: float, *, cpu: bool = False):
    def register(fn: Callable[[Context], dict]) -> Callable[[Context], dict]:
        CHECKS.append(Check(name, group, budget_s, fn, cpu))
        return fn

    return register


# ---- helpers the checks share ------------------------------------------------------------


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def child_env(**extra: str) -> dict:
    """This environment without anything that would attach a process to a job."""
    out = {k: v for k, v in os.environ.items()
           if not k.startswith("TRAINWATCH_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    out.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    out.update(extra)
    return out


def run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """A command in this check's process group (killed with it on timeout)."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT), **kw)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise Fail(f"{' '.join(cmd[:6])} ... did not finish in {timeout:.0f} s; last output: {out[-600:]}") from None


def tail(text: str, n: int = 1200) -> str:
    return text[-n:] if text else ""


def trainer_args(ctx: Context, *args: str) -> list[str]:
    return ["-m", "trainwatch.trainer", "--device", ctx.device, *args]


STEP_LINE = re.compile(r"step (\d+)/(\d+) \| loss (\S+) \| lr \S+ \| step ([\d.]+)s \| (\d+) tok/s(?: \| mfu ([\d.]+)%)?")
MODEL_LINE = re.compile(r"trainer: model (\S+) \(([\d.]+)M params\) \| world (\d+)")
DONE_LINE = re.compile(r"done: steps \d+-\d+ \| first loss (\S+) \| final loss (\S+)")


def trainer_figures(out: str, ctx: Context, size: str, batch: int, seq_len: int, precision: str) -> dict:
    """Throughput and MFU from the trainer's log: its last window of steps (the
    first ones pay for start-up), MFU recomputed with trainwatch.trainer.mfu."""
    from trainwatch.trainer import mfu
    from trainwatch.trainer.config import MODEL_PRESETS

    windows = STEP_LINE.findall(out)
    model, done = MODEL_LINE.search(out), DONE_LINE.search(out)
    if not windows:
        raise Fail(f"the trainer printed no step line; output: {tail(out)}")
    step, _last, _loss, step_s, tok_s, logged_mfu = windows[-1]
    world = int(model.group(3)) if model else 1
    preset = MODEL_PRESETS[size]
    per_token = mfu.flops_per_token(preset, seq_len)
    name = ctx.gpus[0]["name"] if ctx.gpus else ""
    tokens_per_s = batch * seq_len * world / float(step_s)
    peak = mfu.peak_flops(name) if ctx.cuda else None
    fig = {
        "gpu": name or None, "precision": precision, "model_size": size,
        "params_m": float(model.group(2)) if model else round(mfu.param_count(preset) / 1e6, 2),
        "ranks": world, "batch_size": batch, "seq_len": seq_len, "measured_at_step": int(step),
        "step_s": float(step_s), "tokens_per_s": round(tokens_per_s, 1),
        "flops_per_token": per_token, "peak_bf16_tflops": None if peak is None else peak / 1e12,
        "mfu": _round(mfu.mfu(tokens_per_s, per_token, peak, world)),
        "mfu_trainer_log": float(logged_mfu) / 100 if logged_mfu else None,
    }
    if precision == "fp8" and ctx.cuda:
        fp8 = mfu.peak_flops(name, "fp8")
        fig["mfu_of_fp8_peak"] = _round(mfu.mfu(tokens_per_s, per_token, fp8, world))
    if done:
        first, final = float(done.group(1)), float(done.group(2))
        fig.update(first_loss=first, final_loss=final)
        if not (math.isfinite(final) and final < first):
            raise Fail(f"the loss did not fall ({first} -> {final})")
    return fig


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def need_cuda(ctx: Context) -> None:
    if not ctx.cuda:
        raise Skip(ctx.no_gpu or "needs a GPU")


def gpu_name(ctx: Context, index: int = 0) -> str:
    return ctx.gpus[index]["name"] if len(ctx.gpus) > index else "this GPU"


# ---- 1. NVML -----------------------------------------------------------------------------


@check("nvml", "nvml", 30, cpu=True)
def check_nvml(ctx: Context) -> dict:
    """Every GPU through the sidecar's hardware monitor: samples, Xid registration, metrics."""
    from prometheus_client import CollectorRegistry, generate_latest

    from trainwatch.watchdog.hardware import HardwareMonitor

    nvml = None
    if ctx.device == "cpu":
        from trainwatch.inject.fake_nvml import FakeNvml

        nvml = FakeNvml(gpu_count=1)  # the rehearsal: the same code against the fake driver
    klog = Path(ctx.work) / "nvml-kern.log"
    klog.write_text("")  # never the machine's kernel log: only NVML is under test here
    mon = HardwareMonitor(nproc=max(1, len(ctx.gpus)), kernel_log_path=str(klog), nvml=nvml, out=sys.stderr)
    try:
        if not mon.enabled:
            raise Fail("NVML did not start in the hardware monitor")
        mon.watcher.wait_ready(10)
        samples = mon.poller.sample()
        names = {g["index"]: g["name"] for g in ctx.gpus}

        reg = CollectorRegistry()

        class Collector:
            def collect(self):
                yield from mon.metrics("gpu-check", "node0")

        reg.register(Collector())
        text = generate_latest(reg).decode()
        gpus = [{"gpu": s.index, "name": names.get(s.index), "uuid": s.uuid, "pci": s.pci_bus_id,
                 "memory_total_gib": None if s.memory_total_bytes is None else round(s.memory_total_bytes / 2**30, 1),
                 "memory_used_gib": None if s.memory_used_bytes is None else round(s.memory_used_bytes / 2**30, 2),
                 "utilization_pct": s.utilization_pct, "temperature_c": s.temperature_c, "power_w": s.power_w,
                 "sm_clock_mhz": s.sm_clock_mhz, "throttle_reasons": s.throttle_reasons,
                 "ecc_volatile": [s.ecc_volatile_corrected, s.ecc_volatile_uncorrected],
                 "ecc_aggregate": [s.ecc_aggregate_corrected, s.ecc_aggregate_uncorrected],
                 "remapped_rows": [s.remapped_rows_correctable, s.remapped_rows_uncorrectable, s.remapped_rows_pending,
                                   s.remapped_rows_failure]} for s in samples]
        fig = {"gpus": gpus, "xid_registered_gpus": mon.watcher.registered_gpus,
               "metric_series": sum(1 for line in text.splitlines() if line.startswith("trainwatch_gpu_")),
               "gpu_of_local_rank": mon.gpu_of_local_rank, "fake_nvml": nvml is not None}
        # Identity and memory always; of the sensors, a GPU may lack some (utilisation
        # under MIG, power on some boards), never all of them.
        missing = [f"GPU {g['gpu']}: {k}" for g in gpus for k in ("uuid", "memory_total_gib") if g[k] is None]
        missing += [f"GPU {g['gpu']}: no sensor (utilisation, temperature, power)" for g in gpus
                    if g["utilization_pct"] is None and g["temperature_c"] is None and g["power_w"] is None]
        fig["unsupported"] = sorted({k for g in gpus for k, v in g.items() if v is None and k != "name"})
        if len(samples) != max(1, len(ctx.gpus)):
            missing.append(f"{len(samples)} samples for {len(ctx.gpus)} GPUs")
        if "trainwatch_gpu_memory_total_bytes" not in text:
            missing.append("no trainwatch_gpu_memory_total_bytes series")
        if missing:
            raise Fail("unread: " + "; ".join(missing))
        return fig
    finally:
        mon.close()


@check("doctor", "nvml", 30, cpu=True)
def check_doctor(ctx: Context) -> dict:
    """`trainwatch doctor --json`: the GPU list from NVML and its GPU checks."""
    p = run([sys.executable, "-m", "trainwatch.cli", "doctor", "--json", "--nproc-per-node", str(max(1, len(ctx.gpus)))],
            ctx.remaining(), env=child_env())
    try:
        report = json.loads(p.stdout)
    except ValueError:
        raise Fail(f"doctor --json printed no JSON (exit {p.returncode}): {tail(p.stdout + p.stderr)}") from None
    checks = {c.get("id"): c for c in report.get("checks", [])}
    count, nvls = checks.get("gpu-count", {}), checks.get("nccl-nvls", {})
    fig = {"exit": p.returncode, "gpu_count": count.get("verdict"), "gpu_count_message": count.get("message"),
           "nccl_nvls": nvls.get("verdict"), "nccl_nvls_message": nvls.get("message"),
           "failed": sorted(k for k, c in checks.items() if c.get("verdict") == "fail"),
           "warned": sorted(k for k, c in checks.items() if c.get("verdict") == "warn")}
    want = "ok" if ctx.gpus else "skip"
    if count.get("verdict") != want:
        raise Fail(f"gpu-count is {count.get('verdict')!r} ({count.get('message')}), expected {want!r}")
    if ctx.gpus and (count.get("evidence") or {}).get("nvml_gpus") != len(ctx.gpus):
        raise Fail(f"doctor saw {(count.get('evidence') or {}).get('nvml_gpus')} GPUs, NVML {len(ctx.gpus)}")
    return fig


# ---- 2. the integrated trainer --------------------------------------------------------------


def train_on_one_gpu(ctx: Context, precision: str, steps: int) -> dict:
    """The trainer as one plain process; on CUDA out of memory, once more with half the batch."""
    from trainwatch.trainer.config import MODEL_PRESETS

    size = MFU_SIZE if ctx.cuda else "tiny"
    preset = MODEL_PRESETS[size]
    batch, seq_len = preset.batch_size, preset.seq_len
    if not ctx.cuda:
        steps = 10
    oom_at = None
    while True:
        cmd = [sys.executable, *trainer_args(ctx, "--precision", precision, "--model-size", size, "--batch-size",
                                             str(batch), "--max-steps", str(steps), "--log-interval", "10",
                                             "--resume", "never")]
        p = run(cmd, ctx.remaining(), env=child_env())
        out = p.stdout + p.stderr
        if p.returncode != 0 and "out of memory" in out and batch > 1 and oom_at is None:
            oom_at, batch = batch, batch // 2
            log(f"  out of memory at batch {oom_at}; again with {batch}")
            continue
        if p.returncode != 0:
            raise Fail(f"the trainer exited {p.returncode}: {tail(out)}")
        fig = trainer_figures(out, ctx, size, batch, seq_len, precision)
        fig["oom_at_batch"] = oom_at
        return fig


@check("trainer_bf16", "trainer", 120, cpu=True)
def check_trainer_bf16(ctx: Context) -> dict:
    """bf16 on one GPU, the largest size: tokens/s and MFU against the GPU's bf16 peak."""
    fig = train_on_one_gpu(ctx, "bf16", 30)
    if ctx.cuda:
        fig["mfu_target"] = MFU_TARGET
        fig["mfu_target_met"] = None if fig["mfu"] is None else fig["mfu"] >= MFU_TARGET
    return fig


@check("trainer_fp8", "trainer", 110)
def check_trainer_fp8(ctx: Context) -> dict:
    """fp8 (transformer-engine's Linear layers) on one GPU, where it imports and the GPU has fp8."""
    need_cuda(ctx)
    cc = ctx.gpus[0].get("compute_capability") if ctx.gpus else None
    if cc and tuple(cc) < (8, 9):
        raise Skip(f"fp8 needs compute capability 8.9 or newer; {gpu_name(ctx)} is {cc[0]}.{cc[1]}")
    p = run([sys.executable, "-c", "import transformer_engine.pytorch as te; import transformer_engine; "
             "print(transformer_engine.__version__)"], min(90.0, ctx.remaining()), env=child_env())
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["?"])[-1]
        raise Skip(f"transformer-engine does not import ({last[:200]}); pip install -e '.[gpu]'")
    fig = train_on_one_gpu(ctx, "fp8", 20)
    fig["transformer_engine"] = p.stdout.strip()
    return fig


@check("trainer_nccl", "trainer", 110)
def check_trainer_nccl(ctx: Context) -> dict:
    """Data parallel over NCCL on every GPU under `trainwatch launch`, bf16."""
    need_cuda(ctx)
    if len(ctx.gpus) < 2:
        raise Skip("one GPU: data parallel over NCCL needs two (the nccl_* checks run NCCL on this one)")
    from common import finish, launch, new_home, reap
    from trainwatch.trainer.config import MODEL_PRESETS

    preset = MODEL_PRESETS[MFU_SIZE]
    # No checkpoint directory: throughput without the per-step CPU copy of the
    # 1.2B model's state that emergency checkpoints stage (a figure of its own).
    os.environ["TRAINWATCH_CKPT_DIR"] = ""
    home, job = new_home("gpu-dp"), "gpu-dp"
    proc = launch(home, "--nproc-per-node", str(len(ctx.gpus)), "--job", job,
                  *trainer_args(ctx, "--precision", "bf16", "--model-size", MFU_SIZE, "--max-steps", "30",
                                "--log-interval", "10", "--resume", "never", "--ckpt-interval", "1000000"))
    out = finish(proc, ctx.remaining(10))
    reap(proc, home, job)
    if proc.returncode != 0:
        raise Fail(f"trainwatch launch exited {proc.returncode}: {tail(out)}")
    return trainer_figures(out, ctx, MFU_SIZE, preset.batch_size, preset.seq_len, "bf16")


DEFERRED_PROBE = r'''
import json, time, warnings
import torch
import trainwatch
from trainwatch.rank import bootstrap
from trainwatch.trainer.config import MODEL_PRESETS
from trainwatch.trainer.model import GPT

torch.cuda.set_device(0)
preset = MODEL_PRESETS["gpt2-125m"]
torch.manual_seed(0)
model = GPT(preset).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
x = torch.randint(0, 256, (preset.batch_size, preset.seq_len), device="cuda")
y = torch.randint(0, 256, (preset.batch_size, preset.seq_len), device="cuda")

def steps(n):
    for _ in range(n):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # looked up each call: the hook wraps it
        opt.step()
        opt.zero_grad(set_to_none=True)

def measure(n):
    """(synchronisations torch reports while n steps are queued, seconds per step)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        steps(n)
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / n
    return sum("synchroniz" in str(w.message) for w in caught), dt

steps(3)
plain, plain_s = measure(20)
tw = trainwatch.init()
bootstrap.install_zero_code(tw)
steps(3)
hooked, hooked_s = measure(20)
torch.cuda.synchronize()
steps(1)  # one more step reads the copies queued before
print(json.dumps({"syncs_without": plain, "syncs_with": hooked, "step_ms_without": plain_s * 1e3,
                  "step_ms_with": hooked_s * 1e3, "loss_read": tw._loss, "grad_norm_read": tw._grad_norm,
                  "steps_recorded": tw.current_step}))
'''


@check("deferred_sync", "trainer", 60)
def check_deferred_sync(ctx: Context) -> dict:
    """The zero-code hooks read the GPU loss and grad norm without one synchronisation
    (torch's sync debug mode counts every cudaStreamSynchronize-style call)."""
    need_cuda(ctx)
    p = run([sys.executable, "-c", DEFERRED_PROBE], ctx.remaining(), env=child_env())
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        raise Fail(f"the probe exited {p.returncode}: {tail(p.stdout + p.stderr)}")
    r = json.loads(lines[-1])
    fig = {"extra_syncs_per_20_steps": r["syncs_with"] - r["syncs_without"], "syncs_without_hooks": r["syncs_without"],
           "step_ms_with_hooks": round(r["step_ms_with"], 3), "step_ms_without_hooks": round(r["step_ms_without"], 3),
           "step_ratio": round(r["step_ms_with"] / r["step_ms_without"], 4), "loss_read": r["loss_read"],
           "grad_norm_read": r["grad_norm_read"], "steps_recorded": r["steps_recorded"]}
    if fig["extra_syncs_per_20_steps"] > 0:
        raise Fail(f"the hooks added {fig['extra_syncs_per_20_steps']} synchronisations in 20 steps")
    if not (isinstance(r["loss_read"], float) and math.isfinite(r["loss_read"])):
        raise Fail(f"no loss was read from the GPU (got {r['loss_read']})")
    return fig


# ---- 3. NCCL faults under trainwatch launch ---------------------------------------------------


@check("nccl_ranks", "nccl", 60)
def check_nccl_ranks(ctx: Context) -> dict:
    """How many ranks the launched checks use: every GPU; on one GPU two ranks
    sharing it if NCCL allows (it refuses two ranks of a communicator on one GPU), else one."""
    need_cuda(ctx)
    if ctx.fault_ranks:
        raise Skip(f"--ranks {ctx.fault_ranks} given")
    tried = []
    for ranks in ([len(ctx.gpus)] if len(ctx.gpus) > 1 else [2, 1]):
        try:
            p = run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                     str(HERE / "scripts" / "nccl_probe.py")], min(45.0, ctx.remaining()), env=child_env())
        except Fail as e:  # NCCL may hang instead of refusing: that is a refusal too
            tried.append({"ranks": ranks, "why": str(e)[:300]})
            continue
        lines = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
        if p.returncode == 0 and len(lines) == ranks:
            return {"ranks": ranks, "shared_gpu": ranks > max(1, len(ctx.gpus)), "nccl": lines[0].get("nccl"),
                    "init_s": max(r["seconds"] for r in lines), "refused": tried,
                    "provides": {"fault_ranks": ranks, "shared_gpu": ranks > max(1, len(ctx.gpus))}}
        why = next((line.strip() for line in (p.stdout + p.stderr).splitlines()
                    if "Duplicate GPU" in line or "NCCL error" in line or "Error" in line), f"exit {p.returncode}")
        tried.append({"ranks": ranks, "why": why[:300]})
        log(f"  NCCL with {ranks} ranks: {why[:200]}")
    raise Fail(f"no NCCL all_reduce worked: {tried}")


def fault_ranks(ctx: Context, minimum: int = 1) -> tuple[int, int]:
    """(ranks, culprit): the culprit is the last rank."""
    ranks = ctx.fault_ranks or (1 if ctx.cuda else 2)
    if ranks < minimum:
        raise Skip(f"needs {minimum} ranks; the launched jobs have {ranks} here (one GPU NCCL would not share, "
                   "or --ranks)")
    return ranks, ranks - 1


def fault_workload(ctx: Context) -> list[str]:
    return trainer_args(ctx, "--model-size", FAULT_SIZE, "--max-steps", "100000", "--log-interval", "100000")


def run_fault_check(ctx: Context, name: str, spec: str, kind: str, culprit: int, ranks: int, on_detected=None) -> dict:
    from detection import run_fault

    r = run_fault(f"gpu-{name}", spec, kind, ranks, ctx.remaining(15), culprit=culprit,
                  workload=fault_workload(ctx), on_detected=on_detected, poll=False)
    fig = {"ranks": ranks, "shared_gpu": ctx.shared_gpu, "fault": spec, "detected": r["detected"],
           "culprit_ranks": r.get("culprit_ranks"), "culprit_ok": r["culprit_ok"], "latency_s": r["latency_s"],
           "summary": r.get("summary")}
    if "extra" in r:
        fig.update(r["extra"])
    if not r["detected"]:
        raise Fail(f"no {kind} incident within the budget")
    if not r["culprit_ok"]:
        raise Fail(f"culprit {r.get('culprit_ranks')}, expected [{culprit}]")
    return fig


@check("nccl_flight_recorder", "nccl", 75, cpu=True)
def check_nccl_flight_recorder(ctx: Context) -> dict:
    """The flight recorder's sequence numbers and arrival times reach every rank's slot."""
    from common import job_json, launch, new_home, reap, stop, wait_for
    from trainwatch import slots, state

    ranks, _culprit = fault_ranks(ctx)
    os.environ["TORCH_NCCL_ENABLE_TIMING"] = "1"  # arrival = the collective's start on the device
    home, job = new_home("gpu-fr"), "gpu-fr"
    proc = launch(home, "--nproc-per-node", str(ranks), "--job", job, *fault_workload(ctx))
    try:
        seen: list[dict] = []

        def published():
            path = job_json(home, job).get("slots")
            if not path or not os.path.exists(path):
                return None
            seg = slots.Segment(path)
            try:
                table = seg.read_table()
            finally:
                seg.close()
            rows = table[table["pid"] != 0]
            seen[:] = [{k: int(r[k]) for k in ("rank", "step", "fr_ok", "ngroups", "arrival_source", "narrivals")}
                       for r in rows]
            if len(rows) == ranks and (rows["step"] >= 20).all() and (rows["narrivals"] > 0).all() \
                    and (rows["fr_ok"] == 1).all():
                return list(rows)
            return None

        rows = wait_for(published, ctx.remaining(15), 0.5)
        if rows is None:
            path = job_json(home, job).get("slots")
            raise Fail(f"not every rank published flight-recorder sequence numbers and arrivals (step >= 20, "
                       f"fr_ok 1, narrivals > 0) within the budget; last read of segment {path}: {seen}")
        source = {slots.ARRIVAL_ENQUEUED: "enqueued", slots.ARRIVAL_STARTED: "started"}
        per_rank = []
        for r in rows:
            groups = [{"pg": int(g["pg"]), "enqueued": int(g["enqueued"]), "completed": int(g["completed"])}
                      for g in r["groups"][: int(r["ngroups"])]]
            arrivals = sorted((int(a["seq"]), int(a["t_ns"])) for a in r["arrivals"] if a["seq"] > 0)
            per_rank.append({"rank": int(r["rank"]), "step": int(r["step"]), "groups": groups,
                             "arrival_source": source.get(int(r["arrival_source"]), int(r["arrival_source"])),
                             "arrivals": len(arrivals), "last_arrival_seq": arrivals[-1][0] if arrivals else None})
        # The sidecar's own NVML samples of the job's GPUs (what `diagnose` reads).
        gpus = wait_for(lambda: (state.JobDir(job, root=home).telemetry().get("gpus") or {}).get("samples"),
                        10 if ctx.cuda else 0.1, 0.5)
        sidecar_gpus = state.JobDir(job, root=home).telemetry().get("gpus")
    finally:
        stop(proc)
        reap(proc, home, job)
    bad = [p["rank"] for p in per_rank if not p["groups"] or p["groups"][0]["completed"] <= 0]
    if bad:
        raise Fail(f"ranks {bad} published no completed collective sequence number")
    fig = {"ranks": ranks, "per_rank": per_rank, "sidecar_gpus": sidecar_gpus}
    if ctx.cuda and not (gpus and all(g.get("local_rank") is not None for g in gpus[:ranks])):
        raise Fail(f"the sidecar's telemetry.json has no NVML sample of the job's GPUs: {sidecar_gpus}")
    return fig


@check("nccl_hang_resume", "nccl", 160, cpu=True)
def check_nccl_hang_resume(ctx: Context) -> dict:
    """A rank hangs (the others wait in the NCCL collective): detected, culprit named,
    emergency checkpoint of the CUDA state, restart, resumed bit for bit."""
    from common import events, faults_fired, new_home
    from recovery import final_weights, run as run_job

    import torch

    ranks, culprit = fault_ranks(ctx)
    # With one rank nobody waits in a collective, and a rank spinning in compute
    # that nobody waits on gets a long allowance: there the hang is a stuck DataLoader.
    where = "compute" if ranks > 1 else "dataloader"
    args = trainer_args(ctx, "--model-size", FAULT_SIZE, "--max-steps", "40", "--ckpt-interval", "10",
                        "--log-interval", "100000", "--deterministic")
    ref_home = new_home("gpu-ref")
    code, out = run_job(ref_home, "gpu-ref", ranks, *args)
    if code != 0:
        raise Fail(f"the uninterrupted run exited {code}: {tail(out)}")
    ref_step, ref = final_weights(ref_home, "gpu-ref")
    spec = f"hang:where={where},rank={culprit},step=15"
    home, job = new_home("gpu-hang"), "gpu-hang"
    code, out = run_job(home, job, ranks, "--inject", spec, *args)
    found = events(home, job)
    hang = next((e for e in found if e["kind"] in ("hang", "collective_mismatch")), None)
    restart = next((e for e in found if e["kind"] == "restart"), None)
    fired = faults_fired(home, job)
    step, weights = final_weights(home, job)
    bitwise = bool(weights is not None and ref is not None and weights.keys() == ref.keys()
                   and all(torch.equal(weights[k], ref[k]) for k in ref))
    ckpt = (hang or {}).get("checkpoint")
    ev = (restart or {}).get("evidence") or {}
    fig = {"ranks": ranks, "fault": spec, "exit": code, "detected": hang is not None,
           "incident": (hang or {}).get("kind"), "culprit_ranks": (hang or {}).get("culprit_ranks"),
           "latency_s": round(hang["detected_mono"] - fired[0]["mono"], 3) if hang and fired else None,
           "emergency_checkpoint": ckpt, "restarted": restart is not None,
           "resumed_from_step": ev.get("resumed_from_step"), "steps_lost": ev.get("steps_lost"),
           "recovery_s": ev.get("recovery_s"), "final_step": step, "reference_step": ref_step, "bitwise_equal": bitwise}
    if hang is None:
        raise Fail(f"no hang incident (exit {code}): {tail(out)}")
    if hang.get("culprit_ranks") != [culprit]:
        raise Fail(f"culprit {hang.get('culprit_ranks')}, expected [{culprit}]")
    if restart is None or code != 0:
        raise Fail(f"no restart to the end (exit {code}): {tail(out)}")
    if not bitwise:
        raise Fail(f"resumed weights differ from the uninterrupted run's (steps {step} vs {ref_step})")
    return fig


@check("nccl_crash", "nccl", 75, cpu=True)
def check_nccl_crash(ctx: Context) -> dict:
    """A rank dies mid-training: the crash incident names it."""
    ranks, culprit = fault_ranks(ctx)
    return run_fault_check(ctx, "crash", f"crash:rank={culprit},step=8", "crash", culprit, ranks)


@check("nccl_mismatch", "nccl", 75, cpu=True)
def check_nccl_mismatch(ctx: Context) -> dict:
    """A rank skips one logging all_reduce: the collective mismatch names it, before anything hangs."""
    ranks, culprit = fault_ranks(ctx, 2)
    return run_fault_check(ctx, "mismatch", f"hang:where=collective_skip,rank={culprit},step=8",
                           "collective_mismatch", culprit, ranks)


@check("nccl_in_process", "nccl", 60)
def check_nccl_in_process(ctx: Context) -> dict:
    """In-process recovery's NCCL path on one rank: the request aborts the communicators, the
    next collective fails, the group is formed again on NCCL and the staged step agreed by a
    device all-gather (a hung peer needs two GPUs; the launched nccl_mismatch check covers it there)."""
    need_cuda(ctx)
    import tempfile

    from trainwatch import slots
    from trainwatch.netbind import free_port

    with tempfile.TemporaryDirectory() as scratch:
        seg = os.path.join(scratch, "r.slots")
        slots.create_segment(seg, 1)
        p = run([sys.executable, str(HERE / "scripts" / "inprocess_nccl.py"), str(free_port()), seg],
                min(45.0, ctx.remaining()), env=child_env())
    lines = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        raise Fail(f"exit {p.returncode}: {tail(p.stdout + p.stderr)}")
    out = lines[-1]
    if out["error"] is None or out["step"] != 12 or out["restored"] != [12] or out["sum"] != [3.0, 3.0] \
            or out["done"] != [7, 12] or out["backend"] != "nccl":
        raise Fail(f"in-process recovery on NCCL did not complete: {out}")
    return out


@check("nccl_straggler", "nccl", 90, cpu=True)
def check_nccl_straggler(ctx: Context) -> dict:
    """A rank 0.3 s late every step: the straggler, by collective arrival order where NCCL reports it."""
    from common import events

    ranks, culprit = fault_ranks(ctx, 2)

    def source(home, job):
        found = [e for e in events(home, job) if e["kind"] == "straggler"]
        return {"evidence_source": (found[0].get("evidence") or {}).get("source")} if found else {}

    return run_fault_check(ctx, "straggler", f"straggler:delay=0.3,rank={culprit},step=5", "straggler", culprit,
                           ranks, on_detected=source)


# ---- 4. warm start --------------------------------------------------------------------------


CUDA_TOUCH = "import torch\nx = torch.ones(1024, device='cuda')\nprint('cuda sum', float(x.sum()), flush=True)\n"


@check("zygote_cuda", "warm_start", 60, cpu=True)
def check_zygote_cuda(ctx: Context) -> dict:
    """The zygote preloads the trainer's imports without creating a CUDA context, and
    a worker it forks uses the GPU."""
    from trainwatch.launcher import warmstart

    script = Path(ctx.work) / "cuda_touch.py"
    script.write_text(CUDA_TOUCH if ctx.cuda else "print('cuda sum', 1024.0, flush=True)\n")
    out = Path(ctx.work) / "cuda_touch.out"
    z = warmstart.Zygote(warmstart.entry_imports("trainwatch.trainer", module=True), ["-m", "trainwatch.trainer"])
    z.start()
    try:
        ready = z.wait_ready(ctx.remaining(20))
        if ready is None:
            raise Fail("the zygote never said it was ready")
        contexts = cuda_context_pids() if ctx.cuda else []
        fig = {"cuda_initialized": ready.cuda_initialized, "import_s": ready.import_s,
               "preloaded": len(ready.preloaded), "zygote_in_nvml_processes": z.proc.pid in contexts}
        if ready.cuda_initialized or fig["zygote_in_nvml_processes"]:
            raise Fail(f"the zygote created a CUDA context before forking ({fig})")
        t0 = time.monotonic()
        pid = z.fork([str(script)], child_env(), str(out), str(out))
        code = z.wait_exit(pid, ctx.remaining(5))
        fig.update(worker_exit=code, worker_s=round(time.monotonic() - t0, 3))
        text = out.read_text() if out.exists() else ""
        if code != 0 or "cuda sum 1024.0" not in text:
            raise Fail(f"the forked worker could not use the GPU (exit {code}): {tail(text)}")
        return fig
    finally:
        z.close()


def cuda_context_pids() -> list[int]:
    """Processes NVML lists as holding a CUDA context on any GPU (host pids)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            pids = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                pids += [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
            return pids
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - a figure, not the check's verdict
        return []


@check("warm_restart", "warm_start", 150, cpu=True)
def check_warm_restart(ctx: Context) -> dict:
    """One crash and restart with the zygote, one without: time back to training."""
    from common import events, new_home
    from recovery import run as run_job

    ranks, culprit = fault_ranks(ctx)
    args = trainer_args(ctx, "--model-size", FAULT_SIZE, "--max-steps", "30", "--ckpt-interval", "5",
                        "--log-interval", "100000")
    fig: dict = {"ranks": ranks}
    for warm in (True, False):
        home, job = new_home("gpu-warm"), f"gpu-{'warm' if warm else 'cold'}"
        code, out = run_job(home, job, ranks, "--inject", f"crash:rank={culprit},step=8",
                            *([] if warm else ["--no-warm-start"]), *args)
        restart = next((e for e in events(home, job) if e["kind"] == "restart"), None)
        timing = json.loads((home / "jobs" / job / "control" / "restart-timing.json").read_text()) \
            if (home / "jobs" / job / "control" / "restart-timing.json").exists() else {}
        key = "warm" if warm else "cold"
        ev = (restart or {}).get("evidence") or {}
        fig[f"recovery_s_{key}"] = ev.get("recovery_s")
        fig[f"load_s_{key}"] = (ev.get("breakdown") or {}).get("load_s")
        fig[f"forked_{key}"] = timing.get("warm")
        if code != 0 or restart is None:
            raise Fail(f"the {key} run did not restart to the end (exit {code}): {tail(out)}")
        if timing.get("warm") is not warm:
            raise Fail(f"the {key} run's workers were {'forked' if timing.get('warm') else 'started cold'}")
    if fig["recovery_s_warm"] and fig["recovery_s_cold"]:
        fig["recovery_ratio_warm_to_cold"] = round(fig["recovery_s_warm"] / fig["recovery_s_cold"], 3)
    return fig


# ---- 5. telemetry overhead --------------------------------------------------------------------


@check("overhead", "overhead", 100, cpu=True)
def check_overhead(ctx: Context) -> dict:
    """tw.step() cost, and DDP step time with / without trainwatch's instrumentation on the GPUs."""
    import overhead

    record_ns = overhead.measure_record_ns(calls=20000, batches=5)
    ranks = max(1, len(ctx.gpus)) if ctx.cuda else 2
    args = argparse.Namespace(ranks=ranks, model_size="gpt2-125m" if ctx.cuda else "tiny", pairs=6, block=10,
                              warmup=5, device=ctx.device)
    step = overhead.measure_step_ratio(args)
    return {"record_ns": round(record_ns, 1), "step_overhead_ratio": round(step["ratio"], 4),
            "step_ms_with": step["step_ms_on"], "step_ms_without": step["step_ms_off"], "ranks": ranks,
            "model_size": args.model_size, "steps_per_side": step["steps"]}


# ---- the runner -------------------------------------------------------------------------------


def probe(device: str) -> Context:
    """What this machine offers, without initialising CUDA here: NVML's GPUs, then
    whether this Python's torch can use them (asked in a subprocess)."""
    if device == "cpu":
        return Context(device="cpu", no_gpu="--device cpu: a rehearsal without a GPU")
    from trainwatch.launcher.preflight import read_gpus

    gpus, reason = read_gpus()
    if not gpus:
        return Context(device="none", no_gpu=reason or "no GPU: NVML sees none")
    listed = [{"index": g.index, "name": g.name, "uuid": g.uuid,
               "compute_capability": list(g.compute_capability) if g.compute_capability else None} for g in gpus]
    code = ("import json, torch; print(json.dumps({'cuda': torch.cuda.is_available(), 'count': torch.cuda.device_count(),"
            " 'torch': torch.__version__, 'cuda_version': torch.version.cuda}))")
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=child_env())
        info = json.loads(p.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError) as e:
        return Context(device="none", gpus=listed, no_gpu=f"torch cannot be asked about CUDA ({type(e).__name__})")
    if not info["cuda"]:
        return Context(device="none", gpus=listed,
                       no_gpu=f"torch {info['torch']} cannot use the GPU (CUDA build: {info['cuda_version']})")
    return Context(device="cuda", gpus=listed)


def nvml_only(check_: Check) -> bool:
    return check_.group == "nvml"


def plan(ctx: Context, only: list[str] | None) -> list[tuple[Check, str | None]]:
    """Every check with the reason it skips (None: it runs)."""
    out = []
    for c in CHECKS:
        if only and c.name not in only:
            continue
        reason = None
        if ctx.device == "none" and not (nvml_only(c) and ctx.gpus):
            reason = ctx.no_gpu
        elif ctx.device == "cpu" and not c.cpu:
            reason = "needs a GPU (--device cpu rehearsal)"
        out.append((c, reason))
    return out


def kill_sessions(path: Path) -> None:
    """End what a check launched in sessions of its own (trainwatch launch), then
    reap those jobs the way `trainwatch jobs` does (a launcher killed outright
    leaves its shared-memory segment and scrape target behind) and remove their homes."""
    try:
        launched = [line.split(" ", 1) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return
    for pid, _home in launched:
        try:
            os.killpg(int(pid), signal.SIGKILL)
        except (ProcessLookupError, PermissionError, ValueError):
            pass
    import shutil

    from common import reap_home, wait_for

    for _pid, home in launched:
        # Retried until the killed launcher's lock is released, as it is once it is gone.
        wait_for(lambda: reap_home(Path(home)), REAP_S, 0.3)
        shutil.rmtree(home, ignore_errors=True)  # the check's process, killed, could not


def run_check(c: Check, ctx: Context, ctx_path: Path, out_dir: Path, budget_s: float,
              command: list[str] | None = None) -> dict:
    """Run one check in its own process group under `budget_s`; its result line."""
    result_path, log_path = out_dir / f"{c.name}.json", out_dir / f"{c.name}.log"
    sessions = out_dir / f"{c.name}.sessions"
    for p in (result_path, sessions):
        p.unlink(missing_ok=True)
    ctx.deadline = time.monotonic() + budget_s
    ctx.save(str(ctx_path))
    cmd = command or [sys.executable, str(Path(__file__).resolve()), "--run-check", c.name, "--context", str(ctx_path),
                      "--result", str(result_path)]
    env = dict(os.environ, TRAINWATCH_BENCH_SESSIONS=str(sessions), PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=str(ROOT), start_new_session=True)
        timed_out = False
        try:
            proc.wait(budget_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(KILL_GRACE_S)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        finally:
            kill_sessions(sessions)
            try:  # whatever is left of its group (grandchildren after the check's own exit)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    seconds = round(time.monotonic() - t0, 2)
    line: dict = {"check": c.name, "group": c.group}
    if timed_out:
        line.update(status="timeout", seconds=seconds, reason=f"over its {budget_s:.0f} s budget")
    else:
        try:
            got = json.loads(result_path.read_text())
        except (OSError, ValueError):
            got = {"status": "fail", "reason": f"the check's process exited {proc.returncode} with no result"}
        line.update(status=got.pop("status", "fail"), seconds=seconds, **got)
    if line["status"] in ("fail", "timeout"):
        try:
            line["log_tail"] = tail(log_path.read_text(errors="replace"), 2000)
        except OSError:
            pass
    return line


def child(args: argparse.Namespace) -> int:
    """In a check's own process: run it, write its result."""
    ctx = Context.load(args.context)
    c = next(c for c in CHECKS if c.name == args.run_check)
    try:
        figures = c.fn(ctx) or {}
        result = {"status": figures.pop("status", "pass"), **figures}
    except Skip as e:
        result = {"status": "skip", "reason": str(e)}
    except Fail as e:
        result = {"status": "fail", "reason": str(e)}
    except Exception as e:  # noqa: BLE001 - a check's bug is that check's failure, with its traceback in the log
        traceback.print_exc()
        result = {"status": "fail", "reason": f"{type(e).__name__}: {str(e)[:500]}"}
    tmp = f"{args.result}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, default=str)
    os.replace(tmp, args.result)
    return 0


def finite(value):
    """NaN and infinities as null: every line stays strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


KEY_FIGURES = {
    "trainer_bf16": ("tokens_per_s", "mfu", "batch_size"),
    "trainer_fp8": ("tokens_per_s", "mfu", "mfu_of_fp8_peak"),
    "trainer_nccl": ("ranks", "tokens_per_s", "mfu"),
    "deferred_sync": ("extra_syncs_per_20_steps", "step_ratio"),
    "nccl_ranks": ("ranks", "shared_gpu"),
    "nccl_hang_resume": ("latency_s", "culprit_ranks", "bitwise_equal", "recovery_s"),
    "nccl_crash": ("latency_s", "culprit_ok"),
    "nccl_mismatch": ("latency_s", "culprit_ok"),
    "nccl_straggler": ("latency_s", "culprit_ok", "evidence_source"),
    "warm_restart": ("recovery_s_warm", "recovery_s_cold"),
    "overhead": ("record_ns", "step_overhead_ratio"),
}
"""The figures the summary repeats, per check (the lines have them all)."""


def summarise(lines: list[dict], ctx: Context, wall_s: float) -> dict:
    counts = {s: sum(1 for r in lines if r["status"] == s) for s in STATUSES}
    by = {r["check"]: r for r in lines}
    bf16 = by.get("trainer_bf16", {})
    figures = {name: {k: by[name].get(k) for k in keys} for name, keys in KEY_FIGURES.items()
               if by.get(name, {}).get("status") in ("pass", "fail")}
    return {"device": ctx.device, "gpus": [g["name"] for g in ctx.gpus], "seconds": round(wall_s, 1), **counts,
            "failed": [r["check"] for r in lines if r["status"] in ("fail", "timeout")],
            "mfu_bf16": bf16.get("mfu"), "mfu_target_met": bf16.get("mfu_target_met"), "figures": figures,
            "no_gpu": ctx.no_gpu or None}


def run_all(checks: list[tuple[Check, str | None]], ctx: Context, out_dir: Path, total_s: float,
            emit: Callable[[dict], None], command_for: Callable[[Check], list[str] | None] = lambda c: None,
            ) -> list[dict]:
    """Run the planned checks in order under one overall deadline; emit each line.
    command_for: a check's process command instead of this script's (tests)."""
    ctx_path = out_dir / "context.json"
    ctx.work = str(out_dir)
    end = time.monotonic() + total_s
    lines = []
    for c, reason in checks:
        # What a check may use: the time left less what ending it may take.
        left = end - time.monotonic() - KILL_GRACE_S - REAP_S
        if reason is None and left < 5:
            reason = f"no time left of the {total_s:.0f} s total"
        if reason is not None:
            line = {"check": c.name, "group": c.group, "status": "skip", "seconds": 0.0, "reason": reason}
        else:
            log(f"{c.name}: up to {min(c.budget_s, left):.0f} s ...")
            line = run_check(c, ctx, ctx_path, out_dir, min(c.budget_s, left), command_for(c))
            provides = line.pop("provides", None)
            if isinstance(provides, dict):
                for k, v in provides.items():
                    setattr(ctx, k, v)
        lines.append(line)
        emit(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", metavar="CHECK", help="run only these checks")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="cpu: rehearse what runs without a GPU")
    p.add_argument("--total-s", type=float, default=TOTAL_S, help="all checks together, seconds")
    p.add_argument("--ranks", type=int, default=0,
                   help="ranks of the launched jobs (default: every GPU; on one GPU two sharing it if NCCL allows)")
    p.add_argument("--out-dir", help="where each check's log and result go (default: a new temporary directory)")
    p.add_argument("--list", action="store_true", help="list the checks and their budgets")
    p.add_argument("--smoke", action="store_true",
                   help=f"only {', '.join(SMOKE_CHECKS)} (every group), within {SMOKE_TOTAL_S:.0f} s; "
                        "without a GPU each says why it skips")
    p.add_argument("--run-check", help=argparse.SUPPRESS)
    p.add_argument("--context", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.run_check:
        return child(args)
    names = [c.name for c in CHECKS]
    if args.list:
        for c in CHECKS:
            print(f"{c.name:<22} {c.group:<11} {c.budget_s:>4.0f} s  {(c.fn.__doc__ or '').split(chr(10))[0]}")
        return 0
    unknown = [n for n in args.only or () if n not in names]
    if unknown:
        print(f"error: --only: unknown check {', '.join(unknown)}; the checks are {', '.join(names)}", file=sys.stderr)
        return 2
    if args.smoke:
        args.only = args.only or list(SMOKE_CHECKS)
        args.total_s = min(args.total_s, SMOKE_TOTAL_S)
    t0 = time.monotonic()
    # Every process the checks start (launched ranks included) runs this checkout.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    ctx = probe(args.device)
    if args.device == "cuda" and ctx.device != "cuda":
        print(f"error: --device cuda: {ctx.no_gpu}", file=sys.stderr)
        return 2
    if args.ranks < 0:
        print(f"error: --ranks must be a positive number of ranks; got {args.ranks}", file=sys.stderr)
        return 2
    ctx.fault_ranks = args.ranks
    checks = plan(ctx, args.only)
    out_dir = None
    if args.out_dir or any(reason is None for _c, reason in checks):  # nothing to keep when everything skips
        out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="trainwatch-gpu-check-"))
        out_dir.mkdir(parents=True, exist_ok=True)
        log(f"gpu check: {ctx.device}, {len(ctx.gpus)} GPU(s) {[g['name'] for g in ctx.gpus]}; logs in {out_dir}")

    def emit(line: dict) -> None:
        print(json.dumps(finite(line), default=str), flush=True)

    lines = run_all(checks, ctx, out_dir or Path(tempfile.gettempdir()), args.total_s, emit)
    summary = summarise(lines, ctx, time.monotonic() - t0)
    print(json.dumps({"summary": summary}), flush=True)
    if out_dir is not None:
        (out_dir / "summary.jsonl").write_text("".join(json.dumps(finite(x), default=str) + "\n"
                                                       for x in [*lines, {"summary": summary}]))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    import common

    common.main(main)
