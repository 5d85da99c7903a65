"""trainwatch's four Grafana dashboards, as code.

Job overview: is the job training, how fast, is the loss healthy, what went wrong.
Ranks and stragglers: which rank is slow and by how much.
Collectives: which ranks are behind in which process group.
GPU health: NVML readings, Xid and ECC errors.

Metric names and labels are the exporter's (trainwatch/watchdog/exporter.py and
hardware.py); DESIGN.md lists them.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.models import dashboard as dm

from trainwatch.dashboards.panels import (
    GPU,
    GPU_LEGEND,
    NODE,
    RANK,
    RANK_LEGEND,
    STALL_SECONDS,
    STRAGGLER_RATIO,
    base,
    finish,
    graph,
    grid,
    heat,
    label_variable,
    query,
    single,
)

# Shared expressions.
BUCKETS = f"trainwatch_step_duration_seconds_bucket{{{RANK}}}"
MEAN_STEP = (
    f"rate(trainwatch_step_duration_seconds_sum{{{RANK}}}[$__rate_interval])"
    f" / rate(trainwatch_step_duration_seconds_count{{{RANK}}}[$__rate_interval])"
)
"""Mean step time per rank over the rate window (seconds)."""
COMPLETED = f'trainwatch_collective_seq{{{RANK},state="completed"}}'
ENQUEUED = f'trainwatch_collective_seq{{{RANK},state="enqueued"}}'
AGE = f"trainwatch_last_progress_age_seconds{{{RANK}}}"
RATIO = f"trainwatch_straggler_slowdown_ratio{{{RANK}}}"


def _incidents(kinds: str | None = None) -> str:
    kind = f',kind=~"{kinds}"' if kinds else ""
    return f"trainwatch_incidents_total{{{NODE}{kind}}}"


def events(counter: str, window: str, by: str, *, zero: bool = False) -> str:
    """Events an event counter counted in the window, summed by `by`.

    increase() sees nothing on a series whose first sample already holds the
    event (Prometheus started scraping after it, or a restarted sidecar), so a
    series that did not exist a window ago counts with its current value, as
    the alert rules do. `zero` adds a 0 for groups with no event, so a stat
    panel reads 0 rather than "No data".
    """
    out = (f"(sum by ({by}) (increase({counter}[{window}])) > 0)"
           f" or sum by ({by}) ({counter} > 0 unless {counter} offset {window})")
    return f"{out} or sum by ({by}) ({counter} * 0)" if zero else out


def overview_dashboard() -> dm.Dashboard:
    b = base(
        "trainwatch-overview",
        "trainwatch: job overview",
        "Is the job training, how fast, is the loss healthy, and what went wrong: step rate, loss, step time, "
        "progress age per rank, incidents and restarts (also drawn as annotations on every graph).",
    )
    b = (
        b.with_row(db.Row("Now"))
        .with_panel(single("Ranks reporting", "Ranks whose slot the sidecar reads. Fewer than the job's world size: a rank died or has not started.",
                           [query(f"count by (job) (trainwatch_step{{{RANK}}})", "{{job}}")], span=4))
        .with_panel(single("Current step", "Highest completed step across the selected ranks.",
                           [query(f"max by (job) (trainwatch_step{{{RANK}}})", "{{job}}")], span=4))
        .with_panel(single("Steps per second", "Job throughput: the slowest rank's step rate (every rank waits for it at each collective).",
                           [query(f"min by (job) (rate(trainwatch_step{{{RANK}}}[$__rate_interval]))", "{{job}}")],
                           unit="steps/s", span=4, decimals=2))
        .with_panel(single("Stalled ranks", f"Ranks with no completed step for {STALL_SECONDS} s or more. Anything above 0 is a hang or a very long pause; run `trainwatch diagnose <job>`.",
                           [query(f"count by (job) ({AGE} >= {STALL_SECONDS})", "{{job}}")], span=4, red_at=1))
        .with_panel(single("Incidents in range", "Incidents raised in the selected time range, all kinds. `trainwatch diagnose <job>` explains the last one.",
                           [query(events(_incidents(), "$__range", "job", zero=True), "{{job}}")], span=4, red_at=1, decimals=0))
        .with_panel(single("Worker group restarts", "Restarts since launch; each one resumed from the newest valid checkpoint. Several in a row: the fault survives a restart (bad node, data or checkpoint).",
                           [query(f"max by (job) (trainwatch_restarts_total{{{NODE}}})", "{{job}}")], span=4, red_at=1))
        .with_row(db.Row("Progress"))
        .with_panel(graph(
            "Step rate",
            "Completed steps per second per rank. One rank falling to zero is stalled; all ranks falling together is a collective wait or an input stall.",
            # trainwatch_step only grows within a run; a resume from an earlier
            # checkpoint reads as a counter reset, which rate() absorbs.
            [query(f"rate(trainwatch_step{{{RANK}}}[$__rate_interval])", RANK_LEGEND)],
            unit="steps/s",
        ))
        .with_panel(graph(
            "Last progress age",
            f"Seconds since each rank completed a step. It climbs without bound on a hung rank; the dashed line is the {STALL_SECONDS} s stall alert.",
            [query(AGE, RANK_LEGEND)],
            unit="s", threshold=STALL_SECONDS, minimum=0,
        ))
        .with_row(db.Row("Nodes"))
        .with_panel(graph(
            "Lowest step per node",
            "The slowest rank's step on each node of the job. A node whose line stops while the others wait is where the fault is; a node whose line vanishes was lost (the node_lost incident names it).",
            [query(f"min by (job, node) (trainwatch_step{{{RANK}}})", "{{job}} {{node}}")],
        ))
        .with_panel(graph(
            "Longest progress age per node",
            f"Seconds since the least recent progress of any rank on each node. One node climbing alone holds the job back; every node climbing together is a job-wide wait. The dashed line is the {STALL_SECONDS} s stall alert.",
            [query(f"max by (job, node) ({AGE})", "{{job}} {{node}}")],
            unit="s", threshold=STALL_SECONDS, minimum=0,
        ))
        .with_row(db.Row("Model health"))
        .with_panel(graph(
            "Loss",
            "Loss at each rank's last step. Look for a curve that stops falling, spikes, or vanishes (NaN is not drawn; the loss_nan incident fires).",
            [query(f"trainwatch_loss{{{RANK}}}", RANK_LEGEND)],
        ))
        .with_panel(graph(
            "Gradient norm",
            "Gradient norm at each rank's last step. A sudden climb often comes a few steps before a loss spike or NaN.",
            [query(f"trainwatch_grad_norm{{{RANK}}}", RANK_LEGEND)],
        ))
        .with_panel(graph(
            "Learning rate",
            "Learning rate of each rank's first param group. It should warm up, then decay; flat at 0 past the first steps, or flat at its peak for far longer than the warmup, is the lr_stuck incident.",
            [query(f"trainwatch_learning_rate{{{RANK}}}", RANK_LEGEND)],
            span=8, minimum=0,
        ))
        .with_panel(graph(
            "Loss scale",
            "fp16 loss scale (GradScaler) per rank, log scale. Halving now and then is normal; falling step after step means gradients keep overflowing (loss_scale_collapse). Empty with bf16 or fp32.",
            [query(f"trainwatch_loss_scale{{{RANK}}}", RANK_LEGEND)],
            span=8, log=2,
        ))
        .with_panel(graph(
            "Zero gradient elements",
            "Fraction of gradient elements exactly zero. Healthy is a few percent; above half for long is vanishing_grad, all of them is dead_grad.",
            [query(f"trainwatch_zero_grad_fraction{{{RANK}}}", RANK_LEGEND)],
            unit="percentunit", span=8, minimum=0, maximum=1,
        ))
        .with_panel(graph(
            "Loss trend slope",
            "Robust slope of each rank's loss over the loss trend window, in loss per step: below 0 while the loss improves, near 0 on a plateau, above 0 when it rises (loss_trend).",
            [query(f"trainwatch_loss_trend_slope{{{RANK}}}", RANK_LEGEND)],
        ))
        .with_row(db.Row("Step time"))
        .with_panel(graph(
            "Step duration p50 / p99",
            "From the step-duration histogram over the selected ranks. A p99 far above p50 means periodic slow steps (checkpoints, GC, data stalls).",
            [
                query(f"histogram_quantile(0.5, sum by (job, le) (rate({BUCKETS}[$__rate_interval])))", "{{job}} p50"),
                query(f"histogram_quantile(0.99, sum by (job, le) (rate({BUCKETS}[$__rate_interval])))", "{{job}} p99"),
            ],
            unit="s", minimum=0,
        ))
        .with_panel(graph(
            "Mean step time per rank",
            "Mean step duration per rank over the rate window. Ranks of a synchronous job move together; use the Ranks dashboard to find which one sets the pace.",
            [query(MEAN_STEP, RANK_LEGEND)],
            unit="s", minimum=0,
        ))
        .with_panel(graph(
            "Time per phase",
            "Seconds each rank's last step spent in data loading, backward (with the gradient all-reduce: waiting for peers shows here) and the optimizer. A step time spike names the phase that grew.",
            [query(f"trainwatch_phase_seconds{{{RANK}}}", RANK_LEGEND + " {{phase}}")],
            unit="s", minimum=0,
        ))
        .with_row(db.Row("Incidents and restarts"))
        .with_panel(graph(
            "Incidents by kind",
            "Incidents raised over time by detector kind (hang, collective_mismatch, straggler, crash, loss_nan, loss_spike, grad_explosion, dead_grad, vanishing_grad, lr_stuck, loss_scale_collapse, loss_trend, step_time_spike, xid, ecc, restart).",
            [query(events(_incidents(), "$__rate_interval", "kind"), "{{kind}}")],
            bars=True, minimum=0,
        ))
        .with_panel(graph(
            "Restarts",
            "Worker group restarts since launch; each step up is one restart.",
            [query(f"trainwatch_restarts_total{{{NODE}}}", "{{job}} {{node}}")],
            stepped=True, minimum=0,
        ))
    )
    return finish(b)


def ranks_dashboard() -> dm.Dashboard:
    b = base(
        "trainwatch-ranks",
        "trainwatch: ranks and stragglers",
        "Which rank sets the pace: per-rank step time, compute slowdown against the group median, and the slowest ranks now.",
    )
    b = (
        b.with_row(db.Row("Slowest ranks now"))
        .with_panel(grid(
            "Top 10 by slowdown ratio",
            f"Ranks whose compute time is furthest above the group median (1.0 = typical, {STRAGGLER_RATIO} = straggler alert). "
            "Compute time, not step time: ranks waiting in collectives are victims and score near 1.",
            [query(f"topk(10, {RATIO})")],
            ["Time", "__name__", "job"],
            span=12, red_at=STRAGGLER_RATIO, sort_by="Value",
        ))
        .with_panel(grid(
            "Top 10 by mean step time",
            "Ranks with the longest mean step over the rate window. In a synchronous job every rank's step includes the wait for the slowest; "
            "compare with the slowdown ratio to tell the culprit from its victims.",
            [query(f"topk(10, {MEAN_STEP})")],
            ["Time", "job"],
            span=12, unit="s", sort_by="Value",
        ))
        .with_row(db.Row("Step time per rank"))
        .with_panel(heat(
            "Step time heatmap (row per rank)",
            "One row per rank, coloured by its mean step time. A row darker than the rest is a straggler; the whole heatmap darkening at once is a job-wide slowdown.",
            query(MEAN_STEP, "{{rank}}"),
            rows=True,
        ))
        .with_panel(heat(
            "Step duration distribution",
            "Histogram buckets of step duration over time (all selected ranks). A second band above the main one is periodic slow steps.",
            query(f"sum by (le) (increase({BUCKETS}[$__rate_interval]))"),
        ))
        .with_row(db.Row("Slowdown"))
        .with_panel(graph(
            "Straggler slowdown ratio",
            f"Rank compute time over the group median (1.0 = typical). Above the dashed {STRAGGLER_RATIO} line for minutes: a straggler; see the straggler runbook.",
            [query(RATIO, RANK_LEGEND)],
            threshold=STRAGGLER_RATIO, minimum=0,
        ))
        .with_panel(graph(
            "Straggler incidents",
            "Straggler incidents raised by the sidecar (persistent slowdown over its window).",
            [query(events(_incidents("straggler"), "$__rate_interval", "job, node"), "{{job}} {{node}}")],
            bars=True, minimum=0,
        ))
        .with_row(db.Row("Where each rank is"))
        .with_panel(graph(
            "Step per rank",
            "Last completed step per rank. Synchronous ranks stay within a step of each other; a rank that stops climbing is stuck.",
            [query(f"trainwatch_step{{{RANK}}}", RANK_LEGEND)],
            span=8,
        ))
        .with_panel(graph(
            "Heartbeat age",
            "Seconds since a rank's background thread last ran. Stale together with a stale progress age: the process is stopped or holds the GIL; "
            "fresh: it is waiting (collective, I/O).",
            [query(f"trainwatch_heartbeat_age_seconds{{{RANK}}}", RANK_LEGEND)],
            unit="s", span=8, minimum=0,
        ))
        .with_panel(grid(
            "Current phase per rank",
            "The phase each rank is in now (data, forward, backward, optimizer, checkpoint, ...). During a hang, the odd one out is usually the culprit.",
            [query(f"trainwatch_phase{{{RANK}}} == 1")],
            ["Time", "Value", "__name__", "job"],
            span=8,
        ))
    )
    return finish(b)


def collectives_dashboard() -> dm.Dashboard:
    behind = f"max by (job, pg) ({COMPLETED}) - on (job, pg) group_right {COMPLETED}"
    b = base(
        "trainwatch-collectives",
        "trainwatch: collectives",
        "Collective sequence numbers per rank and process group (from PyTorch's flight recorder): who is behind, by how much, and whether ranks disagree.",
    )
    b = (
        b.with_row(db.Row("Now"))
        .with_panel(single("Process groups", "Process groups whose collectives the ranks report.",
                           [query(f"count(count by (pg) ({COMPLETED}))")], span=6))
        .with_panel(single("Largest skew", "Largest gap in completed collectives between ranks of one group. A few is normal jitter; a gap that grows is a desync or a stuck rank.",
                           [query(f"max(max by (job, pg) ({COMPLETED}) - min by (job, pg) ({COMPLETED}))")], span=6, red_at=10))
        .with_panel(single("Largest in-flight lag", "Most collectives any rank has launched but not completed. It stays up on a rank stuck inside a collective.",
                           [query(f"max({ENQUEUED} - ignoring(state) {COMPLETED})")], span=6, red_at=5))
        .with_panel(single("Mismatch incidents in range", "Collective mismatch incidents: ranks of a group disagree on which collective comes next (like NCCL RAS). See the collective-mismatch runbook.",
                           [query(events(_incidents("collective_mismatch"), "$__range", "job", zero=True), "{{job}}")], span=6, red_at=1, decimals=0))
        .with_row(db.Row("Sequence numbers"))
        .with_panel(graph(
            "Completed collectives per rank",
            "Last completed collective sequence number per rank and process group. Lines climb together in a healthy job; one that flattens is stuck.",
            [query(COMPLETED, RANK_LEGEND + " pg {{pg}}")],
        ))
        .with_panel(graph(
            "Enqueued collectives per rank",
            "Last launched collective sequence number per rank and group. Enqueued far above completed: the rank waits inside a collective for a peer.",
            [query(ENQUEUED, RANK_LEGEND + " pg {{pg}}")],
        ))
        .with_row(db.Row("Skew between ranks"))
        .with_panel(graph(
            "Skew within each process group",
            "Max minus min sequence number across the ranks of each group, completed and enqueued. A gap that grows means some ranks are behind or out of step.",
            [
                query(f"max by (job, pg) ({COMPLETED}) - min by (job, pg) ({COMPLETED})", "{{job}} pg {{pg}} completed"),
                query(f"max by (job, pg) ({ENQUEUED}) - min by (job, pg) ({ENQUEUED})", "{{job}} pg {{pg}} enqueued"),
            ],
            minimum=0,
        ))
        .with_panel(graph(
            "Collectives behind the group's leader",
            "Per rank: how many collectives it has completed fewer than the most advanced rank of its group. The rank that stays behind is the one the others wait for.",
            [query(behind, RANK_LEGEND + " pg {{pg}}")],
            minimum=0,
        ))
        .with_row(db.Row("In flight"))
        .with_panel(graph(
            "In-flight collectives (enqueued - completed)",
            "Collectives a rank has launched but not finished, per group. A lag that stays up is a rank stuck in a collective, usually waiting for a peer that never joined.",
            [query(f"{ENQUEUED} - ignoring(state) {COMPLETED}", RANK_LEGEND + " pg {{pg}}")],
            minimum=0,
        ))
        .with_panel(grid(
            "Sequence numbers now",
            "Current enqueued and completed sequence numbers per rank and group, for a quick side-by-side during a hang.",
            [query(ENQUEUED), query(COMPLETED)],
            ["Time", "__name__", "job"],
            span=12,
        ))
    )
    return finish(b)


def gpu_dashboard() -> dm.Dashboard:
    xid = f"trainwatch_gpu_xid_errors_total{{{GPU}}}"
    ecc = f"trainwatch_gpu_ecc_errors_total{{{GPU}}}"
    b = base(
        "trainwatch-gpu",
        "trainwatch: GPU health",
        "NVML readings per GPU: load, memory, thermals, power, clocks, throttling, Xid and ECC errors.",
    ).with_variable(label_variable("gpu", "GPU", 'trainwatch_gpu_utilization_ratio{job=~"$job",node=~"$node"}'))
    b = (
        b.with_row(db.Row("Errors"))
        .with_panel(single(
            "Xid errors in range",
            "Driver-reported Xid errors in the selected range. `trainwatch explain` and the gpu-xid runbook give each code's meaning and action.",
            [query(events(xid, "$__range", "node, gpu", zero=True), GPU_LEGEND)],
            span=6, red_at=1, decimals=0,
        ))
        .with_panel(single(
            "Uncorrected ECC errors in range",
            "Any uncorrected ECC error means this GPU's results cannot be trusted: drain the node (gpu-ecc runbook).",
            [query(events(f'trainwatch_gpu_ecc_errors_total{{{GPU},type="uncorrected"}}', "$__range", "node, gpu", zero=True), GPU_LEGEND)],
            span=6, red_at=1, decimals=0,
        ))
        .with_panel(grid(
            "Xid codes seen",
            "Each Xid code the GPUs reported since the sidecar started, with its count and severity. critical: the GPU or node needs attention now; "
            "lower: often the application's own fault (a bad kernel, an illegal address).",
            [query(f"max by (node, gpu, rank, xid, severity) (max_over_time(trainwatch_gpu_xid_code_errors_total{{{GPU}}}[$__range]))")],
            ["Time"],
            span=12, height=4,
        ))
        .with_panel(graph(
            "Xid and ECC counters",
            "Cumulative error counters since the poller started; a step is a new error. Corrected ECC errors that keep climbing are worth a ticket.",
            [query(f"sum by (node, gpu) ({xid})", GPU_LEGEND + " xid"), query(ecc, GPU_LEGEND + " ecc {{type}}")],
            stepped=True, minimum=0,
        ))
        .with_panel(graph(
            "Active throttle reasons",
            "Clock throttle reasons in effect (1 = active). gpu_idle is harmless; thermal and power slowdowns cost step time and make stragglers.",
            [query(f"trainwatch_gpu_throttle{{{GPU}}} > 0", GPU_LEGEND + " {{reason}}")],
            stepped=True, minimum=0,
        ))
        .with_row(db.Row("Load"))
        .with_panel(graph(
            "Utilization",
            "Fraction of time a kernel ran. Low on all GPUs: input-bound or waiting; low on one: a straggler's peers waiting for it, or the straggler itself stalled.",
            [query(f"trainwatch_gpu_utilization_ratio{{{GPU}}}", GPU_LEGEND)],
            unit="percentunit", minimum=0, maximum=1,
        ))
        .with_panel(graph(
            "SM clock",
            "Streaming-multiprocessor clock. A drop under load with a throttle reason set is thermal or power capping.",
            [query(f"trainwatch_gpu_sm_clock_hertz{{{GPU}}}", GPU_LEGEND)],
            unit="hertz", minimum=0,
        ))
        .with_row(db.Row("Memory"))
        .with_panel(graph(
            "Memory used",
            "Device memory used, with each GPU's total for scale.",
            [
                query(f"trainwatch_gpu_memory_used_bytes{{{GPU}}}", GPU_LEGEND + " used"),
                query(f"trainwatch_gpu_memory_total_bytes{{{GPU}}}", GPU_LEGEND + " total"),
            ],
            unit="bytes", minimum=0,
        ))
        .with_panel(graph(
            "Memory used fraction",
            "Used over total. Creeping towards 1.0 step after step: a leak on the way to an OOM.",
            [query(f"trainwatch_gpu_memory_used_bytes{{{GPU}}} / trainwatch_gpu_memory_total_bytes{{{GPU}}}", GPU_LEGEND)],
            unit="percentunit", minimum=0, maximum=1, threshold=0.95,
        ))
        .with_row(db.Row("Thermals and power"))
        .with_panel(graph(
            "Temperature",
            "GPU core temperature. Above the dashed 85 C line most GPUs start to slow their clocks.",
            [query(f"trainwatch_gpu_temperature_celsius{{{GPU}}}", GPU_LEGEND)],
            unit="celsius", threshold=85,
        ))
        .with_panel(graph(
            "Power",
            "Board power draw. One GPU drawing much less than its peers under the same load is idle or throttled.",
            [query(f"trainwatch_gpu_power_watts{{{GPU}}}", GPU_LEGEND)],
            unit="watt", minimum=0,
        ))
    )
    return finish(b)


DASHBOARDS = {
    "trainwatch-overview.json": overview_dashboard,
    "trainwatch-ranks.json": ranks_dashboard,
    "trainwatch-collectives.json": collectives_dashboard,
    "trainwatch-gpu.json": gpu_dashboard,
}
"""File name -> builder, in the order the dashboards list links them."""
