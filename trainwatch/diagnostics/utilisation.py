"""Why the GPUs are idle: the low-utilisation decision tree, as a pure function.

When the GPUs of a job that is stepping are busy less than half the time, the
usual suspects are checked in a fixed order, the cheapest to confirm and the
most common first:

1. data loading: a rank spends a large share of its step waiting for a batch;
2. communication: ranks spend a large share of their step waiting on peers;
3. pipeline bubble: point-to-point traffic (pipeline stages) and nothing above;
4. memory pressure: a GPU is nearly full, so batches stay small (or the
   allocator retries);
5. none of these: `unexplained`, with the signals that were unknown.

Inputs are plain data: `diagnose`'s rank rows (`step_s`, `compute_s`,
`phase_times`, `groups`, `collectives`) and the node's last NVML samples as the
sidecar wrote them to telemetry.json. Any value may be missing or nonsense;
such a value counts as unknown, never as an error.
"""

from __future__ import annotations

import bisect
import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from trainwatch import kinds

RUNBOOK = "gpu-utilisation"
LOW_UTIL_PCT = 50.0
"""Mean GPU busy percent below which utilisation counts as low."""
DATA_SHARE = 0.20
"""Share of a rank's step spent fetching data from which data loading is the bottleneck."""
WAIT_SHARE = 0.20
"""Share of a step spent waiting on peers from which communication is the bottleneck."""
MEMORY_FRACTION = 0.90
"""Fraction of a GPU's memory in use from which memory is the bottleneck."""
FINDINGS = ("data_loading", "communication", "pipeline_bubble", "memory_pressure", "unexplained")
STEPPING_VERDICTS = frozenset({"healthy", *kinds.ALERT_ONLY_KINDS})
"""Verdicts of a job whose ranks still complete steps (healthy, or an open incident of a kind that leaves the
job running: kinds.py): only then do idle GPUs say something about throughput."""

_P2P_OP = re.compile(r"send|recv", re.IGNORECASE)

ADVICE = {
    "data_loading": "input is the bottleneck: more DataLoader workers (num_workers), pin_memory and prefetching, "
                    "or data on faster storage",
    "communication": "ranks wait on each other: keep tensor parallelism inside a node, check NCCL uses the fast "
                     "transport (NCCL_DEBUG=INFO: NET/IB or NET/OFI, not NET/Socket), raise the micro-batch size",
    "pipeline_bubble": "pipeline stages idle between forward and backward: more micro-batches per step, or fewer "
                       "pipeline stages (more tensor parallelism instead)",
    "memory_pressure": "a GPU is nearly full: activation checkpointing or a sharded optimizer frees memory "
                       "for a larger micro-batch; check allocator retries (torch.cuda.memory_stats)",
    "unexplained": "not data, waits, pipeline or memory: profile a few steps (torch.profiler) for small kernels, "
                   "host syncs (.item(), prints) or Python-bound CPU work",
}


def _num(value: Any) -> float | None:
    """A finite, non-negative number, or None (wrong type, NaN, infinite, negative, too large)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def _share(part: float | None, whole: float | None) -> float | None:
    if part is None or not whole:
        return None
    return min(1.0, part / whole)


def _field(obj: Any, name: str, *aliases: str) -> Any:
    for key in (name, *aliases):
        value = obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)
        if value is not None:
            return value
    return None


def _rank_id(row: Mapping) -> int | None:
    rank = row.get("rank")
    return rank if isinstance(rank, int) and not isinstance(rank, bool) else None


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


# ---- input ---------------------------------------------------------------------------------


def samples_from_telemetry(telemetry: Any) -> tuple[list[dict], str | None, bool]:
    """(GPU samples, why there are none, simulated) from a telemetry.json record.

    The sidecar writes `gpus: {"nvml": bool, "simulated": bool, "samples": [...]}`;
    a record without it comes from a sidecar whose hardware monitor was off.
    """
    record = telemetry.get("gpus") if isinstance(telemetry, Mapping) else None
    if not isinstance(record, Mapping):
        return [], "no GPU samples recorded (the node's hardware monitor was off)", False
    simulated = record.get("simulated") is True
    if record.get("nvml") is not True:
        return [], "no GPU", simulated
    node = telemetry.get("node") if isinstance(telemetry.get("node"), str) else None
    raw = record.get("samples")
    samples = [{**s, "node": node} for s in raw if isinstance(s, Mapping)] if isinstance(raw, list) else []
    return samples, (None if samples else "no GPU"), simulated


def not_judged(status: Any, verdict_category: Any) -> str | None:
    """Why utilisation says nothing about throughput right now (None: it does)."""
    if status != "running":
        return f"job is {status}: utilisation is judged only while the job runs"
    if verdict_category not in STEPPING_VERDICTS:
        return f"verdict is {verdict_category}: ranks are not stepping, so idle GPUs follow from that"
    return None


def _per_gpu(samples: Iterable[Any], rows: Sequence[Mapping]) -> list[dict]:
    out = []
    for s in samples:
        gpu = _field(s, "gpu", "index")
        gpu = gpu if isinstance(gpu, int) and not isinstance(gpu, bool) else None
        local = _field(s, "local_rank")
        local = local if isinstance(local, int) and not isinstance(local, bool) else None
        node = _field(s, "node")
        node = node if isinstance(node, str) else None
        util = _num(_field(s, "utilization_pct"))
        used, total = _num(_field(s, "memory_used_bytes")), _num(_field(s, "memory_total_bytes"))
        rank = None
        if local is not None:
            rank = next((_rank_id(r) for r in rows if r.get("local_rank") == local
                         and (node is None or r.get("node") in (node, "", None))), None)
        out.append({
            "gpu": gpu, "node": node, "local_rank": local, "rank": rank,
            "utilization_pct": util if util is None or util <= 100 else None,
            "memory_used_bytes": int(used) if used is not None else None,
            "memory_total_bytes": int(total) if total is not None else None,
            "memory_fraction": _round(_share(used, total)),
        })
    return out


def _rows(ranks: Iterable[Any]) -> list[Mapping]:
    rows = []
    for r in ranks or ():
        r = r.to_json() if hasattr(r, "to_json") else r
        if isinstance(r, Mapping) and _rank_id(r) is not None:
            rows.append(r)
    return rows


# ---- the evidence ----------------------------------------------------------------------------


def _rank_shares(row: Mapping) -> dict:
    """One rank's step split into shares; a share that cannot be known is None."""
    step = _num(row.get("step_s")) or None  # a zero step time divides nothing
    compute = _num(row.get("compute_s"))
    times = row.get("phase_times") if isinstance(row.get("phase_times"), Mapping) else {}
    data, backward, optimizer = (_num(times.get(p)) for p in ("data", "backward", "optimizer"))
    wait = None
    if step is not None and compute is not None:
        # compute_s leaves out all of backward (a phase that waits on peers),
        # the gradient computation included: only the time beyond backward is
        # a pure wait. Backward's own waits are judged against the other ranks.
        wait = max(0.0, step - compute - (backward or 0.0))
    rest = None
    if step is not None and None not in (data, backward, optimizer):
        rest = max(0.0, step - data - backward - optimizer - (wait or 0.0))
    return {"step_s": step, "data": _share(data, step), "wait": _share(wait, step),
            "backward_s": backward, "rest": _share(rest, step)}


def _backward_excess(shares: dict[int, dict]) -> dict[int, float]:
    """Per rank, backward time beyond the other ranks' median, as a share of its
    step: in data-parallel backward the fast ranks wait in the all-reduce."""
    known = {r: s["backward_s"] for r, s in shares.items() if s["backward_s"] is not None and s["step_s"]}
    ordered = sorted(known.values())
    if len(ordered) < 2:
        return {}
    return {r: min(1.0, max(0.0, b - _median_without(ordered, bisect.bisect_left(ordered, b))) / shares[r]["step_s"])
            for r, b in known.items()}


def _median_without(ordered: list[float], k: int) -> float:
    """Median of a sorted list less its k-th item, without copying it (thousands of ranks)."""
    m = len(ordered) - 1

    def at(j: int) -> float:
        return ordered[j if j < k else j + 1]

    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


def _p2p_ranks(rows: Sequence[Mapping]) -> tuple[list[int], list[str]]:
    ranks, ops = set(), set()
    for row in rows:
        groups = row.get("groups") if isinstance(row.get("groups"), list) else []
        coll = row.get("collectives")
        for g in [*groups, coll]:
            op = g.get("last_op") if isinstance(g, Mapping) else None
            if isinstance(op, str) and _P2P_OP.search(op):
                ranks.add(_rank_id(row))
                ops.add(op[:40])
    return sorted(ranks), sorted(ops)


def _spread(values: dict[int, float | None]) -> tuple[float | None, float | None, int | None]:
    """(median, max, rank of the max: None when the max is 0) of the known values."""
    known = {r: v for r, v in values.items() if v is not None}
    if not known:
        return None, None, None
    worst = max(sorted(known), key=lambda r: known[r])
    return statistics.median(known.values()), known[worst], worst if known[worst] > 0 else None


def evidence(rows: Sequence[Mapping], shares: dict[int, dict], per_gpu: Sequence[Mapping]) -> dict:
    """The numbers each branch of the tree looks at (None: unknown)."""
    data_med, data_max, data_rank = _spread({r: s["data"] for r, s in shares.items()})
    wait_med, wait_max, wait_rank = _spread({r: s["wait"] for r, s in shares.items()})
    _, excess_max, excess_rank = _spread(_backward_excess(shares))
    rest_med, _, _ = _spread({r: s["rest"] for r, s in shares.items()})
    p2p_ranks, p2p_ops = _p2p_ranks(rows)
    mem = {i: g["memory_fraction"] for i, g in enumerate(per_gpu) if g["memory_fraction"] is not None}
    mem_i = max(sorted(mem), key=lambda i: mem[i]) if mem else None
    return {
        "ranks_with_step_time": sum(1 for s in shares.values() if s["step_s"]),
        "data_share": _round(data_med), "data_share_max": _round(data_max), "data_share_max_rank": data_rank,
        "wait_share": _round(wait_med), "wait_share_max": _round(wait_max), "wait_share_max_rank": wait_rank,
        "backward_excess_share_max": _round(excess_max), "backward_excess_rank": excess_rank,
        "other_share": _round(rest_med),
        "p2p_ranks": p2p_ranks, "p2p_ops": p2p_ops,
        "memory_fraction_max": mem[mem_i] if mem_i is not None else None,
        "memory_fraction_max_gpu": per_gpu[mem_i]["gpu"] if mem_i is not None else None,
    }


def decide(ev: dict, shares: dict[int, dict], per_gpu: Sequence[Mapping]) -> tuple[str, list[int]]:
    """The first branch of the tree the evidence supports, and the ranks it names."""
    if (ev["data_share_max"] or 0.0) >= DATA_SHARE:
        return "data_loading", sorted(r for r, s in shares.items() if (s["data"] or 0.0) >= DATA_SHARE)
    excess = _backward_excess(shares)
    if (ev["wait_share"] or 0.0) >= WAIT_SHARE or (ev["backward_excess_share_max"] or 0.0) >= WAIT_SHARE:
        return "communication", sorted(r for r, s in shares.items()
                                       if (s["wait"] or 0.0) >= WAIT_SHARE or excess.get(r, 0.0) >= WAIT_SHARE)
    if ev["p2p_ranks"]:  # no point-to-point traffic seen: no evidence of a pipeline, branch skipped
        return "pipeline_bubble", list(ev["p2p_ranks"])
    if (ev["memory_fraction_max"] or 0.0) >= MEMORY_FRACTION:
        return "memory_pressure", sorted({g["rank"] for g in per_gpu if g["rank"] is not None
                                          and (g["memory_fraction"] or 0.0) >= MEMORY_FRACTION})
    return "unexplained", []


# ---- the section ---------------------------------------------------------------------------


def _unknowns(ev: dict) -> list[str]:
    names = ("data_share", "wait_share", "memory_fraction_max")
    return [n for n in names if ev[n] is None]


def _advice(finding: str, ev: dict, ranks: list[int]) -> str:
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {','.join(map(str, ranks[:8]))}" if ranks else ""
    verb = "spends" if len(ranks) == 1 else "spend"
    if finding == "data_loading":
        head = f"{who} {verb} up to {ev['data_share_max']:.0%} of a step waiting for data"
    elif finding == "communication":
        worst = max(ev["wait_share_max"] or 0.0, ev["backward_excess_share_max"] or 0.0)
        head = f"{who or 'ranks'} {verb} up to {worst:.0%} of a step waiting on peers"
    elif finding == "pipeline_bubble":
        head = f"point-to-point traffic ({', '.join(ev['p2p_ops'][:3])}) on {who}"
    elif finding == "memory_pressure":
        head = f"GPU {ev['memory_fraction_max_gpu']} is {ev['memory_fraction_max']:.0%} full"
    else:
        unknown = _unknowns(ev)
        head = "no bottleneck stands out" + (f" ({', '.join(unknown)} unknown)" if unknown else "")
    return f"{head}; {ADVICE[finding]}"


def gpu_utilisation(ranks: Iterable[Any], samples: Iterable[Any] | None, *, no_samples: str | None = None,
                    skip: str | None = None, simulated: bool = False) -> dict:
    """`{"gpu_utilisation": {...}}`: diagnose's GPU utilisation section.

    ranks: rank rows (dicts as `diagnose` has them, or RankRows); samples: one
    per GPU with `gpu`, `local_rank`, `node`, `utilization_pct`,
    `memory_used_bytes`, `memory_total_bytes`; no_samples: why there are none
    ("no GPU"); skip: why utilisation is not to be judged now (see not_judged()).
    """
    rows = _rows(ranks)
    per_gpu = _per_gpu(samples or (), rows)
    mapped = [g for g in per_gpu if g["rank"] is not None and g["utilization_pct"] is not None]
    counted = mapped or [g for g in per_gpu if g["utilization_pct"] is not None]
    mean = _round(statistics.fmean(g["utilization_pct"] for g in counted), 1) if counted else None
    shares = {_rank_id(r): _rank_shares(r) for r in rows}
    ev = evidence(rows, shares, mapped or per_gpu)
    reason = no_samples or skip
    if reason is None and mean is None:
        reason = "no GPU utilisation reported" if per_gpu else "no GPU"
    status, finding, culprits = "unknown", None, []
    if reason is None:
        status = "low" if mean < LOW_UTIL_PCT else "ok"
    if status == "low":
        finding, culprits = decide(ev, shares, mapped or per_gpu)
        advice = _advice(finding, ev, culprits)
    elif status == "ok":
        advice = f"GPUs busy {mean:.0f}% of the time on average; nothing to do"
    else:
        advice = f"not judged: {reason}"
    return {"gpu_utilisation": {
        "status": status, "reason": reason, "mean_util_pct": mean, "gpus_counted": len(counted),
        "threshold_pct": LOW_UTIL_PCT,
        "per_gpu": per_gpu, "finding": finding, "ranks": culprits, "evidence": ev, "advice": advice,
        "runbook": RUNBOOK, "simulated": bool(simulated),
    }}


def render_lines(section: Mapping) -> list[str]:
    """The section as `trainwatch diagnose` prints it."""
    if not isinstance(section, Mapping):
        return []
    status, mean = section.get("status"), section.get("mean_util_pct")
    n = section.get("gpus_counted") or 0
    head = f"gpu utilisation: {status}"
    if mean is not None:
        head += f" (mean {mean:.0f}% over {n} GPU{'s' if n != 1 else ''}"
        head += ", simulated GPUs)" if section.get("simulated") else ")"
    if section.get("finding"):
        head += f" — {section['finding']}"
    lines = [head, f"  {section.get('advice', '')}"]
    if status == "low":
        for g in (section.get("per_gpu") or [])[:8]:
            mem = (f", memory {g['memory_fraction']:.0%}" if g.get("memory_fraction") is not None else "")
            who = f" (rank {g['rank']})" if g.get("rank") is not None else ""
            util = f"{g['utilization_pct']:.0f}%" if g.get("utilization_pct") is not None else "-"
            lines.append(f"  - GPU {g.get('gpu')}{who}: busy {util}{mem}")
        lines.append(f"  runbook: trainwatch runbook {section.get('runbook', RUNBOOK)}")
    return lines
