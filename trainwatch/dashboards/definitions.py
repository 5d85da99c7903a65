"""trainwatch's four Grafana dashboards, as code.

Job overview: is the job training, how fast, is the loss healthy, what went wrong.
Ranks and stragglers: which rank is slow and by how much.
Collectives: which ranks are behind in which process group.
GPU health: NVML readings, Xid and ECC errors.

Metric names and labels are the exporter's (trainwatch/watchdog/exporter.py,
aggregates.py and hardware.py). Built for thousands of ranks: a default panel
draws the job's spread (lowest, median, highest, from the nodes' aggregates)
and the few worst ranks or nodes (topk), never a line per rank; the Rank and
Node variables drill down. Every legend names the job.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.models import dashboard as dm

from trainwatch.dashboards.panels import (
    GPU,
    GPU_LEGEND,
    NODE,
    NODE_LEGEND,
    WORST,
    band,
    node_stat,
    worst_nodes,
    worst_ranks,
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
BUCKETS = f"trainwatch_step_duration_seconds_bucket{{{NODE}}}"
JOB_LEGEND = "{{trainwatch_job}}"
JOB = 'trainwatch_job=~"$job"'
"""Job aggregates (trainwatch_job_*) have one series set per job: no node to filter by."""
def _incidents(kinds: str | None = None) -> str:
    kind = f',kind=~"{kinds}"' if kinds else ""
    return f"trainwatch_incidents_total{{{NODE}{kind}}}"


def events(counter: str, window: str, by: str, *, zero: bool = False) -> str:
    """Events a counter counted in the window, summed by `by`. increase() sees
    nothing on a series first scraped already above 0, so a series that did not
    exist a window ago counts with its current value (as the alert rules do);
    `zero` adds a 0 for groups with no event (a stat reads 0, not "No data")."""
    out = (f"(sum by ({by}) (increase({counter}[{window}])) > 0)"
           f" or sum by ({by}) ({counter} > 0 unless {counter} offset {window})")
    return f"{out} or sum by ({by}) ({counter} * 0)" if zero else out


def overview_dashboard() -> dm.Dashboard:
    b = base(
        "trainwatch-overview",
        "trainwatch: job overview",
        "Is the job training, how fast, is the loss healthy, and what went wrong: step rate, loss, step time, "
        "progress age, incidents and restarts (also drawn as annotations on every graph). Lines show each job's "
        "spread over its ranks and its worst ranks or nodes, so the panels read the same at 8 or 4096 ranks.",
    )
    b = (
        b.with_row(db.Row("Now"))
        .with_panel(single("Ranks reporting", "Ranks whose slot the sidecars read, every node. Fewer than the job's world size: a rank died or has not started.",
                           [query(f"sum by (trainwatch_job) (trainwatch_node_ranks{{{NODE}}})", JOB_LEGEND)], span=4))
        .with_panel(single("Current step", "Highest completed step across the selected ranks.",
                           [query(f"max by (trainwatch_job) ({node_stat('step', 'max')})", JOB_LEGEND)], span=4))
        .with_panel(single("Steps per second", "Job throughput: the slowest rank's step rate (every rank waits for it at each collective).",
                           [query(f"min by (trainwatch_job) (rate({node_stat('step', 'min')}[$__rate_interval]))", JOB_LEGEND)],
                           unit="steps/s", span=4, decimals=2))
        .with_panel(single("Nodes with a stalled rank", f"Nodes where a rank completed no step for {STALL_SECONDS} s or more. Anything above 0 is a hang or a very long pause; run `trainwatch diagnose <job>`.",
                           [query(f"count by (trainwatch_job) ({node_stat('last_progress_age_seconds', 'max')} >= {STALL_SECONDS})", JOB_LEGEND)],
                           span=4, red_at=1))
        .with_panel(single("Incidents in range", "Incidents raised in the selected time range, all kinds. `trainwatch diagnose <job>` explains the last one.",
                           [query(events(_incidents(), "$__range", "trainwatch_job", zero=True), JOB_LEGEND)], span=4, red_at=1, decimals=0))
        .with_panel(single("Worker group restarts", "Restarts since launch; each one resumed from the newest valid checkpoint. Several in a row: the fault survives a restart (bad node, data or checkpoint).",
                           [query(f"max by (trainwatch_job) (trainwatch_restarts_total{{{NODE}}})", JOB_LEGEND)], span=4, red_at=1))
        .with_panel(single("Goodput", "Productive training time over wall time since the job started: what is left after start-up, detection, capture and checkpoint, restarts, recomputed steps and time hung (the Badput panel splits the rest). Counted once per job, by the aggregating node of a multi-node job.",
                           [query(f"max by (trainwatch_job) (trainwatch_goodput_ratio{{{NODE}}})", JOB_LEGEND)],
                           unit="percentunit", span=4, decimals=1))
        .with_row(db.Row("Progress"))
        .with_panel(graph(
            "Step rate",
            "Completed steps per second: the job's slowest and fastest rank, and the ranks with the lowest rate. One rank falling to zero is stalled; all falling together is a collective wait or an input stall.",
            # Steps only grow within a run; a resume from an earlier checkpoint
            # reads as a counter reset, which rate() absorbs.
            [query(f"min by (trainwatch_job) (rate({node_stat('step', 'min')}[$__rate_interval]))", "{{trainwatch_job}} slowest"),
             query(f"max by (trainwatch_job) (rate({node_stat('step', 'max')}[$__rate_interval]))", "{{trainwatch_job}} fastest"),
             query(f"bottomk({WORST}, rate(trainwatch_step{{{RANK}}}[$__rate_interval]))", RANK_LEGEND)],
            unit="steps/s",
        ))
        .with_panel(graph(
            "Last progress age",
            f"Seconds since a rank last made progress: the job's spread and its {WORST} oldest ranks. It climbs without bound on a hung rank; the dashed line is the {STALL_SECONDS} s stall alert.",
            band("last_progress_age_seconds") + [worst_ranks("last_progress_age_seconds")],
            unit="s", threshold=STALL_SECONDS, minimum=0,
        ))
        .with_row(db.Row("Nodes"))
        .with_panel(graph(
            "Lowest step per node",
            "The slowest rank's step on the 10 nodes furthest behind. A node whose line stops while the others wait is where the fault is; a node whose line vanishes was lost (the node_lost incident names it).",
            [worst_nodes("step", "min", lowest=True)],
        ))
        .with_panel(graph(
            "Longest progress age per node",
            f"Seconds since the least recent progress of any rank, on the 10 nodes where it is longest. One node climbing alone holds the job back; every node climbing together is a job-wide wait. The dashed line is the {STALL_SECONDS} s stall alert.",
            [worst_nodes("last_progress_age_seconds", "max")],
            unit="s", threshold=STALL_SECONDS, minimum=0,
        ))
        .with_row(db.Row("Model health"))
        .with_panel(graph(
            "Loss",
            f"Loss at the ranks' last step: the job's spread and its {WORST} highest ranks. Look for a curve that stops falling, spikes, or vanishes (NaN is not drawn; the loss_nan incident fires).",
            band("loss") + [worst_ranks("loss")],
        ))
        .with_panel(graph(
            "Gradient norm",
            "Gradient norm at the ranks' last step, the job's spread. A sudden climb often comes a few steps before a loss spike or NaN.",
            band("grad_norm"),
        ))
        .with_panel(graph(
            "Learning rate",
            "Learning rate of the ranks' first param group. It should warm up, then decay; flat at 0 past the first steps, or flat at its peak for far longer than the warmup, is the lr_stuck incident.",
            band("learning_rate"),
            span=8, minimum=0,
        ))
        .with_panel(graph(
            "Loss scale",
            "fp16 loss scale (GradScaler), log scale, the job's spread. Halving now and then is normal; falling step after step means gradients keep overflowing (loss_scale_collapse). Empty with bf16 or fp32.",
            band("loss_scale"),
            span=8, log=2,
        ))
        .with_panel(graph(
            "Zero gradient elements",
            "Fraction of gradient elements exactly zero, the job's spread. Healthy is a few percent; above half for long is vanishing_grad, all of them is dead_grad.",
            band("zero_grad_fraction"),
            unit="percentunit", span=8, minimum=0, maximum=1,
        ))
        .with_panel(graph(
            "Loss trend slope",
            "Robust slope of the ranks' loss over the loss trend window, in loss per step, the job's spread: below 0 while the loss improves, near 0 on a plateau, above 0 when it rises (loss_trend).",
            band("loss_trend_slope"),
        ))
        .with_row(db.Row("Step time"))
        .with_panel(graph(
            "Step duration p50 / p99",
            "From the nodes' step-duration histograms. A p99 far above p50 means periodic slow steps (checkpoints, GC, data stalls).",
            [
                query(f"histogram_quantile(0.5, sum by (trainwatch_job, le) (rate({BUCKETS}[$__rate_interval])))", "{{trainwatch_job}} p50"),
                query(f"histogram_quantile(0.99, sum by (trainwatch_job, le) (rate({BUCKETS}[$__rate_interval])))", "{{trainwatch_job}} p99"),
            ],
            unit="s", minimum=0,
        ))
        .with_panel(graph(
            "Step time",
            f"Duration of the ranks' last step: the job's spread and its {WORST} slowest ranks. Ranks of a synchronous job move together; use the Ranks dashboard to find which one sets the pace.",
            band("step_time_seconds") + [worst_ranks("step_time_seconds")],
            unit="s", minimum=0,
        ))
        .with_panel(graph(
            "Ranks per phase",
            "How many ranks are in each phase, on average over the rate window (rank-seconds per second from trainwatch_phase_seconds_total). Waiting for peers shows as backward or collective; a step time spike shows which phase grew.",
            [query(f"sum by (trainwatch_job, phase) (rate(trainwatch_phase_seconds_total{{{NODE}}}[$__rate_interval]))", "{{trainwatch_job}} {{phase}}")],
            unit="short", minimum=0,
        ))
        .with_row(db.Row("Incidents and restarts"))
        .with_panel(graph(
            "Open incidents",
            "Incidents open now, by kind: from detection until trainwatch resolves them (a hang until the "
            "job trains again, a straggler until it has been gone a minute). The alerts page on these.",
            [query(f"sum by (trainwatch_job, kind) (trainwatch_incident_open{{{NODE}}}) > 0", JOB_LEGEND + " {{kind}}")],
            stepped=True, minimum=0,
        ))
        .with_panel(graph(
            "Incidents by kind",
            "Incidents raised over time by detector kind (hang, collective_mismatch, straggler, crash, loss_nan, loss_spike, grad_explosion, dead_grad, vanishing_grad, lr_stuck, loss_scale_collapse, loss_trend, step_time_spike, xid, ecc, node_lost).",
            [query(events(_incidents(), "$__rate_interval", "trainwatch_job, kind"), "{{trainwatch_job}} {{kind}}")],
            bars=True, minimum=0,
        ))
        .with_panel(graph(
            "Badput by cause",
            "Wall time lost since the job started, by cause: startup (before the first step), detection (fault to incident), capture_checkpoint (stacks and emergency checkpoint), restart (teardown, rendezvous, load, first step), recompute (re-running the steps lost since the last checkpoint) and hung (stalled with nothing else going on). Stacked: the top is all the time lost.",
            [query(f"sum by (trainwatch_job, cause) (trainwatch_badput_seconds_total{{{NODE}}})", JOB_LEGEND + " {{cause}}")],
            unit="s", minimum=0, stacked=True,
        ))
        .with_panel(graph(
            "Restarts",
            "Worker group restarts since launch; each step up is one restart.",
            [query(f"max by (trainwatch_job) (trainwatch_restarts_total{{{NODE}}})", JOB_LEGEND)],
            stepped=True, minimum=0,
        ))
    )
    return finish(b)


def ranks_dashboard() -> dm.Dashboard:
    b = base(
        "trainwatch-ranks",
        "trainwatch: ranks and stragglers",
        "Which rank sets the pace: the slowest ranks now, compute slowdown against the group median, and the step-time distribution.",
    )
    b = (
        b.with_row(db.Row("Slowest ranks now"))
        .with_panel(grid(
            "Top 10 by slowdown ratio",
            f"Ranks whose compute time is furthest above the group median (1.0 = typical, {STRAGGLER_RATIO} = straggler alert). "
            "Compute time, not step time: ranks waiting in collectives are victims and score near 1.",
            [query(f"topk(10, trainwatch_straggler_slowdown_ratio{{{RANK}}})")],
            ["Time", "__name__"],
            span=12, red_at=STRAGGLER_RATIO, sort_by="Value",
        ))
        .with_panel(grid(
            "Top 10 by step time",
            "Ranks with the longest last step. In a synchronous job every rank's step includes the wait for the slowest; "
            "compare with the slowdown ratio to tell the culprit from its victims.",
            [query(f"topk(10, trainwatch_step_time_seconds{{{RANK}}})")],
            ["Time", "__name__"],
            span=12, unit="s", sort_by="Value",
        ))
        .with_row(db.Row("Step time"))
        .with_panel(heat(
            "Step time of the slowest nodes",
            "One row per node (the 20 with the slowest rank), coloured by its slowest rank's step time. A row darker than the rest is where the straggler is; the whole heatmap darkening at once is a job-wide slowdown.",
            worst_nodes("step_time_seconds", "max", k=20),
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
            f"Rank compute time over the group median (1.0 = typical): the job's spread (min, median, p99, max) and its {WORST} slowest ranks. Above the dashed {STRAGGLER_RATIO} line for minutes: a straggler; see the straggler runbook.",
            # The straggler detector runs once per job (on the aggregator in a
            # multi-node job): its spread is a job aggregate.
            [query(f'trainwatch_job_straggler_slowdown_ratio{{{JOB}}}', "{{trainwatch_job}} {{stat}}"),
             worst_ranks("straggler_slowdown_ratio")],
            threshold=STRAGGLER_RATIO, minimum=0,
        ))
        .with_panel(graph(
            "Straggler incidents",
            "Straggler incidents raised by the sidecar (persistent slowdown over its window).",
            [query(events(_incidents("straggler"), "$__rate_interval", "trainwatch_job"), JOB_LEGEND)],
            bars=True, minimum=0,
        ))
        .with_row(db.Row("Where the ranks are"))
        .with_panel(graph(
            "Lowest steps",
            f"The job's lowest and highest step and its {WORST} ranks furthest behind. Synchronous ranks stay within a step of each other; a rank that stops climbing is stuck.",
            [query(f"min by (trainwatch_job) ({node_stat('step', 'min')})", "{{trainwatch_job}} min"),
             query(f"max by (trainwatch_job) ({node_stat('step', 'max')})", "{{trainwatch_job}} max"),
             worst_ranks("step", lowest=True)],
            span=8,
        ))
        .with_panel(graph(
            "Heartbeat age",
            "Seconds since a rank's background thread last ran, on the 10 nodes where it is oldest. Stale together with a stale progress age: the process is stopped or holds the GIL; "
            "fresh: it is waiting (collective, I/O).",
            [worst_nodes("heartbeat_age_seconds", "max")],
            unit="s", span=8, minimum=0,
        ))
        .with_panel(grid(
            "Ranks per phase now",
            "How many ranks are in each phase (data, forward, backward, optimizer, checkpoint, ...), per job. During a hang, the phase only a few ranks are in is usually the culprit's; the Node and Rank variables find them.",
            [query(f"sum by (trainwatch_job, phase) (rate(trainwatch_phase_seconds_total{{{NODE}}}[$__rate_interval])) > 0")],
            ["Time"],
            span=8,
        ))
    )
    return finish(b)


def collectives_dashboard() -> dm.Dashboard:
    completed_min = node_stat("collective_seq", "min", ',state="completed"')
    completed_max = node_stat("collective_seq", "max", ',state="completed"')
    enqueued_min = node_stat("collective_seq", "min", ',state="enqueued"')
    enqueued_max = node_stat("collective_seq", "max", ',state="enqueued"')
    behind = f"max by (trainwatch_job, pg) ({completed_max}) - on (trainwatch_job, pg) group_right {completed_min}"
    b = base(
        "trainwatch-collectives",
        "trainwatch: collectives",
        "Collective sequence numbers per process group (from PyTorch's flight recorder), from each node's lowest and highest rank: who is behind, by how much, and whether ranks disagree.",
    )
    b = (
        b.with_row(db.Row("Now"))
        .with_panel(single("Process groups", "Process groups whose collectives the ranks report.",
                           [query(f"count(count by (pg) ({completed_max}))")], span=6))
        .with_panel(single("Largest skew", "Largest gap in completed collectives between ranks of one group. A few is normal jitter; a gap that grows is a desync or a stuck rank.",
                           [query(f"max(max by (trainwatch_job, pg) ({completed_max}) - min by (trainwatch_job, pg) ({completed_min}))")], span=6, red_at=10))
        .with_panel(single("Largest in-flight lag", "Most collectives a node's ranks have launched but not completed. It stays up on a rank stuck inside a collective.",
                           [query(f"max({enqueued_max} - ignoring(state, stat) {completed_min})")], span=6, red_at=5))
        .with_panel(single("Mismatch incidents in range", "Collective mismatch incidents: ranks of a group disagree on which collective comes next (like NCCL RAS). See the collective-mismatch runbook.",
                           [query(events(_incidents("collective_mismatch"), "$__range", "trainwatch_job", zero=True), JOB_LEGEND)], span=6, red_at=1, decimals=0))
        .with_row(db.Row("Sequence numbers"))
        .with_panel(graph(
            "Completed collectives",
            "Last completed collective sequence number per process group: the job's lowest and highest rank. The lines climb together in a healthy job; a lowest line that flattens is a stuck rank.",
            [query(f"min by (trainwatch_job, pg) ({completed_min})", "{{trainwatch_job}} pg {{pg}} lowest"),
             query(f"max by (trainwatch_job, pg) ({completed_max})", "{{trainwatch_job}} pg {{pg}} highest")],
        ))
        .with_panel(graph(
            "Enqueued collectives",
            "Last launched collective sequence number per group, lowest and highest rank. Enqueued far above completed: ranks wait inside a collective for a peer.",
            [query(f"min by (trainwatch_job, pg) ({enqueued_min})", "{{trainwatch_job}} pg {{pg}} lowest"),
             query(f"max by (trainwatch_job, pg) ({enqueued_max})", "{{trainwatch_job}} pg {{pg}} highest")],
        ))
        .with_row(db.Row("Skew between ranks"))
        .with_panel(graph(
            "Skew within each process group",
            "Max minus min sequence number across the ranks of each group, completed and enqueued. A gap that grows means some ranks are behind or out of step.",
            [
                query(f"max by (trainwatch_job, pg) ({completed_max}) - min by (trainwatch_job, pg) ({completed_min})", "{{trainwatch_job}} pg {{pg}} completed"),
                query(f"max by (trainwatch_job, pg) ({enqueued_max}) - min by (trainwatch_job, pg) ({enqueued_min})", "{{trainwatch_job}} pg {{pg}} enqueued"),
            ],
            minimum=0,
        ))
        .with_panel(graph(
            "Collectives behind the group's leader",
            "The 10 nodes whose lowest rank has completed the fewest collectives compared with the most advanced rank of its group. The node that stays behind holds the rank the others wait for.",
            [query(f"topk(10, {behind})", NODE_LEGEND + " pg {{pg}}")],
            minimum=0,
        ))
        .with_row(db.Row("In flight"))
        .with_panel(graph(
            "In-flight collectives (enqueued - completed)",
            "Collectives launched but not finished, per node and group, the 10 highest. A lag that stays up is a rank stuck in a collective, usually waiting for a peer that never joined.",
            [query(f"topk(10, {enqueued_max} - ignoring(state, stat) {completed_min})", NODE_LEGEND + " pg {{pg}}")],
            minimum=0,
        ))
        .with_panel(grid(
            "Nodes furthest behind now",
            "The 20 nodes whose lowest rank completed the fewest collectives, per group, for a quick side-by-side during a hang.",
            [query(f"bottomk(20, {completed_min})")],
            ["Time", "__name__"],
            span=12,
        ))
    )
    return finish(b)


def gpu_dashboard() -> dm.Dashboard:
    xid = f"trainwatch_gpu_xid_errors_total{{{GPU}}}"
    ecc = f"trainwatch_gpu_ecc_errors_total{{{GPU}}}"

    def spread(metric: str, *, lowest: bool) -> list:
        """A GPU reading's spread over the job's GPUs, and the few GPUs at its bad end."""
        series = f"trainwatch_gpu_{metric}{{{GPU}}}"
        return [
            query(f"min by (trainwatch_job) ({series})", "{{trainwatch_job}} min"),
            query(f"quantile by (trainwatch_job) (0.5, {series})", "{{trainwatch_job}} median"),
            query(f"max by (trainwatch_job) ({series})", "{{trainwatch_job}} max"),
            query(f"{'bottomk' if lowest else 'topk'}({WORST}, {series})", GPU_LEGEND),
        ]

    b = base(
        "trainwatch-gpu",
        "trainwatch: GPU health",
        "NVML readings of the job's GPUs: load, memory, thermals, power, clocks, throttling, Xid and ECC errors; "
        "each reading's spread and the GPUs at its bad end. Series carry the GPU's UUID, as DCGM exporter's do.",
    ).with_variable(label_variable("gpu", "GPU", 'trainwatch_gpu_utilization_ratio{trainwatch_job=~"$job",node=~"$node"}'))
    b = (
        b.with_row(db.Row("Errors"))
        .with_panel(single(
            "Xid errors in range",
            "Driver-reported Xid errors in the selected range, every GPU of the job. `trainwatch explain` and the gpu-xid runbook give each code's meaning and action.",
            [query(events(xid, "$__range", "trainwatch_job", zero=True), JOB_LEGEND)],
            span=6, red_at=1, decimals=0,
        ))
        .with_panel(single(
            "Uncorrected ECC errors in range",
            "Any uncorrected ECC error means the GPU's results cannot be trusted: drain the node (gpu-ecc runbook).",
            [query(events(f'trainwatch_gpu_ecc_errors_total{{{GPU},type="uncorrected"}}', "$__range", "trainwatch_job", zero=True), JOB_LEGEND)],
            span=6, red_at=1, decimals=0,
        ))
        .with_panel(grid(
            "Xid codes seen",
            "The 20 GPUs with the most errors of an Xid code since their sidecar started, with the count and severity. critical: the GPU or node needs attention now; "
            "lower: often the application's own fault (a bad kernel, an illegal address).",
            [query(f"topk(20, max by (trainwatch_job, node, gpu, UUID, rank, xid, severity) (max_over_time(trainwatch_gpu_xid_code_errors_total{{{GPU}}}[$__range])))")],
            ["Time"],
            span=12, height=4,
        ))
        .with_panel(graph(
            "Xid and ECC counters",
            "Cumulative error counters of the 10 GPUs with the most; a step is a new error. Corrected ECC errors that keep climbing are worth a ticket.",
            [query(f"topk(10, sum by (trainwatch_job, node, gpu) ({xid}))", GPU_LEGEND + " xid"),
             query(f"topk(10, {ecc})", GPU_LEGEND + " ecc {{type}}")],
            stepped=True, minimum=0,
        ))
        .with_panel(graph(
            "Active throttle reasons",
            "GPUs with each clock throttle reason in effect. gpu_idle is harmless; thermal and power slowdowns cost step time and make stragglers.",
            [query(f"count by (trainwatch_job, reason) (trainwatch_gpu_throttle{{{GPU}}} > 0)", "{{trainwatch_job}} {{reason}}")],
            stepped=True, minimum=0,
        ))
        .with_row(db.Row("Load"))
        .with_panel(graph(
            "Utilization",
            f"Fraction of time a kernel ran: the job's spread and its {WORST} least busy GPUs. Low on all GPUs: input-bound or waiting; low on one: a straggler's peers waiting for it, or the straggler itself stalled.",
            spread("utilization_ratio", lowest=True),
            unit="percentunit", minimum=0, maximum=1,
        ))
        .with_panel(graph(
            "SM clock",
            f"Streaming-multiprocessor clock: the spread and the {WORST} slowest GPUs. A drop under load with a throttle reason set is thermal or power capping.",
            spread("sm_clock_hertz", lowest=True),
            unit="hertz", minimum=0,
        ))
        .with_row(db.Row("Memory"))
        .with_panel(graph(
            "Memory used",
            f"Device memory used: the spread and the {WORST} fullest GPUs, with the largest GPU's total for scale.",
            spread("memory_used_bytes", lowest=False)
            + [query(f"max by (trainwatch_job) (trainwatch_gpu_memory_total_bytes{{{GPU}}})", "{{trainwatch_job}} total")],
            unit="bytes", minimum=0,
        ))
        .with_panel(graph(
            "Memory used fraction",
            f"Used over total, the {WORST} fullest GPUs. Creeping towards 1.0 step after step: a leak on the way to an OOM.",
            [query(f"topk({WORST}, trainwatch_gpu_memory_used_bytes{{{GPU}}} / trainwatch_gpu_memory_total_bytes{{{GPU}}})", GPU_LEGEND)],
            unit="percentunit", minimum=0, maximum=1, threshold=0.95,
        ))
        .with_row(db.Row("Thermals and power"))
        .with_panel(graph(
            "Temperature",
            f"GPU core temperature: the spread and the {WORST} hottest GPUs. Above the dashed 85 C line most GPUs start to slow their clocks.",
            spread("temperature_celsius", lowest=False),
            unit="celsius", threshold=85,
        ))
        .with_panel(graph(
            "Power",
            f"Board power draw: the spread and the {WORST} GPUs drawing least. One GPU drawing much less than its peers under the same load is idle or throttled.",
            spread("power_watts", lowest=True),
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
