"""Generate trainwatch's Grafana dashboards from code.

    python dashboards/build.py           # rewrite dashboards/*.json
    python dashboards/build.py --check   # exit 1 if the committed JSON is stale

The JSON files are committed so Grafana users import them without Python; this
script is their single source. Every query filters by the `job`, `node` and
`rank` template variables (and `gpu` on the GPU dashboard), and every panel reads
from the `${datasource}` variable, so one import serves any Prometheus.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Callable

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus as pq
from grafana_foundation_sdk.builders import stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

HERE = Path(__file__).resolve().parent

DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
"""Every panel and variable points at the datasource variable, never a fixed uid."""

# Label matchers. Metrics with a rank label take RANK; per-node counters
# (incidents, restarts) have no rank label, so they take NODE only.
NODE = 'job=~"$job",node=~"$node"'
RANK = NODE + ',rank=~"$rank"'
GPU = RANK + ',gpu=~"$gpu"'

RANK_LEGEND = "{{node}} rank {{rank}}"
GPU_LEGEND = "{{node}} gpu {{gpu}}"

STALL_SECONDS = 60
"""Progress age that alerts.yml calls a stalled rank; drawn as a threshold line."""
STRAGGLER_RATIO = 1.5
"""Slowdown ratio that alerts.yml calls a straggler; drawn as a threshold line."""


# ---- small builders ------------------------------------------------------------


def query(expr: str, legend: str = "", *, instant: bool = False, as_table: bool = False) -> pq.Dataquery:
    q = pq.Dataquery().expr(expr).datasource(DATASOURCE)
    if legend:
        q = q.legend_format(legend)
    if instant:
        q = q.instant()
    if as_table:
        q = q.format(pm.PromQueryFormat.TABLE)
    return q


def _with_targets(panel, targets: list[pq.Dataquery]):
    # Grafana keys a panel's queries by refId; give them stable letters.
    for i, target in enumerate(targets):
        panel = panel.with_target(target.ref_id(chr(ord("A") + i)))
    return panel


def _thresholds(*steps: tuple[float | None, str]) -> db.ThresholdsConfig:
    return (
        db.ThresholdsConfig()
        .mode(dm.ThresholdsMode.ABSOLUTE)
        .steps([dm.Threshold(value=value, color=color) for value, color in steps])
    )


def graph(
    title: str,
    description: str,
    targets: list[pq.Dataquery],
    *,
    unit: str = "short",
    span: int = 12,
    height: int = 8,
    threshold: float | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    stepped: bool = False,
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(span)
        .height(height)
        .legend(cb.VizLegendOptions().display_mode(cm.LegendDisplayMode.LIST).placement(cm.LegendPlacement.BOTTOM).show_legend(True))
    )
    if threshold is not None:
        # A dashed line at the value the matching alert fires on, so the graph
        # and the page tell the same story.
        panel = panel.thresholds(_thresholds((None, "green"), (threshold, "red"))).thresholds_style(
            cb.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode.DASHED)
        )
    if minimum is not None:
        panel = panel.min(minimum)
    if maximum is not None:
        panel = panel.max(maximum)
    if stepped:  # counters that jump: draw the jump where it happened
        panel = panel.line_interpolation(cm.LineInterpolation.STEP_AFTER)
    return _with_targets(panel, targets)


def single(
    title: str,
    description: str,
    targets: list[pq.Dataquery],
    *,
    unit: str = "short",
    span: int = 6,
    height: int = 4,
    red_at: float | None = None,
) -> stat.Panel:
    panel = (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(span)
        .height(height)
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .graph_mode(cm.BigValueGraphMode.NONE)
        .color_mode(cm.BigValueColorMode.VALUE)
        .no_value("0")
    )
    if red_at is not None:
        panel = panel.thresholds(_thresholds((None, "green"), (red_at, "red")))
    return _with_targets(panel, targets)


def grid(title: str, description: str, target: pq.Dataquery, hide: list[str], *, span: int = 8, height: int = 8) -> table.Panel:
    organize = dm.DataTransformerConfig(id_val="organize", options={"excludeByName": {name: True for name in hide}})
    panel = (
        table.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .span(span)
        .height(height)
        .with_transformation(organize)
    )
    return _with_targets(panel, [target])


def label_variable(name: str, label: str, source: str) -> db.QueryVariable:
    """A multi-select variable over one label's values; "All" is the regex .*
    so series that lack a value (a GPU not mapped to a rank) still match."""
    return (
        db.QueryVariable(name)
        .label(label)
        .query(f"label_values({source}, {name})")
        .datasource(DATASOURCE)
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.NATURAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(dm.VariableOption(selected=True, text=["All"], value=["$__all"]))
    )


def base(uid: str, title: str, description: str) -> db.Dashboard:
    return (
        db.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["trainwatch"])
        .editable()
        .refresh("10s")
        .time("now-1h", "now")
        .timezone("browser")
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .link(
            db.DashboardLink("trainwatch")
            .type(dm.DashboardLinkType.DASHBOARDS)
            .tags(["trainwatch"])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
        .with_variable(db.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(label_variable("job", "Job", "trainwatch_step"))
        .with_variable(label_variable("node", "Node", 'trainwatch_step{job=~"$job"}'))
        .with_variable(label_variable("rank", "Rank", 'trainwatch_step{job=~"$job",node=~"$node"}'))
    )


def finish(builder: db.Dashboard) -> dm.Dashboard:
    dash = builder.build()
    # Stable, unique panel ids: Grafana uses them in links and the --check diff
    # must not move when a panel is added elsewhere in the file.
    for i, panel in enumerate(dash.panels or [], start=1):
        panel.id_val = i
    return dash


# ---- dashboards ------------------------------------------------------------------


def training_dashboard() -> dm.Dashboard:
    completed = f'trainwatch_collective_seq{{{RANK},state="completed"}}'
    enqueued = f'trainwatch_collective_seq{{{RANK},state="enqueued"}}'
    buckets = f"rate(trainwatch_step_duration_seconds_bucket{{{RANK}}}[$__rate_interval])"
    b = base(
        "trainwatch-training",
        "trainwatch: training progress",
        "Step rate, loss, step time, stalls, stragglers, collective progress and incidents per rank.",
    )
    b = (
        b.with_row(db.Row("Overview"))
        .with_panel(single("Ranks reporting", "Ranks whose slot the sidecar reads.", [query(f"count by (job) (trainwatch_step{{{RANK}}})", "{{job}}")]))
        .with_panel(single("Current step", "Highest completed step across the selected ranks.", [query(f"max by (job) (trainwatch_step{{{RANK}}})", "{{job}}")]))
        .with_panel(
            single(
                "Incidents in range by kind",
                "Incidents raised in the selected time range; `trainwatch diagnose <job>` explains the last one.",
                [query(f"sum by (kind) (increase(trainwatch_incidents_total{{{NODE}}}[$__range]))", "{{kind}}")],
                red_at=1,
            )
        )
        .with_panel(
            single(
                "Worker group restarts",
                "Restarts since launch; each one resumed from the newest valid checkpoint.",
                [query(f"max by (job) (trainwatch_restarts_total{{{NODE}}})", "{{job}}")],
                red_at=1,
            )
        )
        .with_row(db.Row("Progress"))
        .with_panel(
            graph(
                "Step rate",
                "Completed steps per second. A rank falling to zero is stalled; all ranks falling together is a collective wait or an input stall.",
                # trainwatch_step only grows within a run; a resume from an
                # earlier checkpoint reads as a counter reset, which rate() absorbs.
                [query(f"rate(trainwatch_step{{{RANK}}}[$__rate_interval])", RANK_LEGEND)],
                unit="steps/s",
            )
        )
        .with_panel(graph("Step", "Last completed step per rank.", [query(f"trainwatch_step{{{RANK}}}", RANK_LEGEND)]))
        .with_row(db.Row("Model health"))
        .with_panel(graph("Loss", "Loss reported at each rank's last step.", [query(f"trainwatch_loss{{{RANK}}}", RANK_LEGEND)]))
        .with_panel(
            graph(
                "Gradient norm",
                "Gradient norm at each rank's last step; a sudden climb often precedes a loss spike or NaN.",
                [query(f"trainwatch_grad_norm{{{RANK}}}", RANK_LEGEND)],
            )
        )
        .with_row(db.Row("Step time and stalls"))
        .with_panel(
            graph(
                "Step duration p50 / p99",
                "From the step-duration histogram. A p99 far above p50 means periodic slow steps (checkpoints, GC, data stalls).",
                [
                    query(f"histogram_quantile(0.5, sum by (job, le) ({buckets}))", "{{job}} p50"),
                    query(f"histogram_quantile(0.99, sum by (job, le) ({buckets}))", "{{job}} p99"),
                ],
                unit="s",
                span=8,
            )
        )
        .with_panel(
            graph(
                "Last progress age",
                "Seconds since each rank completed a step. It climbs without bound on a hung rank.",
                [query(f"trainwatch_last_progress_age_seconds{{{RANK}}}", RANK_LEGEND)],
                unit="s",
                span=8,
                threshold=STALL_SECONDS,
            )
        )
        .with_panel(
            graph(
                "Heartbeat age",
                "Seconds since a rank's background thread last ran. Stale with a stale progress age: the process is stopped or holds the GIL; fresh: it waits (collective, I/O).",
                [query(f"trainwatch_heartbeat_age_seconds{{{RANK}}}", RANK_LEGEND)],
                unit="s",
                span=8,
            )
        )
        .with_row(db.Row("Stragglers and collectives"))
        .with_panel(
            graph(
                "Straggler slowdown",
                "Rank compute time over the group median (1.0 = typical). Ranks waiting in collectives are victims, not culprits.",
                [query(f"trainwatch_straggler_slowdown_ratio{{{RANK}}}", RANK_LEGEND)],
                span=8,
                threshold=STRAGGLER_RATIO,
            )
        )
        .with_panel(
            graph(
                "Collective lag (enqueued - completed)",
                "Collectives a rank has launched but not finished, per process group. A lag that stays up is a rank stuck in a collective.",
                [query(f"{enqueued} - ignoring(state) {completed}", RANK_LEGEND + " pg {{pg}}")],
                span=8,
            )
        )
        .with_panel(
            graph(
                "Completed collectives spread across ranks",
                "Max minus min completed collective sequence number per process group. "
                "A small jitter is normal; a gap that grows means some ranks are behind or out of step.",
                [query(f"max by (job, pg) ({completed}) - min by (job, pg) ({completed})", "{{job}} pg {{pg}}")],
                span=8,
            )
        )
        .with_row(db.Row("Phases, incidents and restarts"))
        .with_panel(
            grid(
                "Current phase per rank",
                "The phase each rank is in now (forward, backward, optimizer, data, checkpoint, ...).",
                query(f"trainwatch_phase{{{RANK}}} == 1", instant=True, as_table=True),
                ["Time", "Value", "__name__"],
            )
        )
        .with_panel(
            graph(
                "Incidents by kind",
                "Incidents raised over time, by detector kind.",
                [query(f"sum by (kind) (increase(trainwatch_incidents_total{{{NODE}}}[$__rate_interval]))", "{{kind}}")],
                span=8,
            )
        )
        .with_panel(
            graph(
                "Restarts",
                "Worker group restarts since launch; steps show when each happened.",
                [query(f"trainwatch_restarts_total{{{NODE}}}", "{{job}} {{node}}")],
                span=8,
                stepped=True,
            )
        )
    )
    return finish(b)


def gpu_dashboard() -> dm.Dashboard:
    xid = f"trainwatch_gpu_xid_errors_total{{{GPU}}}"
    ecc = f"trainwatch_gpu_ecc_errors_total{{{GPU}}}"
    b = base(
        "trainwatch-gpu",
        "trainwatch: GPU health",
        "NVML readings per GPU: load, memory, thermals, power, clocks, throttling, XID and ECC errors.",
    ).with_variable(label_variable("gpu", "GPU", 'trainwatch_gpu_utilization_ratio{job=~"$job",node=~"$node"}'))
    b = (
        b.with_row(db.Row("Errors"))
        .with_panel(
            single(
                "XID errors in range",
                "Driver-reported XID errors in the selected range. `trainwatch explain` names the XID's meaning and action.",
                [query(f"sum by (node, gpu) (increase({xid}[$__range]))", GPU_LEGEND)],
                span=8,
                red_at=1,
            )
        )
        .with_panel(
            single(
                "ECC errors in range",
                "Corrected errors are worth watching; any uncorrected error means the GPU's data cannot be trusted.",
                [query(f"sum by (node, gpu, type) (increase({ecc}[$__range]))", GPU_LEGEND + " {{type}}")],
                span=8,
                red_at=1,
            )
        )
        .with_panel(
            graph(
                "XID and ECC counters",
                "Cumulative error counters since the poller started.",
                [query(xid, GPU_LEGEND + " xid"), query(ecc, GPU_LEGEND + " ecc {{type}}")],
                span=8,
                height=4,
                stepped=True,
            )
        )
        .with_row(db.Row("Load"))
        .with_panel(
            graph(
                "Utilization",
                "Fraction of time a kernel ran. Low on all GPUs: input-bound or waiting; low on one: a straggler's peers waiting for it.",
                [query(f"trainwatch_gpu_utilization_ratio{{{GPU}}}", GPU_LEGEND)],
                unit="percentunit",
                minimum=0,
                maximum=1,
            )
        )
        .with_panel(
            graph(
                "SM clock",
                "Streaming-multiprocessor clock. A drop under load with a throttle reason set is thermal or power capping.",
                [query(f"trainwatch_gpu_sm_clock_hertz{{{GPU}}}", GPU_LEGEND)],
                unit="hertz",
            )
        )
        .with_row(db.Row("Memory"))
        .with_panel(
            graph(
                "Memory used",
                "Device memory used, with each GPU's total for scale.",
                [
                    query(f"trainwatch_gpu_memory_used_bytes{{{GPU}}}", GPU_LEGEND + " used"),
                    query(f"trainwatch_gpu_memory_total_bytes{{{GPU}}}", GPU_LEGEND + " total"),
                ],
                unit="bytes",
            )
        )
        .with_panel(
            graph(
                "Memory used fraction",
                "Used over total. Creeping towards 1.0 step after step: a leak on the way to an OOM.",
                [
                    query(
                        f"trainwatch_gpu_memory_used_bytes{{{GPU}}} / trainwatch_gpu_memory_total_bytes{{{GPU}}}",
                        GPU_LEGEND,
                    )
                ],
                unit="percentunit",
                minimum=0,
                maximum=1,
            )
        )
        .with_row(db.Row("Thermals, power and throttling"))
        .with_panel(
            graph(
                "Temperature",
                "GPU core temperature.",
                [query(f"trainwatch_gpu_temperature_celsius{{{GPU}}}", GPU_LEGEND)],
                unit="celsius",
                span=8,
                threshold=85,
            )
        )
        .with_panel(
            graph(
                "Power",
                "Board power draw.",
                [query(f"trainwatch_gpu_power_watts{{{GPU}}}", GPU_LEGEND)],
                unit="watt",
                span=8,
            )
        )
        .with_panel(
            graph(
                "Active throttle reasons",
                "Clock throttle reasons in effect (1 = active). gpu_idle is harmless; thermal and power slowdowns cost step time.",
                [query(f"trainwatch_gpu_throttle{{{GPU}}} > 0", GPU_LEGEND + " {{reason}}")],
                span=8,
                stepped=True,
            )
        )
    )
    return finish(b)


DASHBOARDS: dict[str, Callable[[], dm.Dashboard]] = {
    "trainwatch-training.json": training_dashboard,
    "trainwatch-gpu.json": gpu_dashboard,
}


def render(dash: dm.Dashboard) -> str:
    # sort_keys + fixed indent: regenerating an unchanged dashboard is a no-op diff.
    return json.dumps(dash, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def rendered() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {name: render(make()) for name, make in DASHBOARDS.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Generate trainwatch's Grafana dashboards.")
    p.add_argument("--check", action="store_true", help="exit 1 if the committed JSON differs from the generated JSON")
    p.add_argument("--out", type=Path, default=HERE, help="directory to write the JSON files to (default: dashboards/)")
    args = p.parse_args(argv)
    stale = []
    for name, text in rendered().items():
        path = args.out / name
        old = path.read_text() if path.exists() else ""
        if args.check:
            if old != text:
                stale.append(name)
                sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True), str(path), "generated", n=1))
        elif old != text:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"error: {', '.join(stale)} out of date; run: python dashboards/build.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
